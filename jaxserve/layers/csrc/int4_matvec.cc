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
//
// With `int8_x` (int4 codes only), x is split per block of up to 32 inputs into two int8 parts
// (codes at scale d = max|x| / 127, then the rounded rest at d / 254: x to 1.6e-5 of the block's
// max; one part alone, llama.cpp's Q8_1, measured below the project's quality bar) and each part's
// sum of code * x is an exact integer dot product: AVX512-VNNI's vpdpbusd (64 byte products an
// instruction) or AVX2's vpmaddubsw + vpmaddwd, in place of a convert and M float multiply-adds
// per code; the result is the product of that x with the weight, in f32. `JaxserveInt4Int8Dot()`
// says which instructions this build has (0: none, so `int8_x` is refused).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "claims.h"
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
  const float* xsum;     // [M, G]: each group's sum of x (of the dequantised x with int8_x)
  const float* xq;       // [M, K]: x[m, k] * 16^-(k % 8) for int4 codes (x itself for int8)
  // with int8_x:
  const int32_t* xi;     // [M, K / 8, 4]: x's int8 codes of word row r's even and odd inputs,
                         // the high part's then the low part's
  const float* xd;       // [M, K / qb]: each block's scale
  int64_t qb;            // inputs per block (32, 16 or 8: a divisor of g)
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

// Ask for the same columns of group gi + 1 (its code rows, scales, zero points, offsets) while
// group gi is summed: each group's rows are separate streams the hardware prefetchers pick up
// late (a standalone harness over this model's matrices: 19.8 -> 23 GB/s, near a plain read's 25).
template <int V>
inline void prefetch_next_group(const Problem& p, int64_t gi, int64_t n0) {
  const int64_t N = p.N, g = p.g;
  if ((gi + 2) * g > p.K) return;
  const size_t code = p.bits == 4 ? 4 : 1;
  const char* q = static_cast<const char*>(p.q);
  for (int64_t r = (gi + 1) * g / (p.bits == 4 ? 8 : 1); r < (gi + 2) * g / (p.bits == 4 ? 8 : 1); ++r)
    for (int64_t at = 0; at < V * L * static_cast<int64_t>(code); at += 64) __builtin_prefetch(q + (r * N + n0) * code + at);
  for (int v = 0; v < V; ++v) {
    const int64_t at = (gi + 1) * N + n0 + v * L;
    __builtin_prefetch(p.scale + at);
    if (p.offset) __builtin_prefetch(p.offset + at);
    if (p.zero && v % 4 == 0) __builtin_prefetch(p.zero + at);
  }
}

