// Paged attention on CPU: out [T, K, G, D] for every real token of the step (zeros for padding).
// An XLA FFI custom call that attention/cpu_kernel.py wraps and layers/int4_cpu.py builds with the
// int4 kernel.
//
// Why: XLA:CPU runs the reference path's decode attention as two nested loops of gathers, dots
// and small fusions, ~40 us a layer at batch 1 with a short context, most of it per-op overhead.
// Here each (token, kv head) reads its context's K and V rows from the pages once, in place: the
// G query heads of the kv head share each K row (scores, then softmax, then the V rows). A token's
// result depends only on its query and its context, never on how its step was chunked or batched:
// a prompt computed in one chunk, in several, or after a prefix-cache hit gets the same numbers.
//
// q is scaled already (sm_scale); the pages are f32 [R, B, K, D] (the layer's rows of the stacked
// cache; the tables are offset to them), or int8 codes with a f32 scale per row and kv head
// ([R, B, K]; `--kv-cache-dtype int8`, attention/kv_quant.py): a quarter of the bytes to read,
// which is what decode attention costs here (a batch-64 step read ~147 MB of f32 pages).
// Sliding window (a token sees itself and window - 1 earlier tokens; 0: none), soft cap
// (cap * tanh(s / cap); 0: none) and sinks (a logit per head in the softmax denominator, no value)
// as the reference path applies them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "claims.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Attn {
  const float* q;       // [T, K, G, D]
  const void* k;        // [R, B, K, D] f32, or int8 with scales
  const void* v;
  const float* k_scale;  // [R, B, K]: an int8 page row's scale (kv_quant.py: x = code * scale), or null
  const float* v_scale;
  const int32_t* tables;  // [S, M]
  const float* sinks;   // [K, G] or null
  float* out;           // [T, K, G, D]
  int64_t T, K, G, D, R, B, M;
  float soft_cap;
  // per token: its sequence's table row, first and last KV position (-1: not attended here)
  std::vector<int64_t> seq, first, last;
};

template <typename E>
inline float dot(const float* __restrict a, const E* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

// exp(x) for x <= 0 (softmax after the max is subtracted) in plain arithmetic the compiler
// vectorizes: x = n ln2 + r with |r| <= ln2 / 2, Cephes' degree-5 polynomial for exp(r) (relative
// error ~1e-7, as libm's expf), times 2^n built in the exponent bits; below -87 it is 0.
inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &e, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return x <= -87.f ? 0.f : out;
}

using jaxserve::L;     // lanes of a vector, one register wide (simd.h)
using jaxserve::vf;
constexpr int VC = 4;   // output vectors a pass over the V rows accumulates in registers

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A bf16 page element: the high half of an f32.
struct bf16 {
  uint16_t bits;
  bf16() = default;
  explicit bf16(int v) : bits(0) { (void)v; }     // E(0): only zeros are made (a padding row)
  explicit operator float() const {
    const uint32_t b = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
};

// L values of a K or V row as f32: f32 pages, bf16 ones (widened exactly), or int8 codes (their
// row's scale applied after)
inline vf load_row(const float* p) { return load(p); }
inline vf load_row(const bf16* p) {
#if defined(__AVX512F__) && JAXSERVE_LANES == 16
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#elif defined(__AVX2__) && JAXSERVE_LANES == 8
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#else
  vf v;
  for (int i = 0; i < L; ++i) {
    const uint32_t b = static_cast<uint32_t>(p[i].bits) << 16;
    std::memcpy(&v[i], &b, 4);
  }
  return v;
#endif
}
inline vf load_row(const int8_t* p) {
#if defined(__AVX512F__) && JAXSERVE_LANES == 16
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__) && JAXSERVE_LANES == 8
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef int32_t vi __attribute__((vector_size(4 * L)));
  vi w;
  for (int i = 0; i < L; ++i) w[i] = p[i];
  return __builtin_convertvector(w, vf);
#endif
}

