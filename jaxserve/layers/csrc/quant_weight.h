// The group-quantized weight both CPU matmul kernels take (int4_matvec.cc, amx_matmul.cc): an
// Int4Weight (layers/int4.py) as the FFI hands it, int4 codes packed 8 per int32 word along the
// input rows or int8 codes, f32 or f16 scales (or int8 sub-scales under f16 super-block scales, which
// int4_matvec.cc locates itself: `sub_scales`), an optional zero point and offset, in the checkpoint
// layout [(L,) rows, N] or in column blocks [(L,) N / cb, rows, cb], the layer a stack's index.
// `check_weight` checks the shapes and types once and locates the layer's arrays.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

struct QuantWeight {
  int64_t M, K, N, G;     // x [M, K], y [M, N]; G groups of `group_size` inputs
  const void* q;          // the layer's codes: int32 [K / 8, N] (bits 4), int8 [K, N] or uint8 four a word
                          // (int32 [K / 4, N]; bits 8); blocked: [N / cb, rows, cb]
  const void* scale;      // the layer's scales [G, N] (same layout): f32, or f16 where `half`, or int8
                          // sub-scales (`sub_scales`)
  const uint8_t* zero;    // the layer's zero points [G, N], or null
  const void* offset;     // the layer's offsets [G, N] (scale's type), or null
  int64_t cb;             // the column block (N: the checkpoint layout)
  bool half;
};

// `kernel` names the kernel in the error messages.
inline xla::ffi::Error check_weight(const char* kernel, xla::ffi::Buffer<xla::ffi::F32>& x, xla::ffi::AnyBuffer& q,
                                    xla::ffi::AnyBuffer& scale, xla::ffi::Buffer<xla::ffi::U8>& zero,
                                    xla::ffi::AnyBuffer& offset, xla::ffi::Buffer<xla::ffi::S32>& layer,
                                    int64_t group_size, int64_t bits, int64_t col_block, QuantWeight& w,
                                    bool sub_scales = false) {
  namespace ffi = xla::ffi;
  auto xd = x.dimensions();
  auto sd = scale.dimensions();
  auto qd = q.dimensions();
  const size_t rank = sd.size(), blocked = col_block ? 1 : 0;    // rank: (L,) (N / cb,) rows, N or cb
  if (xd.size() != 2 || rank < 2 + blocked || rank > 3 + blocked || qd.size() != rank)
    return ffi::Error::InvalidArgument(std::string(kernel) +
                                       ": x must be [M, K], the weight [(L,) rows, N] or [(L,) N / cb, rows, cb]");
  const int64_t M = xd[0], K = xd[1], G = sd[rank - 2];
  const int64_t N = blocked ? sd[rank - 3] * col_block : sd[rank - 1];
  const int64_t L = rank == 3 + blocked ? sd[0] : 1;
  const bool k4 = bits == 8 && q.element_type() == ffi::S32;     // 8-bit codes four a word
  const int64_t pack = bits == 4 ? 8 : k4 ? 4 : 1;
  const auto st = scale.element_type();
  if (M < 1 || K != G * group_size || N % 16 || group_size % 8 || (bits != 4 && bits != 8) ||
      qd[rank - 2] * pack != K || qd[rank - 1] != sd[rank - 1] ||
      (blocked && (col_block % 64 || sd[rank - 1] != col_block || qd[rank - 3] != sd[rank - 3])) ||
      (bits == 4 && q.element_type() != ffi::S32) || (bits == 8 && !k4 && q.element_type() != ffi::S8) ||
      (sub_scales ? st != ffi::S8 : st != ffi::F32 && st != ffi::F16) ||
      (offset.element_count() && offset.element_type() != st))
    return ffi::Error::InvalidArgument(std::string(kernel) + ": unsupported shape, code or scale type");
  const int64_t l = rank == 3 + blocked ? layer.typed_data()[0] : 0;
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument(std::string(kernel) + ": layer index out of range");
  const size_t ss = st == ffi::F16 ? 2 : st == ffi::S8 ? 1 : 4;
  const int64_t codes = K / pack * N, groups = G * N;    // q and scale (zero, offset) elements a layer
  w = QuantWeight{M, K, N, G,
                  static_cast<const char*>(q.untyped_data()) + l * codes * (bits == 4 || k4 ? 4 : 1),
                  static_cast<const char*>(scale.untyped_data()) + l * groups * ss,
                  zero.element_count() ? zero.typed_data() + l * groups : nullptr,
                  offset.element_count() ? static_cast<const char*>(offset.untyped_data()) + l * groups * ss : nullptr,
                  blocked ? col_block : N, st == ffi::F16};
  return ffi::Error::Success();
}

}  // namespace jaxserve
