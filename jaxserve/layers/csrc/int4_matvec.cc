// y [M, N] = x [M, K] @ W [K, N] for a few f32 rows x (batch-1 decode) and a group-quantized
// weight W (layers/int4.py's Int4Weight: int4 codes packed 8 per int32 word along the input rows,
// or int8 codes), dequantised on the fly: W is read once, in its quantized bytes, and never
// written out in f32. XLA:CPU has no such fusion (it dequantises a tile to memory, then runs its
// dot on it), so this is an XLA FFI custom call; layers/int4_cpu.py compiles and registers it.
//
// Per group of g input rows and output column n:
//   sum_k x[k] * (code[k, n] * s[n] + b[n]) = s[n] * sum_k x[k] * code[k, n] + b[n] * sum_k x[k]
// with b = offset - zero * s (zero: the stored zero point, 8 for symmetric int4, 0 for int8), so
// the inner loop is a mask, a convert and one multiply-add per code and row, in vector registers.
// Each thread takes ranges of output columns and reads them group by group, every row in address
// order. The weight may carry a leading stacked-layer axis; `layer` picks the slice (the layer
// scan passes the stack whole, so XLA copies no layer's weights out of it).
//
// Written with GCC / Clang vector extensions and compiled with -march=native: 16-lane vectors are
// one AVX-512 register, two AVX2 ones or four NEON ones.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t NB = 64;        // output columns per block a thread claims at a time
constexpr int64_t MAX_ROWS = 8;

struct Problem {
  // the layer's slice of each weight array:
  const void* q;         // int32 [K/8, N] (bits 4) or int8 [K, N] (bits 8)
  const float* scale;    // [G, N]
  const uint8_t* zero;   // [G, N] or null
  const float* offset;   // [G, N] or null
  float* y;              // [M, N]
  int64_t M, K, N, g, bits;
  float sym;             // zero point when `zero` is null (8 for symmetric int4, 0 for int8)
  const float* xsum;     // [M, G]: each group's sum of x
  const float* xq;       // [M, K]: x[m, k] * 16^-(k % 8) for int4 codes (x itself for int8)
};

typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int L = 16;