// r[m] = the sum of v[m]'s L lanes, for L vectors at once: a tree of shuffles and adds that
// pairs every vector's lanes the same way (l + L / 2, then ..., + 2, + 1), so a sum never depends
// on which slot its vector had.
#if JAXSERVE_LANES == 8
inline vf reduce(const vf* v) {
  vf x[4], y[2];
  for (int k = 0; k < 4; ++k)
    x[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * k], v[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int k = 0; k < 2; ++k)
    y[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(x[2 * k], x[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#else
inline vf reduce(const vf* v) {
  vf w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k)
    w[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * k], v[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)
    x[k] = __builtin_shufflevector(w[2 * k], w[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * k], w[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)
    y[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x[2 * k], x[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

// Scores of query q [D] against L K rows: each a product per lane over D / L chunks, then one
// reduce (D a multiple of L). Rows past the context are a row of zeros.
template <typename E>
inline vf scores(const float* q, const E* const* rows, int64_t D) {
  vf acc[L];
  for (int m = 0; m < L; ++m) {
    vf a = load(q) * load_row(rows[m]);
    for (int64_t c = L; c < D; c += L) a += load(q + c) * load_row(rows[m] + c);
    acc[m] = a;
  }
  return reduce(acc);
}

// One token's one kv head: scores of its G query heads over the context, softmax, values. E: the
// pages' element (f32, or int8 codes scaled per row).
template <typename E>
void attend(const Attn& a, int64_t t, int64_t kh, std::vector<float>& s) {
  const int64_t G = a.G, D = a.D, K = a.K;
  float* out = a.out + (t * K + kh) * G * D;
  std::memset(out, 0, G * D * sizeof(float));
  if (a.last[t] < 0) return;
  const int64_t p0 = a.first[t], n = a.last[t] - p0 + 1;
  const float* q = a.q + (t * K + kh) * G * D;
  const int32_t* table = a.tables + a.seq[t] * a.M;
  s.resize(G * n + G);
  float* denom = s.data() + G * n;
  // the context page by page: K (then V) rows of one page are contiguous but for the heads
  const int64_t B = a.B, stride = K * D;
  // fn(i, row, scale): position i's row of the pages, and its scale (1 for f32 pages)
  auto for_rows = [&](const void* pages, const float* scales, auto&& fn) {
    for (int64_t blk = p0 / B; blk <= a.last[t] / B; ++blk) {
      const E* base = static_cast<const E*>(pages) + (table[blk] * B * K + kh) * D;
      const float* sc = scales ? scales + table[blk] * B * K + kh : nullptr;
      const int64_t i0 = std::max(p0, blk * B), i1 = std::min(a.last[t] + 1, (blk + 1) * B);
      for (int64_t i = i0; i < i1; ++i)
        fn(i - p0, base + (i - blk * B) * stride, sc ? sc[(i - blk * B) * K] : 1.f);
    }
  };
  if (D % L == 0) {
    // L positions at a time (their row pointers gathered by the page walk)
    static const std::vector<E> zeros(1024);
    std::vector<E> pad;
    const E* zero = zeros.data();
    if (D > 1024) pad.assign(D, E(0)), zero = pad.data();
    const E* rows[L];
    float row_scale[L];
    int filled = 0;
    int64_t start = 0;
    auto flush = [&]() {
      for (int m = filled; m < L; ++m) rows[m] = zero;
      for (int64_t g = 0; g < G; ++g) {
        const vf sc = scores(q + g * D, rows, D);
        for (int m = 0; m < filled; ++m) s[g * n + start + m] = sc[m] * row_scale[m];
      }
      start += filled;
      filled = 0;
    };
    for_rows(a.k, a.k_scale, [&](int64_t, const E* kr, float scale) {
      row_scale[filled] = scale;
      rows[filled++] = kr;
      if (filled == L) flush();
    });
    if (filled) flush();
    if (a.soft_cap > 0.f)
      for (int64_t i = 0; i < G * n; ++i) s[i] = a.soft_cap * std::tanh(s[i] / a.soft_cap);
  } else {
    for_rows(a.k, a.k_scale, [&](int64_t i, const E* kr, float scale) {
      for (int64_t g = 0; g < G; ++g) {
        float x = dot(q + g * D, kr, D) * scale;
        if (a.soft_cap > 0.f) x = a.soft_cap * std::tanh(x / a.soft_cap);
        s[g * n + i] = x;
      }
    });
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s.data() + g * n;
    const float sink = a.sinks ? a.sinks[kh * G + g] : -INFINITY;
    float m = sink;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
    float l = a.sinks ? std::exp(sink - m) : 0.f;
#pragma omp simd reduction(+ : l)
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = exp_neg(sg[i] - m);
      l += sg[i];
    }
    denom[g] = l;
  }
  if (D % (VC * L) == 0) {
    // each query head's output VC vectors at a time, held in registers over the whole context
    // (one pass over the V rows per chunk; row by row, the output in memory took a load, a
    // multiply-add and a store a vector a row, ~2x). The sums run in the same order.
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < D; c += VC * L) {
        vf acc[VC] = {};
        const float* sg = s.data() + g * n;
        for_rows(a.v, a.v_scale, [&](int64_t i, const E* vr, float scale) {
          const float p = sg[i] * scale;
          for (int j = 0; j < VC; ++j) acc[j] += p * load_row(vr + c + j * L);
        });
        std::memcpy(out + g * D + c, acc, sizeof(acc));
      }
  } else {
    for_rows(a.v, a.v_scale, [&](int64_t i, const E* __restrict vr, float scale) {
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g * n + i] * scale;
        float* __restrict o = out + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += p * static_cast<float>(vr[d]);
      }
    });
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = denom[g] > 0.f ? 1.f / denom[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= inv;
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                ffi::AnyBuffer v, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> kv_lens,
                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::F32> k_scale,
                ffi::Buffer<ffi::F32> v_scale, ffi::ResultBuffer<ffi::F32> out, float soft_cap) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || v.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("paged_attention: q [T, K, G, D], pages [R, B, K, D], tables [S, M]");
  Attn a;
  a.T = qd[0], a.K = qd[1], a.G = qd[2], a.D = qd[3], a.R = kd[0], a.B = kd[1], a.M = td[1];
  const int64_t S = td[0];
  if (kd[2] != a.K || kd[3] != a.D || kv_lens.element_count() != S || cu_q_lens.element_count() != S + 1 ||
      (sinks.element_count() && sinks.element_count() != a.K * a.G))
    return ffi::Error::InvalidArgument("paged_attention: mismatched shapes");
  // bf16 pages, or their bit patterns in uint16 (a CPU pool's `codes` form, attention/kv_cache.py)
  const bool int8 = k.element_type() == ffi::S8,
             half = k.element_type() == ffi::BF16 || k.element_type() == ffi::U16;
  if (k.element_type() != v.element_type() || (!int8 && !half && k.element_type() != ffi::F32) ||
      (int8 ? (k_scale.element_count() != a.R * a.B * a.K || v_scale.element_count() != a.R * a.B * a.K)
            : (k_scale.element_count() || v_scale.element_count())))
    return ffi::Error::InvalidArgument("paged_attention: pages f32 or bf16 (or uint16 bf16 bits), or int8 with "
                                       "[R, B, K] scales each");
  a.q = q.typed_data(), a.k = k.untyped_data(), a.v = v.untyped_data(), a.tables = tables.typed_data();
  a.k_scale = int8 ? k_scale.typed_data() : nullptr, a.v_scale = int8 ? v_scale.typed_data() : nullptr;
  a.sinks = sinks.element_count() ? sinks.typed_data() : nullptr;
  a.out = out->typed_data();
  a.soft_cap = soft_cap;
  a.seq.assign(a.T, 0), a.first.assign(a.T, 0), a.last.assign(a.T, -1);
  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int64_t seqs = std::min<int64_t>(S, num_seqs.typed_data()[0]);
  const int64_t win = window.element_count() ? window.typed_data()[0] : 0;
  int64_t total = 0;  // KV rows read, for the choice of threads
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t q_len = cu[s + 1] - cu[s];
    if (q_len <= 0) continue;
    int64_t from = a.M * a.B, reach = -1;  // the sequence's first and last positions read
    for (int64_t t = std::max<int64_t>(cu[s], 0); t < std::min<int64_t>(cu[s + 1], a.T); ++t) {
      const int64_t pos = lens[s] - q_len + (t - cu[s]);
      if (pos < 0 || pos >= a.M * a.B) continue;
      a.seq[t] = s;
      a.last[t] = pos;
      a.first[t] = win > 0 ? std::max<int64_t>(0, pos - win + 1) : 0;
      total += pos - a.first[t] + 1;
      from = std::min(from, a.first[t]);
      reach = std::max(reach, pos);
    }
    for (int64_t p = from / a.B; reach >= 0 && p <= reach / a.B; ++p) {  // table entries must name pages that exist
      const int32_t page = a.tables[s * a.M + p];
      if (page < 0 || page >= a.R) return ffi::Error::InvalidArgument("paged_attention: block id out of range");
    }
  }
  // (token, kv head) units, four claims per thread
  jaxserve::run_claims(pool, a.T * a.K, total * a.K * a.G * a.D >= (1 << 16), 4, [&a, int8, half](int64_t u0, int64_t u1) {
    std::vector<float> s;
    for (int64_t u = u0; u < u1; ++u) {
      if (int8)
        attend<int8_t>(a, u / a.K, u % a.K, s);
      else if (half)
        attend<bf16>(a, u / a.K, u % a.K, s);
      else
        attend<float>(a, u / a.K, u % a.K, s);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("soft_cap"));