// y[:, columns] += scale * a + bias * (each row's sum of x over the group)
template <int M, int V>
inline void epilogue(const Problem& p, int64_t gi, int64_t n0, const vf (&a)[M][V]) {
  const int64_t N = p.N, G = p.K / p.g;
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

// Group gi's contribution to columns [n0, n0 + V * 16) of y (in memory): M x V accumulators in
// registers (M * V <= 8).
template <int M, int V>
inline void group(const Problem& p, int64_t gi, int64_t n0) {
  const int64_t N = p.N, K = p.K, g = p.g;
  vf a[M][V] = {};
  prefetch_next_group<V>(p, gi, n0);
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
  epilogue<M, V>(p, gi, n0, a);
}

// The integer dot product of 16 columns' packed codes with x's int8 codes: `Codes` holds word row
// r's even inputs' codes (low nibble of each byte) and odd ones', unsigned bytes 0..15; `dot` adds
// each column's four byte products of both to an int32 accumulator (no overflow: a block of 32
// inputs sums to at most 32 * 15 * 127).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define JAXSERVE_INT8_DOT 1
struct Acc { __m512i a; };
struct Codes { __m512i lo, hi; };
inline Acc acc_zero() { return {_mm512_setzero_si512()}; }
inline Codes codes(const int32_t* q) {
  const __m512i w = _mm512_loadu_si512(q), m = _mm512_set1_epi32(0x0F0F0F0F);
  return {_mm512_and_si512(w, m), _mm512_and_si512(_mm512_srli_epi32(w, 4), m)};
}
inline Acc dot(Acc a, const Codes& c, int32_t xlo, int32_t xhi) {
  a.a = _mm512_dpbusd_epi32(a.a, c.lo, _mm512_set1_epi32(xlo));
  return {_mm512_dpbusd_epi32(a.a, c.hi, _mm512_set1_epi32(xhi))};
}
inline vf to_float(Acc a) { return (vf)_mm512_cvtepi32_ps(a.a); }
#elif defined(__AVX2__)
#define JAXSERVE_INT8_DOT 2
struct Acc { __m256i a, b; };
struct Codes { __m256i lo0, hi0, lo1, hi1; };
inline Acc acc_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Codes codes(const int32_t* q) {
  const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 8));
  const __m256i m = _mm256_set1_epi32(0x0F0F0F0F);
  return {_mm256_and_si256(w0, m), _mm256_and_si256(_mm256_srli_epi32(w0, 4), m),
          _mm256_and_si256(w1, m), _mm256_and_si256(_mm256_srli_epi32(w1, 4), m)};
}
inline __m256i dot8(__m256i a, __m256i lo, __m256i hi, __m256i xl, __m256i xh) {
  // u8 x s8 pairs summed to int16 (at most 4 * 15 * 127 after the add), then pairs to int32
  const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
  return _mm256_add_epi32(a, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
}
inline Acc dot(Acc a, const Codes& c, int32_t xlo, int32_t xhi) {
  const __m256i xl = _mm256_set1_epi32(xlo), xh = _mm256_set1_epi32(xhi);
  return {dot8(a.a, c.lo0, c.hi0, xl, xh), dot8(a.b, c.lo1, c.hi1, xl, xh)};
}
inline vf to_float(Acc a) {
  vf f;
  const __m256 lo = _mm256_cvtepi32_ps(a.a), hi = _mm256_cvtepi32_ps(a.b);
  std::memcpy(&f, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&f) + sizeof(lo), &hi, sizeof(hi));
  return f;
}
#else
#define JAXSERVE_INT8_DOT 0
#endif