template <typename V, typename T>
inline V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// Group gi's contribution to columns [n0, n0 + V * 16) of y (in memory): M x V accumulators in
// registers (M * V <= 8).
template <int M, int V>
inline void group(const Problem& p, int64_t gi, int64_t n0) {
  const int64_t N = p.N, K = p.K, g = p.g, G = K / g;
  vf a[M][V] = {};
  if (p.bits == 4) {
    const int32_t* q = static_cast<const int32_t*>(p.q);
    for (int64_t r = gi * g / 8; r < (gi + 1) * g / 8; ++r) {
      const int32_t* qr = q + r * N + n0;
      vu w[V];
      for (int v = 0; v < V; ++v) w[v] = load<vu>(qr + v * L);
      for (int j = 0; j < 8; ++j) {
        // nibble j left in place: code * 16^j (exact in f32) times x * 16^-j (p.xq) is the
        // same product, powers of two scaling exactly, and one shift a code cheaper
        const uint32_t mask = 0xFu << (4 * j);
        for (int v = 0; v < V; ++v) {
          const vf code = __builtin_convertvector(w[v] & mask, vf);
          for (int m = 0; m < M; ++m) a[m][v] += p.xq[m * K + 8 * r + j] * code;
        }
      }
    }
  } else {
    const int8_t* q = static_cast<const int8_t*>(p.q);
    for (int64_t k = gi * g; k < (gi + 1) * g; ++k) {
      const int8_t* qk = q + k * N + n0;
      for (int v = 0; v < V; ++v) {
        int8_t b[L];
        std::memcpy(b, qk + v * L, L);
        vi c;
        for (int i = 0; i < L; ++i) c[i] = b[i];
        const vf code = __builtin_convertvector(c, vf);
        for (int m = 0; m < M; ++m) a[m][v] += p.xq[m * K + k] * code;
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t at = gi * N + n0 + v * L;
    const vf s = load<vf>(p.scale + at);
    vf zp = vf{} + p.sym;
    if (p.zero) {
      vi z;
      for (int i = 0; i < L; ++i) z[i] = p.zero[at + i];
      zp = __builtin_convertvector(z, vf);
    }
    const vf b = (p.offset ? load<vf>(p.offset + at) : vf{}) - zp * s;
    for (int m = 0; m < M; ++m) {
      float* out = p.y + m * N + n0 + v * L;
      const vf acc = load<vf>(out) + s * a[m][v] + b * p.xsum[m * G + gi];
      std::memcpy(out, &acc, sizeof(vf));
    }
  }
}

// Vectors of 16 columns per `group` call: its 2 M V accumulators fit the registers.
template <int M>
constexpr int vectors() { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }

// Columns [c0, c1) of y, group by group: each group's rows are read in address order across the
// range (whole cache lines, in order, for the hardware prefetchers), the partial sums kept in y.
template <int M>
void run_range(const Problem& p, int64_t c0, int64_t c1) {
  constexpr int V = vectors<M>();
  for (int m = 0; m < M; ++m) std::memset(p.y + m * p.N + c0, 0, (c1 - c0) * sizeof(float));
  for (int64_t gi = 0; gi < p.K / p.g; ++gi) {
    int64_t c = c0;
    for (; c + V * L <= c1; c += V * L) group<M, V>(p, gi, c);
    for (; c < c1; c += L) group<M, 1>(p, gi, c);
  }
}

void run(const Problem& p, int64_t b0, int64_t b1) {
  const int64_t c0 = b0 * NB, c1 = std::min(p.N, b1 * NB);
  switch (p.M) {
    case 1: return run_range<1>(p, c0, c1);
    case 2: return run_range<2>(p, c0, c1);
    case 3: return run_range<3>(p, c0, c1);
    case 4: return run_range<4>(p, c0, c1);
    case 5: return run_range<5>(p, c0, c1);
    case 6: return run_range<6>(p, c0, c1);
    case 7: return run_range<7>(p, c0, c1);
    default: return run_range<8>(p, c0, c1);
  }
}

// Blocks are claimed from a shared counter by the calling thread and by tasks on XLA's intra-op
// pool; the caller waits only for blocks another thread has claimed, so a task the pool never
// runs costs nothing and nothing can deadlock.
struct Shared {
  Problem p;
  int64_t blocks, per_claim;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  void work() {
    for (;;) {
      int64_t b0 = next.fetch_add(per_claim);
      if (b0 >= blocks) return;
      int64_t b1 = std::min(blocks, b0 + per_claim);
      run(p, b0, b1);
      done.fetch_add(b1 - b0, std::memory_order_release);
    }
  }
};

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::U8> zero,
                ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> layer,
                ffi::ResultBuffer<ffi::F32> y, int64_t group_size, int64_t bits) {
  auto xd = x.dimensions();
  auto sd = scale.dimensions();
  auto qd = q.dimensions();
  const size_t rank = sd.size();
  if (xd.size() != 2 || (rank != 2 && rank != 3) || qd.size() != rank)
    return ffi::Error::InvalidArgument("int4_matvec: x must be [M, K], the weight [(L,) rows, N]");
  const int64_t M = xd[0], K = xd[1], N = sd[rank - 1], G = sd[rank - 2];
  const int64_t L = rank == 3 ? sd[0] : 1;
  const int64_t pack = bits == 4 ? 8 : 1;
  if (M < 1 || M > MAX_ROWS || K != G * group_size || N % 16 || group_size % 8 ||
      (bits != 4 && bits != 8) || qd[rank - 2] * pack != K || qd[rank - 1] != N ||
      (bits == 4 && q.element_type() != ffi::S32) || (bits == 8 && q.element_type() != ffi::S8))
    return ffi::Error::InvalidArgument("int4_matvec: unsupported shape or code type");
  const int64_t l = rank == 3 ? layer.typed_data()[0] : 0;
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("int4_matvec: layer index out of range");
  const int64_t codes = K / pack * N;  // q elements per layer
  const int64_t groups = G * N;        // scale (zero, offset) elements per layer
  const float* xd0 = x.typed_data();
  std::unique_ptr<float[]> xsum(new float[M * G]);
  std::unique_ptr<float[]> xq(new float[M * K]);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < G; ++gi) {
      float s = 0.f;
      for (int64_t k = gi * group_size; k < (gi + 1) * group_size; ++k) s += xd0[m * K + k];
      xsum[m * G + gi] = s;
    }
  for (int64_t i = 0; i < M * K; ++i)
    xq[i] = bits == 4 ? std::ldexp(xd0[i], -4 * static_cast<int>(i % K % 8)) : xd0[i];
  auto sh = std::make_shared<Shared>();
  const void* qp = static_cast<const char*>(q.untyped_data()) + l * codes * (bits == 4 ? 4 : 1);
  sh->p = Problem{qp, scale.typed_data() + l * groups,
                  zero.element_count() ? zero.typed_data() + l * groups : nullptr,
                  offset.element_count() ? offset.typed_data() + l * groups : nullptr,
                  y->typed_data(), M, K, N, group_size, bits, bits == 4 ? 8.f : 0.f, xsum.get(),
                  xq.get()};
  sh->blocks = (N + NB - 1) / NB;
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const bool parallel = threads > 1 && K * N >= (1 << 17) && sh->blocks > 1;
  sh->per_claim = parallel ? std::max<int64_t>(1, sh->blocks / (threads * 4)) : sh->blocks;
  if (parallel)
    for (int64_t t = 1; t < threads; ++t) pool.Schedule([sh] { sh->work(); });
  sh->work();
  while (sh->done.load(std::memory_order_acquire) < sh->blocks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt4Matvec, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("bits"));
