// The integer dot products of the fused CPU kernel's `int8_x` path (int4_matvec.cc), one vector of
// L columns (simd.h) at a time: AVX512-VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd.
// JAXSERVE_INT8_DOT says which this build has (0: none).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace jaxserve {

// The integer dot product of L columns' packed codes with x's int8 codes: `Codes` holds word row
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
// 8-bit codes four a word (unsigned bytes 0..255, four input rows): one product with x's four codes
struct Word { __m512i w; };
inline Word word(const int32_t* q) { return {_mm512_loadu_si512(q)}; }
inline Acc dot4(Acc a, const Word& c, int32_t x) { return {_mm512_dpbusd_epi32(a.a, c.w, _mm512_set1_epi32(x))}; }
#elif defined(__AVX2__)
#define JAXSERVE_INT8_DOT 2
constexpr int H = L / 8;   // AVX registers per vector: 1, or 2 with AVX-512F but no VNNI (Skylake-X)
struct Acc { __m256i a[H]; };
struct Codes { __m256i lo[H], hi[H]; };
inline Acc acc_zero() {
  Acc a;
  for (int h = 0; h < H; ++h) a.a[h] = _mm256_setzero_si256();
  return a;
}
inline Codes codes(const int32_t* q) {
  const __m256i m = _mm256_set1_epi32(0x0F0F0F0F);
  Codes c;
  for (int h = 0; h < H; ++h) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 8 * h));
    c.lo[h] = _mm256_and_si256(w, m);
    c.hi[h] = _mm256_and_si256(_mm256_srli_epi32(w, 4), m);
  }
  return c;
}
inline Acc dot(Acc a, const Codes& c, int32_t xlo, int32_t xhi) {
  const __m256i xl = _mm256_set1_epi32(xlo), xh = _mm256_set1_epi32(xhi);
  for (int h = 0; h < H; ++h) {
    // u8 x s8 pairs summed to int16 (at most 4 * 15 * 127 after the add), then pairs to int32
    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(c.lo[h], xl), _mm256_maddubs_epi16(c.hi[h], xh));
    a.a[h] = _mm256_add_epi32(a.a[h], _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
  }
  return a;
}
// 8-bit codes four a word: the kernel refuses them on this path (vpmaddubsw's int16 pair sums
// saturate at 255 * 127 * 2); defined so that the one source compiles everywhere
struct Word { __m256i w[H]; };
inline Word word(const int32_t* q) {
  Word c;
  for (int h = 0; h < H; ++h) c.w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 8 * h));
  return c;
}
inline Acc dot4(Acc a, const Word& c, int32_t x) {
  for (int h = 0; h < H; ++h)
    a.a[h] = _mm256_add_epi32(a.a[h], _mm256_madd_epi16(_mm256_maddubs_epi16(c.w[h], _mm256_set1_epi32(x)),
                                                        _mm256_set1_epi16(1)));
  return a;
}
inline vf to_float(Acc a) {
  vf f;
  for (int h = 0; h < H; ++h) {
    const __m256 x = _mm256_cvtepi32_ps(a.a[h]);
    std::memcpy(reinterpret_cast<char*>(&f) + sizeof(x) * h, &x, sizeof(x));
  }
  return f;
}
#else
#define JAXSERVE_INT8_DOT 0
#endif

}  // namespace jaxserve
