// Column blocks back to the checkpoint layout, for the tiles (layers/int4.py's `int4_linear` on an
// `Int4Weight` with `col_block`, through layers/int4_cpu.py's `unblock`). Built into the same
// library as the fused matmul (int4_matvec.cc), whose layout this undoes a tile at a time.
#include <cstdint>
#include <cstring>

#include "claims.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The tiles' view of a weight array in column blocks: out [rows, blocks * cb] = rows [r0, r0 + rows)
// of blocks [b0, b0 + blocks) of a [(L,) N / cb, R, cb] array (layer `at[0]`, r0 `at[1]`, b0
// `at[2]`), in the checkpoint layout. XLA fuses its own transpose into the dequantisation of the
// tile, which then runs element by element (2.3x the checkpoint layout's matmul at 64 rows); as
// a copy of cb-element rows it costs one read and write of the codes.
ffi::Error UnblockImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::Buffer<ffi::S32> at,
                       ffi::Result<ffi::AnyBuffer> out, int64_t rows, int64_t blocks) {
  auto d = a.dimensions();
  if ((d.size() != 3 && d.size() != 4) || at.element_count() != 3 || out->element_type() != a.element_type())
    return ffi::Error::InvalidArgument("unblock: a must be [(L,) blocks, rows, cb], at [3]");
  const size_t n = d.size();
  const int64_t L = n == 4 ? d[0] : 1, NB = d[n - 3], R = d[n - 2], cb = d[n - 1];
  const int32_t* p = at.typed_data();
  const int64_t l = p[0], r0 = p[1], b0 = p[2];
  if (l < 0 || l >= L || r0 < 0 || r0 + rows > R || b0 < 0 || b0 + blocks > NB ||
      static_cast<int64_t>(out->element_count()) != rows * blocks * cb)
    return ffi::Error::InvalidArgument("unblock: rows or blocks out of range");
  const size_t es = ffi::ByteWidth(a.element_type()), run = cb * es;
  const char* src = static_cast<const char*>(a.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  // each thread a range of blocks: whole runs of the source, rows of the destination
  jaxserve::run_claims(pool, blocks, rows * blocks * run >= (1 << 16), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t b = c0; b < c1; ++b) {
      const char* from = src + ((l * NB + b0 + b) * R + r0) * run;
      for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + (r * blocks + b) * run, from + r * run, run);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveUnblock, UnblockImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("blocks"));
