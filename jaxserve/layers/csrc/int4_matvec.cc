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
// Each thread takes one range of output columns. The weight may carry a leading stacked-layer
// axis; `layer` picks the slice (the layer scan passes the stack whole, so XLA copies no layer's
// weights out of it).
//
// Two layouts (layers/int4.py's `Int4Weight.col_block`): the checkpoint's, every array [rows, N],
// read group by group across a thread's columns; or column blocks of `col_block` (64) columns,
// every array [N / 64, rows, 64], read block by block, each block's groups in address order. A
// thread then reads one contiguous run of each array, where the first layout gives it six short
// streams a group (code rows, scales, offsets) that the hardware prefetchers pick up late: on this
// model's 210 matrices, 20-24 GB/s the first way, 40-43 the second (benchmarks/RESULTS.md).
// Scales and offsets are f32, or f16 (`Int4Weight` keeps f16 where every value is one: GGUF's), or
// two-level as GGUF's K-quants store them (`Int4Weight.scale_sup`): int8 sub-scales [G, N] times f16
// super-block scales [G / S, N], multiplied out in the epilogue (Q4_K: 0.58 bytes a weight read,
// not 0.75 with f32 scales and offsets).
//
// Written with GCC / Clang vector extensions and compiled with -march=native: vectors of L lanes,
// one register wide (simd.h).
//
// With `int8_x` (int4 codes only), x is split per block of up to 32 inputs into two int8 parts
// (codes at scale d = max|x| / 127, then the rounded rest at d / 254: x to 1.6e-5 of the block's
// max; one part alone, llama.cpp's Q8_1, measured below the project's quality bar) and each part's
// sum of code * x is an exact integer dot product: AVX512-VNNI's vpdpbusd (64 byte products an
// instruction) or AVX2's vpmaddubsw + vpmaddwd, in place of a convert and M float multiply-adds
// per code; the result is the product of that x with the weight, in f32. With `int8_hi_only` x is
// the high part alone (llama.cpp's Q8 activations: x to 1/254 of the block's max), half the
// integer work, for many rows (prefill, large batches) of GGUF weights. `JaxserveInt4Int8Dot()`
// says which instructions this build has (0: none, so `int8_x` is refused).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "claims.h"
#include "int8_dot.h"
#include "quant_weight.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t NB = 64;        // output columns per block a thread claims at a time
constexpr int64_t MAX_ROWS = 8;

struct Problem {
  // the layer's slice of each weight array (shapes in the checkpoint layout; column blocks below):
  const void* q;         // int32 [K/8, N] (bits 4) or int8 [K, N] (bits 8)
  const void* scale;     // [G, N], f32 or f16 (`half`)
  const uint8_t* zero;   // [G, N] or null
  const void* offset;    // [G, N] or null, as `scale`
  float* y;              // [M, N]
  int64_t M, K, N, g, bits;
  float sym;             // zero point when `zero` is null (the weight's `zero_point`)
  int64_t cb;            // columns per block: N (the checkpoint layout) or col_block
  bool half;             // scales and offsets are f16
  const float* xsum;     // [M, G]: each group's sum of x (of the dequantised x with int8_x)
  const float* xq;       // [M, K]: x[m, k] * 16^-(k % 8) for int4 codes (x itself for int8)
  // with int8_x:
  const int32_t* xi;     // [M, K / 8, 4]: x's int8 codes of word row r's even and odd inputs,
                         // the high part's then the low part's
  const float* xd;       // [M, K / qb]: each block's scale
  int64_t qb;            // inputs per block (32, 16 or 8: a divisor of g)
  bool k4;               // bits 8: unsigned codes packed four input rows a uint32 word ([K / 4, N])
  bool hi_only;          // x is its high int8 part alone (llama.cpp's Q8 rounding of activations)
  // two-level scales: `scale` (and `offset`) are int8 sub-scales [G, N], each group's scale
  // scale_sup[gi / S, n] * scale[gi, n]; the super-block scales f16 [G / S, N] (same layout)
  const uint16_t* scale_sup;   // or null: one-level scales
  const uint16_t* offset_sup;  // or null
  int64_t S;                   // groups a super-block
};