#if JAXSERVE_INT8_DOT
// group() for int4 codes and int8 x: per block of qb inputs two integer dot products (x's high
// and low int8 parts), scaled by the block's x scales into M x V f32 sums; then the same epilogue.
template <int M, int V>
inline void group_int8(const Problem& p, int64_t gi, int64_t n0) {
  const int64_t N = p.N, K = p.K, g = p.g, R = K / 8, B = K / p.qb;
  const int32_t* q = static_cast<const int32_t*>(p.q);
  vf a[M][V] = {};
  prefetch_next_group<V>(p, gi, n0);
  for (int64_t b = gi * g / p.qb; b < (gi + 1) * g / p.qb; ++b) {
    Acc hi[M][V], lo[M][V];
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < V; ++v) hi[m][v] = lo[m][v] = acc_zero();
    for (int64_t r = b * p.qb / 8; r < (b + 1) * p.qb / 8; ++r) {
      for (int v = 0; v < V; ++v) {
        const Codes c = codes(q + r * N + n0 + v * L);
        for (int m = 0; m < M; ++m) {
          const int32_t* x = p.xi + 4 * (m * R + r);
          hi[m][v] = dot(hi[m][v], c, x[0], x[1]);
          lo[m][v] = dot(lo[m][v], c, x[2], x[3]);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      const float d = p.xd[m * B + b], d_lo = d * (1.f / 254.f);
      for (int v = 0; v < V; ++v) a[m][v] += d * to_float(hi[m][v]) + d_lo * to_float(lo[m][v]);
    }
  }
  epilogue<M, V>(p, gi, n0, a);
}
#endif

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
#if JAXSERVE_INT8_DOT
    if (p.xi) {
      for (; c + V * L <= c1; c += V * L) group_int8<M, V>(p, gi, c);
      for (; c < c1; c += L) group_int8<M, 1>(p, gi, c);
      continue;
    }
#endif
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

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::U8> zero,
                ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> layer,
                ffi::ResultBuffer<ffi::F32> y, int64_t group_size, int64_t bits, bool int8_x) {
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
  if (int8_x && (bits != 4 || !JAXSERVE_INT8_DOT))
    return ffi::Error::InvalidArgument("int4_matvec: int8_x needs int4 codes and a build with an int8 dot product");
  const int64_t l = rank == 3 ? layer.typed_data()[0] : 0;
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("int4_matvec: layer index out of range");
  const int64_t codes = K / pack * N;  // q elements per layer
  const int64_t groups = G * N;        // scale (zero, offset) elements per layer
  const float* xd0 = x.typed_data();
  std::unique_ptr<float[]> xsum(new float[M * G]);
  std::unique_ptr<float[]> xq, xdq;
  std::unique_ptr<int32_t[]> xi;
  const int64_t qb = group_size % 32 == 0 ? 32 : group_size % 16 == 0 ? 16 : 8;
  if (int8_x) {
    // per block of qb inputs: the high part's scale d = max|x| / 127 and codes round(x / d), the
    // low part's scale d / 254 and codes the rounded rest (x = d hi + d / 254 lo to 1.6e-5 max|x|);
    // the group sums are of that x, so the result is that x times the weight (up to f32 sums)
    const int64_t B = K / qb, R = K / 8;
    xdq.reset(new float[M * B]);
    xi.reset(new int32_t[M * R * 4]);
    std::unique_ptr<int8_t[]> hi(new int8_t[K]), lo(new int8_t[K]);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = xd0 + m * K;
      for (int64_t b = 0; b < B; ++b) {
        float amax = 0.f;
        for (int64_t k = b * qb; k < (b + 1) * qb; ++k) amax = std::max(amax, std::fabs(xm[k]));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum_hi = 0, sum_lo = 0;
        for (int64_t k = b * qb; k < (b + 1) * qb; ++k) {
          const float h = std::min(127.f, std::max(-127.f, std::nearbyint(xm[k] * inv)));
          const float l = std::min(127.f, std::max(-127.f, std::nearbyint((xm[k] * inv - h) * 254.f)));
          hi[k] = static_cast<int8_t>(h);
          lo[k] = static_cast<int8_t>(l);
          sum_hi += hi[k];
          sum_lo += lo[k];
        }
        xdq[m * B + b] = d;
        float& gs = xsum[m * G + b * qb / group_size];
        gs = (b * qb % group_size == 0 ? 0.f : gs) + d * static_cast<float>(sum_hi) +
             d * (1.f / 254.f) * static_cast<float>(sum_lo);
      }
      for (int64_t r = 0; r < R; ++r)
        for (int part = 0; part < 4; ++part) {  // high part's even inputs, odd ones, low part's
          const int8_t* c = part < 2 ? hi.get() : lo.get();
          uint32_t word = 0;
          for (int j = 0; j < 4; ++j)
            word |= static_cast<uint32_t>(static_cast<uint8_t>(c[8 * r + 2 * j + part % 2])) << (8 * j);
          xi[4 * (m * R + r) + part] = static_cast<int32_t>(word);
        }
    }
  } else {
    xq.reset(new float[M * K]);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t gi = 0; gi < G; ++gi) {
        float s = 0.f;
        for (int64_t k = gi * group_size; k < (gi + 1) * group_size; ++k) s += xd0[m * K + k];
        xsum[m * G + gi] = s;
      }
    for (int64_t i = 0; i < M * K; ++i)
      xq[i] = bits == 4 ? std::ldexp(xd0[i], -4 * static_cast<int>(i % K % 8)) : xd0[i];
  }
  const void* qp = static_cast<const char*>(q.untyped_data()) + l * codes * (bits == 4 ? 4 : 1);
  const Problem p{qp, scale.typed_data() + l * groups,
                  zero.element_count() ? zero.typed_data() + l * groups : nullptr,
                  offset.element_count() ? offset.typed_data() + l * groups : nullptr,
                  y->typed_data(), M, K, N, group_size, bits, bits == 4 ? 8.f : 0.f, xsum.get(),
                  xq.get(), xi.get(), xdq.get(), qb};
  // blocks of NB columns, each thread one contiguous range of them (a claim per thread)
  jaxserve::run_claims(pool, (N + NB - 1) / NB, K * N >= (1 << 15), 1,
                       [&p](int64_t b0, int64_t b1) { run(p, b0, b1); });
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
                                  .Attr<int64_t>("bits")
                                  .Attr<bool>("int8_x"));

// Which integer dot product `int8_x` runs on in this build: 1 AVX512-VNNI, 2 AVX2, 0 none.
extern "C" int JaxserveInt4Int8Dot() { return JAXSERVE_INT8_DOT; }