using jaxserve::L;
using jaxserve::vf;
typedef uint32_t vu __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
typedef _Float16 vh __attribute__((vector_size(2 * L)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f max8(v8f a, v8f b) { return a > b ? a : b; }
// round half to even (not by adding 1.5 * 2^23: the compiler may fuse that add with the multiply
// before it, and the rounding then differs); compiled to one vector rounding instruction
inline v8f round_even(v8f v) {
  v8f r;
  for (int i = 0; i < 8; ++i) r[i] = std::nearbyint(v[i]);
  return r;
}
inline v8f clamp127(v8f v) {
  v = v < -127.f ? v8f{} - 127.f : v;
  return v > 127.f ? v8f{} + 127.f : v;
}

template <typename V, typename T>
inline V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// L int8 (uint8) codes from `c`, as f32, widened to int32 first by the x86 widening loads (GCC
// converts a byte vector to floats, or widens it, one lane at a time).
template <typename T>
inline vf bytes_to_float(const T* c) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  return (vf)_mm512_cvtepi32_ps(std::is_signed<T>::value ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  return (vf)_mm256_cvtepi32_ps(std::is_signed<T>::value ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  vi w;
  for (int i = 0; i < L; ++i) w[i] = c[i];
  return __builtin_convertvector(w, vf);
#endif
}

// Element (r, n) of a [rows, N] weight array in the problem's layout: column blocks of cb columns,
// each block's rows contiguous ([N / cb, rows, cb]); cb = N is the plain [rows, N]. Row r + i of
// the same columns is p.cb elements on, and the columns a `group` call takes lie in one block, so
// it computes one `at` per array (a division) and steps from there.
inline int64_t at(const Problem& p, int64_t rows, int64_t r, int64_t n) {
  if (p.cb == p.N) return r * p.N + n;                         // no division where there is none
  const int64_t blk = p.cb == 64 ? n >> 6 : n / p.cb, col = p.cb == 64 ? n & 63 : n % p.cb;
  return blk * rows * p.cb + r * p.cb + col;
}

// L f16 values from `h`, as f32: through the x86 conversion instructions where there are some (GCC
// converts a _Float16 vector one lane at a time without AVX512-FP16: measured 40% slower on cached
// matrices).
inline vf load_half(const uint16_t* h) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
#elif defined(__F16C__)
  static_assert(L == 8, "F16C without AVX-512: one AVX register of 8 lanes");
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
#else
  return __builtin_convertvector(load<vh>(h), vf);
#endif
}

// L scales (offsets) from element `i` of `a` (one-level), as f32.
inline vf load_scales(const Problem& p, const void* a, int64_t i) {
  if (!p.half) return load<vf>(static_cast<const float*>(a) + i);
  return load_half(static_cast<const uint16_t*>(a) + i);
}

// Group gi's scales `s` and biases `b` (offset - zero point * scale) of columns [n, n + L).
inline void scale_bias(const Problem& p, int64_t gi, int64_t n, vf& s, vf& b) {
  const int64_t G = p.K / p.g, i = at(p, G, gi, n);
  if (p.scale_sup) {
    const int64_t j = at(p, G / p.S, gi / p.S, n);
    s = bytes_to_float(static_cast<const int8_t*>(p.scale) + i) * load_half(p.scale_sup + j);
    b = p.offset ? bytes_to_float(static_cast<const int8_t*>(p.offset) + i) * load_half(p.offset_sup + j) : vf{};
  } else {
    s = load_scales(p, p.scale, i);
    b = p.offset ? load_scales(p, p.offset, i) : vf{};
  }
  vf zp = vf{} + p.sym;
  if (p.zero) zp = bytes_to_float(p.zero + i);
  b -= zp * s;
}

// Ask for the same columns of group gi + 1 (its code rows, scales, zero points, offsets) while
// group gi is summed: each group's rows are separate streams the hardware prefetchers pick up
// late (a standalone harness over this model's matrices: 19.8 -> 23 GB/s, near a plain read's 25).
// (Column blocks: group gi + 2's, one contiguous run ahead.)
template <int V>
inline void prefetch_next_group(const Problem& p, int64_t gi, int64_t n0) {
  const int64_t G = p.K / p.g, ahead = p.cb < p.N ? 2 : 1, next = gi + ahead;
  if (next >= G) return;
  const int64_t pack = p.bits == 4 ? 8 : p.k4 ? 4 : 1, R = p.K / pack, code = p.bits == 4 || p.k4 ? 4 : 1,
                s = p.scale_sup ? 1 : p.half ? 2 : 4;
  const char* q = static_cast<const char*>(p.q);
  const int64_t r0 = next * p.g / pack, q0 = at(p, R, r0, n0);
  for (int64_t r = 0; r < p.g / pack; ++r)
    for (int64_t b = 0; b < V * L * code; b += 64) __builtin_prefetch(q + (q0 + r * p.cb) * code + b);
  const int64_t i = at(p, G, next, n0);
  for (int64_t b = 0; b < V * L * s; b += 64) {
    __builtin_prefetch(static_cast<const char*>(p.scale) + i * s + b);
    if (p.offset) __builtin_prefetch(static_cast<const char*>(p.offset) + i * s + b);
    if (p.zero && b % 256 == 0) __builtin_prefetch(p.zero + i + b / s);
  }
  if (p.scale_sup && next % p.S == 0) {
    const int64_t j = at(p, G / p.S, next / p.S, n0);
    for (int64_t b = 0; b < V * L * 2; b += 64) {
      __builtin_prefetch(p.scale_sup + j + b / 2);
      if (p.offset_sup) __builtin_prefetch(p.offset_sup + j + b / 2);
    }
  }
}

// y[:, columns] += scale * a + bias * (each row's sum of x over the group)
template <int M, int V>
inline void epilogue(const Problem& p, int64_t gi, int64_t n0, const vf (&a)[M][V]) {
  const int64_t N = p.N, G = p.K / p.g;
  for (int v = 0; v < V; ++v) {
    vf s, b;
    scale_bias(p, gi, n0 + v * L, s, b);
    for (int m = 0; m < M; ++m) {
      float* out = p.y + m * N + n0 + v * L;
      const vf acc = load<vf>(out) + s * a[m][v] + b * p.xsum[m * G + gi];
      std::memcpy(out, &acc, sizeof(vf));
    }
  }
}

// Group gi's contribution to columns [n0, n0 + V * L) of y (in memory): M x V accumulators in
// registers (`vectors`).
template <int M, int V>
inline void group(const Problem& p, int64_t gi, int64_t n0) {
  const int64_t K = p.K, g = p.g;
  vf a[M][V] = {};
  prefetch_next_group<V>(p, gi, n0);
  if (p.bits == 4) {
    const int32_t* q = static_cast<const int32_t*>(p.q) + at(p, K / 8, gi * g / 8, n0);
    for (int64_t r = gi * g / 8; r < (gi + 1) * g / 8; ++r) {
      const int32_t* qr = q + (r - gi * g / 8) * p.cb;
      vu w[V];
      for (int v = 0; v < V; ++v) w[v] = load<vu>(qr + v * L);
      for (int j = 0; j < 8; ++j) {
        // nibble j left in place: code * 16^j (exact in f32) times x * 16^-j (p.xq) is the
        // same product, powers of two scaling exactly, and one shift a code cheaper. The top
        // nibble is shifted down one place (code * 16^6, times 16 x * 16^-7) so every code
        // converts as a signed int (AVX2 has no unsigned int-to-float conversion).
        const uint32_t mask = 0xFu << (4 * (j < 7 ? j : 6));
        const float up = j < 7 ? 1.f : 16.f;
        for (int v = 0; v < V; ++v) {
          const vf code = __builtin_convertvector((vi)((j < 7 ? w[v] : w[v] >> 4) & mask), vf);
          for (int m = 0; m < M; ++m) a[m][v] += (p.xq[m * K + 8 * r + j] * up) * code;
        }
      }
    }
  } else if (p.k4) {
    // unsigned codes, four input rows a word (byte j: row 4 r + j)
    const uint32_t* q = static_cast<const uint32_t*>(p.q) + at(p, K / 4, gi * g / 4, n0);
    for (int64_t r = gi * g / 4; r < (gi + 1) * g / 4; ++r) {
      const uint32_t* qr = q + (r - gi * g / 4) * p.cb;
      for (int v = 0; v < V; ++v) {
        const vu w = load<vu>(qr + v * L);
        for (int j = 0; j < 4; ++j) {
          const vf code = __builtin_convertvector((vi)((w >> (8 * j)) & 0xFFu), vf);
          for (int m = 0; m < M; ++m) a[m][v] += p.xq[m * K + 4 * r + j] * code;
        }
      }
    }
  } else {
    const int8_t* q = static_cast<const int8_t*>(p.q) + at(p, K, gi * g, n0);
    for (int64_t k = gi * g; k < (gi + 1) * g; ++k) {
      const int8_t* qk = q + (k - gi * g) * p.cb;
      for (int v = 0; v < V; ++v) {
        const vf code = bytes_to_float(qk + v * L);
        for (int m = 0; m < M; ++m) a[m][v] += p.xq[m * K + k] * code;
      }
    }
  }
  epilogue<M, V>(p, gi, n0, a);
}

#if JAXSERVE_INT8_DOT
using jaxserve::Acc;
using jaxserve::acc_zero;
using jaxserve::codes;
using jaxserve::Codes;
using jaxserve::dot;
using jaxserve::to_float;
using jaxserve::Word;
using jaxserve::word;
using jaxserve::dot4;

// group() for int4 codes and int8 x: per block of qb inputs two integer dot products (x's high
// and low int8 parts), scaled by the block's x scales into M x V f32 sums; then the same epilogue.
template <int M, int V, bool LO>
inline void sums_int8(const Problem& p, int64_t gi, int64_t n0, vf (&a)[M][V]) {
  const int64_t K = p.K, g = p.g, R = K / 8, B = K / p.qb;
  const int64_t r0 = gi * g / 8;                     // the group's first word row
  const int32_t* q = static_cast<const int32_t*>(p.q) + at(p, R, r0, n0);
  prefetch_next_group<V>(p, gi, n0);
  for (int64_t b = gi * g / p.qb; b < (gi + 1) * g / p.qb; ++b) {
    // one vector of columns at a time through the block's word rows: 2 M integer accumulators
    // live, not 2 M V (16 AVX registers would spill them)
    for (int v = 0; v < V; ++v) {
      Acc hi[M], lo[M];
      for (int m = 0; m < M; ++m) hi[m] = lo[m] = acc_zero();
      if (p.k4) {        // a word row of four unsigned 8-bit codes: one product a row of x
        const int32_t* q4 = static_cast<const int32_t*>(p.q) + at(p, K / 4, gi * g / 4, n0);
        for (int64_t r = b * p.qb / 4; r < (b + 1) * p.qb / 4; ++r) {
          const Word c = word(q4 + (r - gi * g / 4) * p.cb + v * L);
          for (int m = 0; m < M; ++m) {
            const int32_t* x = p.xi + 4 * (m * R + r / 2) + (r & 1);
            hi[m] = dot4(hi[m], c, x[0]);
            if constexpr (LO) lo[m] = dot4(lo[m], c, x[2]);
          }
        }
      } else {
        for (int64_t r = b * p.qb / 8; r < (b + 1) * p.qb / 8; ++r) {
          const Codes c = codes(q + (r - r0) * p.cb + v * L);
          for (int m = 0; m < M; ++m) {
            const int32_t* x = p.xi + 4 * (m * R + r);
            hi[m] = dot(hi[m], c, x[0], x[1]);
            if constexpr (LO) lo[m] = dot(lo[m], c, x[2], x[3]);
          }
        }
      }
      for (int m = 0; m < M; ++m) {
        const float d = p.xd[m * B + b], d_lo = d * (1.f / 254.f);
        a[m][v] += LO ? d * to_float(hi[m]) + d_lo * to_float(lo[m]) : d * to_float(hi[m]);
      }
    }
  }
}

template <int M, int V, bool LO>
inline void group_int8(const Problem& p, int64_t gi, int64_t n0) {
  vf a[M][V] = {};
  sums_int8<M, V, LO>(p, gi, n0, a);
  epilogue<M, V>(p, gi, n0, a);
}

// Columns [n0, n0 + V L) of y over every group with x's high int8 parts alone, y's sums kept in
// registers from the first group to the last (column blocks: the columns' rows of every group
// lie in one block). Not a load and store of y per row and group, as `group_int8` + `epilogue`
// make: at 64 rows that was a third of the kernel's time on 16-row groups.
template <int M, int V>
inline void chunk_int8(const Problem& p, int64_t n0) {
  const int64_t G = p.K / p.g;
  vf y[M][V] = {};
  for (int64_t gi = 0; gi < G; ++gi) {
    vf a[M][V] = {};
    sums_int8<M, V, false>(p, gi, n0, a);
    for (int v = 0; v < V; ++v) {
      vf s, b;
      scale_bias(p, gi, n0 + v * L, s, b);
      for (int m = 0; m < M; ++m) y[m][v] += s * a[m][v] + b * p.xsum[m * G + gi];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) std::memcpy(p.y + m * p.N + n0 + v * L, &y[m][v], sizeof(vf));
}
#endif

// Vectors of L columns per `group` / `group_int8` call, so that its accumulators fit the registers
// (32 AVX-512 ones, 16 AVX ones: M V <= 8; group_int8 keeps 2 M integer ones live, a vector at a
// time).
template <int M>
constexpr int vectors() {
  if constexpr (L == 16) return M <= 2 ? 4 : M <= 4 ? 2 : 1;
  return M <= 1 ? 8 : M <= 2 ? 4 : M <= 4 ? 2 : 1;
}

// Group gi's contribution to columns [c0, c1) (within one column block), V vectors at a time.
template <int M>
inline void columns(const Problem& p, int64_t gi, int64_t c0, int64_t c1) {
  constexpr int V = vectors<M>();
  int64_t c = c0;
#if JAXSERVE_INT8_DOT
  if (p.xi && p.hi_only) {
    for (; c + V * L <= c1; c += V * L) group_int8<M, V, false>(p, gi, c);
    for (; c < c1; c += L) group_int8<M, 1, false>(p, gi, c);
    return;
  }
  if (p.xi) {
    for (; c + V * L <= c1; c += V * L) group_int8<M, V, true>(p, gi, c);
    for (; c < c1; c += L) group_int8<M, 1, true>(p, gi, c);
    return;
  }
#endif
  for (; c + V * L <= c1; c += V * L) group<M, V>(p, gi, c);
  for (; c < c1; c += L) group<M, 1>(p, gi, c);
}

// Columns [c0, c1) of y, the partial sums kept in y. The checkpoint layout group by group across
// the range (each group's rows read in address order: whole cache lines, in order, for the
// hardware prefetchers); column blocks block by block, each block's groups in turn (one run).
template <int M>
void run_range(const Problem& p, int64_t c0, int64_t c1) {
  for (int m = 0; m < M; ++m) std::memset(p.y + m * p.N + c0, 0, (c1 - c0) * sizeof(float));
  const int64_t G = p.K / p.g;
  if (p.cb == p.N) {
    for (int64_t gi = 0; gi < G; ++gi) columns<M>(p, gi, c0, c1);
    return;
  }
  for (int64_t b0 = c0; b0 < c1; b0 = (b0 / p.cb + 1) * p.cb) {
    const int64_t b1 = std::min(c1, (b0 / p.cb + 1) * p.cb);
#if JAXSERVE_INT8_DOT
    if (p.xi && p.hi_only) {       // y's sums in registers across the groups
      constexpr int V = vectors<M>();
      int64_t c = b0;
      for (; c + V * L <= b1; c += V * L) chunk_int8<M, V>(p, c);
      for (; c < b1; c += L) chunk_int8<M, 1>(p, c);
      continue;
    }
#endif
    for (int64_t gi = 0; gi < G; ++gi) columns<M>(p, gi, b0, b1);
  }
}

// Columns [c0, c1) for the problem's M <= MAX_ROWS rows.
void run_rows(const Problem& p, int64_t c0, int64_t c1) {
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

// Rows [m0, m0 + Mc) of the problem (x's prepared arrays and y offset to them).
Problem rows_of(const Problem& p, int64_t m0, int64_t Mc) {
  Problem r = p;
  r.M = Mc;
  r.y = p.y + m0 * p.N;
  r.xsum = p.xsum + m0 * (p.K / p.g);
  if (p.xq) r.xq = p.xq + m0 * p.K;
  if (p.xi) {
    r.xi = p.xi + m0 * (p.K / 2);
    r.xd = p.xd + m0 * (p.K / p.qb);
  }
  return r;
}

// Weight bytes a thread keeps in its cache while every chunk of MAX_ROWS rows passes over them.
constexpr int64_t CACHED = 1 << 20;

// Column blocks [b0, b1) of y. More than MAX_ROWS rows (the accumulators are templated on the
// rows): spans of columns whose weight bytes stay in the thread's L2 cache (CACHED), every chunk of
// rows over a span before the next, so the weight comes from memory once, not once a chunk (a
// 512-token prompt: 64 passes over each matrix from memory before, at memory bandwidth).
void run(const Problem& p, int64_t b0, int64_t b1) {
  const int64_t c0 = b0 * NB, c1 = std::min(p.N, b1 * NB);
  if (p.M <= MAX_ROWS) return run_rows(p, c0, c1);
  const int64_t per_col = p.K * (p.bits == 4 ? 1 : 2) / 2 + 1;          // code bytes a column
  const int64_t span = std::max<int64_t>(NB, CACHED / per_col / NB * NB);
  for (int64_t s0 = c0; s0 < c1; s0 += span)
    for (int64_t m0 = 0; m0 < p.M; m0 += MAX_ROWS)
      run_rows(rows_of(p, m0, std::min(MAX_ROWS, p.M - m0)), s0, std::min(c1, s0 + span));
}

// x's M rows (K inputs each) as the int8_x kernel takes them (`k4`: each word row's eight inputs in
// order, for 8-bit codes four a word; else even inputs then odd ones, for the nibbles): per block of qb inputs the high
// part's scale d = max|x| / 127 and codes round(x / d), the low part's scale d / 254 and codes the
// rounded rest (x = d hi + d / 254 lo to 1.6e-5 max|x|); the group sums are of that x, so the
// result is that x times the weight (up to f32 sums). Eight inputs (one word row r) at a time,
// each code stored straight into its byte of r's four words (on the calling thread before the
// split, so it is kept vectorised).
void prepare_int8(const float* xd0, int64_t M, int64_t K, int64_t qb, int64_t G, int64_t group_size,
                  bool hi_only, bool k4, float* xdq, int32_t* xi, float* xsum) {
  const int64_t B = K / qb, R = K / 8;
  int8_t* bytes = reinterpret_cast<int8_t*>(xi);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = xd0 + m * K;
    for (int64_t b = 0; b < B; ++b) {
      v8f amax = {};
      for (int64_t k = b * qb; k < (b + 1) * qb; k += 8) {
        const v8f v = load<v8f>(xm + k);
        amax = max8(amax, max8(v, -v));
      }
      float a = 0.f;
      for (int i = 0; i < 8; ++i) a = std::max(a, amax[i]);
      const float d = a / 127.f, inv = a > 0.f ? 127.f / a : 0.f;
      v8i sum_hi = {}, sum_lo = {};
      for (int64_t k = b * qb; k < (b + 1) * qb; k += 8) {
        const v8f t = load<v8f>(xm + k) * inv;
        const v8f h = clamp127(round_even(t));
        const v8i hi = __builtin_convertvector(h, v8i);
        const v8i lo = __builtin_convertvector(clamp127(round_even((t - h) * 254.f)), v8i);
        sum_hi += hi;
        sum_lo += lo;
        int8_t* word = bytes + 16 * (m * R + k / 8);   // high part's even inputs, odd ones, low part's
        for (int j = 0; j < 8; ++j) {    // k4: inputs in order (high part's words, then low part's)
          const int at = k4 ? j : 4 * (j & 1) + j / 2;
          word[at] = static_cast<int8_t>(hi[j]);
          word[8 + at] = static_cast<int8_t>(lo[j]);
        }
      }
      int32_t sh = 0, sl = 0;
      for (int i = 0; i < 8; ++i) sh += sum_hi[i], sl += sum_lo[i];
      xdq[m * B + b] = d;
      float& gs = xsum[m * G + b * qb / group_size];
      gs = (b * qb % group_size == 0 ? 0.f : gs) + d * static_cast<float>(sh) +
           (hi_only ? 0.f : d * (1.f / 254.f) * static_cast<float>(sl));
    }
  }
}

// x's rows as the f32-x kernel takes them: group sums, and x * 16^-(k % 8) for int4 codes.
void prepare_f32(const float* xd0, int64_t M, int64_t K, int64_t G, int64_t group_size, int64_t bits,
                 float* xq, float* xsum) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < G; ++gi) {
      float s = 0.f;
      for (int64_t k = gi * group_size; k < (gi + 1) * group_size; ++k) s += xd0[m * K + k];
      xsum[m * G + gi] = s;
    }
  for (int64_t i = 0; i < M * K; ++i)
    xq[i] = bits == 4 ? std::ldexp(xd0[i], -4 * static_cast<int>(i % K % 8)) : xd0[i];
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                ffi::AnyBuffer scale, ffi::Buffer<ffi::U8> zero, ffi::AnyBuffer offset,
                ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer scale_sup, ffi::AnyBuffer offset_sup,
                ffi::ResultBuffer<ffi::F32> y, int64_t group_size, int64_t bits, bool int8_x, int64_t zero_point,
                int64_t col_block, bool int8_hi_only) {
  jaxserve::QuantWeight w;
  const bool two = scale_sup.element_count() > 0;
  if (auto err = jaxserve::check_weight("int4_matvec", x, q, scale, zero, offset, layer, group_size, bits,
                                          col_block, w, two);
      err.failure())
    return err;
  // two-level scales: f16 [.., G / S, ..] beside int8 sub-scales (offsets alike), in their layout
  const uint16_t *ssup = nullptr, *osup = nullptr;
  int64_t S = 1;
  if (two || offset_sup.element_count()) {
    auto sd = scale.dimensions(), ud = scale_sup.dimensions();
    const size_t rank = sd.size();
    const bool has_off = offset.element_count() > 0;
    bool ok = two && !zero.element_count() && ud.size() == rank && scale_sup.element_type() == ffi::F16 &&
              has_off == (offset_sup.element_count() > 0) &&
              (!has_off || (offset_sup.element_type() == ffi::F16 && offset_sup.element_count() == scale_sup.element_count()));
    for (size_t d = 0; ok && d < rank; ++d) ok = d == rank - 2 ? ud[d] >= 1 && sd[d] % ud[d] == 0 : ud[d] == sd[d];
    if (!ok) return ffi::Error::InvalidArgument("int4_matvec: two-level scales need int8 sub-scales (offsets) and f16 "
                                                "super-block scales of the same layout, no zero array");
    S = sd[rank - 2] / ud[rank - 2];
    const int64_t per_layer = scale_sup.element_count() / (rank == 3 + (col_block ? 1 : 0) ? sd[0] : 1);
    const int64_t l = rank == 3 + (col_block ? 1 : 0) ? layer.typed_data()[0] : 0;
    ssup = static_cast<const uint16_t*>(scale_sup.untyped_data()) + l * per_layer;
    if (has_off) osup = static_cast<const uint16_t*>(offset_sup.untyped_data()) + l * per_layer;
  }
  const bool k4 = bits == 8 && q.element_type() == ffi::S32;
  if (int8_x && ((bits != 4 && !k4) || !JAXSERVE_INT8_DOT || (k4 && JAXSERVE_INT8_DOT != 1)))
    return ffi::Error::InvalidArgument("int4_matvec: int8_x needs int4 codes, or 8-bit ones four a word with "
                                       "AVX512-VNNI, and a build with an int8 dot product");
  const int64_t M = w.M, K = w.K, N = w.N, G = w.G;
  const int64_t qb = group_size % 32 == 0 ? 32 : group_size % 16 == 0 ? 16 : 8;
  // x's rows prepared at once (on the pool's threads too for many rows), then the columns split
  std::unique_ptr<float[]> xsum(new float[M * G]);
  std::unique_ptr<float[]> xq, xdq;
  std::unique_ptr<int32_t[]> xi;
  if (int8_x) {
    xdq.reset(new float[M * (K / qb)]);
    xi.reset(new int32_t[M * K / 2]);
  } else {
    xq.reset(new float[M * K]);
  }
  const float* xd0 = x.typed_data();
  jaxserve::run_claims(pool, M, M * K >= (1 << 16), 2, [&](int64_t m0, int64_t m1) {
    if (int8_x)
      prepare_int8(xd0 + m0 * K, m1 - m0, K, qb, G, group_size, int8_hi_only, k4, xdq.get() + m0 * (K / qb),
                   xi.get() + m0 * (K / 2), xsum.get() + m0 * G);
    else
      prepare_f32(xd0 + m0 * K, m1 - m0, K, G, group_size, bits, xq.get() + m0 * K, xsum.get() + m0 * G);
  });
  const Problem p{w.q, w.scale, w.zero, w.offset, y->typed_data(), M, K, N, group_size, bits,
                  static_cast<float>(zero_point), w.cb, w.half, xsum.get(), xq.get(), xi.get(), xdq.get(), qb,
                  k4, int8_hi_only, ssup, osup, S};
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
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("bits")
                                  .Attr<bool>("int8_x")
                                  .Attr<int64_t>("zero_point")
                                  .Attr<int64_t>("col_block")
                                  .Attr<bool>("int8_hi_only"));

// Which integer dot product `int8_x` runs on in this build: 1 AVX512-VNNI, 2 AVX2, 0 none.
extern "C" int JaxserveInt4Int8Dot() { return JAXSERVE_INT8_DOT; }
