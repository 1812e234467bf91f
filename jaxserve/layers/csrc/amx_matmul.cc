// y [M, N] = x [M, K] @ W [K, N] for many rows x (batched decode) and a group-quantized weight W
// (layers/int4.py's Int4Weight: int4 codes packed 8 per int32 word along the input rows, or int8
// codes), on Intel AMX's bf16 tile multiply: the same arithmetic as the engine's bf16 tiles (x and
// the dequantised weight rounded to bf16 (nearest even), f32 sums), without writing the
// dequantised weight to memory.
//
// XLA's tiles dequantise a tile of W into memory and run a dot on it: on this model's matrices at
// 32-64 rows that costs about as much as 40 rows through the fused int8 kernel (int4_matvec.cc),
// whose cost grows with the rows. Here a thread takes 16 output columns at a time and walks K in
// chunks of 32 inputs: it dequantises the chunk (code * scale + offset, in AVX-512 registers, into
// one 1 KiB tile of bf16 pairs), then every 16 rows of x (a tile each) multiply it into their
// accumulator tile (TDPBF16PS: 16 x 16 x 32 products an instruction), up to 64 rows a pass. The
// accumulators stay in tile registers through K. Up to 64 rows, one pass dequantises as it goes;
// more rows (prefill) go by blocks of 256, a thread's blocks of x staying in its core's L2, and
// each 16 columns are dequantised once a block, into a strip of K / 32 tiles that its passes read.
//
// Built with the other CPU kernels (layers/int4_cpu.py, -march=native); the code is here only where
// the compiler targets AMX-BF16 and AVX512-BF16 (Sapphire Rapids and later), and Linux hands a
// process the tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM): `JaxserveAmx()`
// asks and says whether this build and this process can use them (1) or not (0).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "claims.h"
#include "quant_weight.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define JAXSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define JAXSERVE_AMX 0
#endif

namespace ffi = xla::ffi;

namespace {

#if JAXSERVE_AMX
constexpr int64_t NB = 64;       // output columns per block a thread claims at a time
constexpr int64_t KC = 32;       // inputs per chunk (one bf16 tile row: 32 values)
constexpr int64_t ROWS = 64;     // rows per pass: four accumulator tiles of 16
constexpr int64_t RB = 256;      // rows of x a thread works through at a time (more: row blocks)

// The tile configuration (palette 1): tile 0 the weight chunk (16 rows of 16 bf16 pairs), tiles 1
// and 6 chunks of x (r rows of 32 bf16), tiles 2-5 the accumulators (r rows of 16 f32).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig config(int64_t r) {
  TileConfig c;
  c.colsb[0] = 64, c.rows[0] = 16;
  for (int t = 1; t < 7; ++t) c.colsb[t] = 64, c.rows[t] = static_cast<uint8_t>(r);
  return c;
}

struct Problem {
  const void* q;          // int32 [K/8, N] (bits 4) or int8 [K, N] (bits 8); column blocks: [N / cb, rows, cb]
  const void* scale;      // [G, N] f32 or f16 (`half`), same layout
  const uint8_t* zero;    // [G, N] or null
  const void* offset;     // [G, N] or null
  const uint16_t* xb;     // [K / 32, Mp, 32] bf16: x rounded (`round_x`), rows past M zero
  float* y;               // [M, N]
  int64_t M, Mp, K, N, g, bits, cb;
  float sym;              // the zero point where `zero` is null
  bool half;
};

inline __m512 load16(const Problem& p, const void* a, int64_t i) {
  if (!p.half) return _mm512_loadu_ps(static_cast<const float*>(a) + i);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(a) + i)));
}

// Columns [n, n + 16) of every array: element (r, n) of a [rows, N] one is at base + r * stride
// (column blocks: the block's rows are cb apart; the checkpoint layout: N apart). Worked out once
// per 16 columns (a division), not per row.
struct Column {
  int64_t n, stride, q0, s0;    // q0: codes' (r, n) with rows K / 8 (K for int8); s0: groups' (0, n)
};

inline Column column(const Problem& p, int64_t n) {
  if (p.cb == p.N) return {n, p.N, n, n};
  const int64_t blk = n / p.cb, col = n % p.cb;
  return {n, p.cb, blk * (p.bits == 4 ? p.K / 8 : p.K) * p.cb + col, blk * (p.K / p.g) * p.cb + col};
}

// Group gi's scale and bias (offset - zero point * scale) of the column's 16.
inline void scale_bias(const Problem& p, const Column& c, int64_t gi, __m512& s, __m512& b) {
  const int64_t i = c.s0 + gi * c.stride;
  s = load16(p, p.scale, i);
  const __m512 zp = p.zero ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.zero + i))))
                           : _mm512_set1_ps(p.sym);
  b = _mm512_fnmadd_ps(zp, s, p.offset ? load16(p, p.offset, i) : _mm512_setzero_ps());
}

// One row of the weight tile: inputs k, k + 1 of 16 columns as bf16 pairs (column c's two values
// at 2c, 2c + 1), from their codes as int32 lanes.
inline void pair(__m512i even, __m512i odd, __m512 s, __m512 b, __m512i interleave, uint16_t* out) {
  const __m512 fe = _mm512_fmadd_ps(_mm512_cvtepi32_ps(even), s, b);
  const __m512 fo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd), s, b);
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(fo, fe);        // fe's 16 values, then fo's
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(interleave, both));
}

// The weight tile of inputs [k0, k0 + 32) of the column's 16: 16 rows of 64 bytes.
inline void dequantize(const Problem& p, const Column& c, int64_t k0, __m512i interleave, uint16_t* tile) {
  __m512 s, b;
  if (p.bits == 4) {
    const int32_t* q = static_cast<const int32_t*>(p.q) + c.q0;
    const __m512i nibble = _mm512_set1_epi32(0xF);
    for (int64_t w = 0; w < KC / 8; ++w) {          // word rows: 8 inputs each, within one group
      const int64_t r = k0 / 8 + w;
      if (w == 0 || (8 * r) % p.g == 0) scale_bias(p, c, 8 * r / p.g, s, b);
      const __m512i word = _mm512_loadu_si512(q + r * c.stride);
      for (int i = 0; i < 4; ++i) {                 // nibbles 2i, 2i + 1: inputs 8r + 2i, + 1
        const __m512i e = _mm512_and_si512(_mm512_srli_epi32(word, 8 * i), nibble);
        const __m512i o = _mm512_and_si512(_mm512_srli_epi32(word, 8 * i + 4), nibble);
        pair(e, o, s, b, interleave, tile + 32 * (4 * w + i));
      }
    }
  } else {
    const int8_t* q = static_cast<const int8_t*>(p.q) + c.q0;
    for (int64_t k = k0; k < k0 + KC; k += 2) {
      if (k == k0 || k % p.g == 0) scale_bias(p, c, k / p.g, s, b);
      const __m512i e = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * c.stride)));
      const __m512i o = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (k + 1) * c.stride)));
      pair(e, o, s, b, interleave, tile + 32 * ((k - k0) / 2));
    }
  }
}

// Rows [m0, m0 + 16 T) of y's columns [n, n + 16): T accumulator tiles through all of K. STRIP:
// `w` holds the column's dequantised tiles for all of K (K / 32 of them, `strip`); else `w` is two
// tile buffers filled here as the pass goes, the next chunk's written before this chunk's is
// loaded, so a tile load never waits for the stores just before it.
template <int T, bool STRIP>
void pass(const Problem& p, const Column& col, int64_t m0, __m512i interleave, uint16_t* w) {
  const int64_t n = col.n;
  _tile_zero(2);
  if constexpr (T > 1) _tile_zero(3);
  if constexpr (T > 2) _tile_zero(4);
  if constexpr (T > 3) _tile_zero(5);
  if constexpr (!STRIP) dequantize(p, col, 0, interleave, w);
  for (int64_t k0 = 0, c = 0; k0 < p.K; k0 += KC, ++c) {
    const uint16_t* wt = w + (STRIP ? c : c & 1) * (16 * 32);
    if constexpr (!STRIP)
      if (k0 + KC < p.K) dequantize(p, col, k0 + KC, interleave, w + ((c + 1) & 1) * (16 * 32));
    _tile_loadd(0, wt, 64);
    const uint16_t* x = p.xb + (k0 / KC * p.Mp + m0) * KC;    // 16 rows of x: 1 KiB in a row
    _tile_loadd(1, x, 64);
    _tile_dpbf16ps(2, 1, 0);
    if constexpr (T > 1) {              // x's next 16 rows into another tile: no wait for the multiply
      _tile_loadd(6, x + 16 * KC, 64);  // that still reads tile 1 (tiles are not renamed)
      _tile_dpbf16ps(3, 6, 0);
    }
    if constexpr (T > 2) {
      _tile_loadd(1, x + 32 * KC, 64);
      _tile_dpbf16ps(4, 1, 0);
    }
    if constexpr (T > 3) {
      _tile_loadd(6, x + 48 * KC, 64);
      _tile_dpbf16ps(5, 6, 0);
    }
  }
  // the accumulators out: straight into y where all their rows are y's, else through a buffer
  alignas(64) float acc[4][16 * 16];
  const int64_t ys = p.N * 4;
  const bool whole = m0 + 16 * T <= p.M;
  float* y = p.y + m0 * p.N + n;
  _tile_stored(2, whole ? y : acc[0], whole ? ys : 64);
  if constexpr (T > 1) _tile_stored(3, whole ? y + 16 * p.N : acc[1], whole ? ys : 64);
  if constexpr (T > 2) _tile_stored(4, whole ? y + 32 * p.N : acc[2], whole ? ys : 64);
  if constexpr (T > 3) _tile_stored(5, whole ? y + 48 * p.N : acc[3], whole ? ys : 64);
  if (!whole)
    for (int64_t m = m0; m < std::min(p.M, m0 + 16 * T); ++m)
      std::memcpy(p.y + m * p.N + n, acc[(m - m0) / 16] + 16 * ((m - m0) % 16), 64);
}

template <bool STRIP>
void passes(const Problem& p, const Column& col, int64_t r0, int64_t r1, __m512i interleave, uint16_t* w) {
  for (int64_t m0 = r0; m0 < r1; m0 += ROWS) {
    switch (std::min<int64_t>(4, (r1 - m0) / 16 + ((r1 - m0) % 16 != 0))) {
      case 1: pass<1, STRIP>(p, col, m0, interleave, w); break;
      case 2: pass<2, STRIP>(p, col, m0, interleave, w); break;
      case 3: pass<3, STRIP>(p, col, m0, interleave, w); break;
      default: pass<4, STRIP>(p, col, m0, interleave, w); break;
    }
  }
}

// A thread's buffer for one column's dequantised tiles over all of K (64-byte aligned, grown as
// needed, kept for the thread's later calls).
uint16_t* strip(int64_t K) {
  thread_local std::unique_ptr<uint16_t, decltype(&std::free)> buf(nullptr, &std::free);
  thread_local int64_t size = 0;
  if (size < K) {
    buf.reset(static_cast<uint16_t*>(std::aligned_alloc(64, K / KC * 1024)));
    size = buf ? K : 0;
  }
  return buf.get();
}

// Rows [r0, r1) of y's columns [c0, c1). One pass (up to 64 rows) dequantises as it goes; more
// rows dequantise each column's 16 once, into a strip buffer that every pass reads.
bool run(const Problem& p, int64_t c0, int64_t c1, int64_t r0, int64_t r1) {
  uint16_t* buf = r1 - r0 > ROWS ? strip(p.K) : nullptr;
  if (r1 - r0 > ROWS && !buf) return false;
  const TileConfig cfg = config(std::min<int64_t>(16, p.Mp));
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t tiles[2][16 * 32];
  alignas(64) uint16_t order[32];
  for (int c = 0; c < 16; ++c) order[2 * c] = c, order[2 * c + 1] = 16 + c;
  const __m512i interleave = _mm512_load_si512(order);
  for (int64_t n = c0; n < c1; n += 16) {
    const Column col = column(p, n);
    if (!buf) {
      passes<false>(p, col, r0, r1, interleave, tiles[0]);
      continue;
    }
    for (int64_t k0 = 0; k0 < p.K; k0 += KC) dequantize(p, col, k0, interleave, buf + k0 / KC * (16 * 32));
    passes<true>(p, col, r0, r1, interleave, buf);
  }
  _tile_release();
  return true;
}

// x [M, K] f32 -> bf16 (nearest even) in chunks of 32 inputs, [K / 32, Mp, 32]: each tile of 16
// rows one KiB in a row. Rows past M zero.
void round_x(const float* x, int64_t M, int64_t Mp, int64_t K, uint16_t* xb) {
  for (int64_t c = 0; c < K / KC; ++c) {
    uint16_t* out = xb + c * Mp * KC;
    for (int64_t m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * KC + 16 * h),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + m * K + c * KC + 16 * h)));
    std::memset(out + M * KC, 0, (Mp - M) * KC * sizeof(uint16_t));
  }
}

bool permitted() {
  // Linux: a process may use the tile data registers once it has asked (once per process)
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}
#endif

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                ffi::Buffer<ffi::U8> zero, ffi::AnyBuffer offset, ffi::Buffer<ffi::S32> layer,
                ffi::ResultBuffer<ffi::F32> y, int64_t group_size, int64_t bits, int64_t zero_point,
                int64_t col_block) {
#if JAXSERVE_AMX
  if (!permitted()) return ffi::Error::Internal("amx_matmul: the kernel refused this process the AMX tile registers");
  jaxserve::QuantWeight w;
  if (auto err = jaxserve::check_weight("amx_matmul", x, q, scale, zero, offset, layer, group_size, bits,
                                          col_block, w);
      err.failure())
    return err;
  if (w.K % KC) return ffi::Error::InvalidArgument("amx_matmul: K must be a multiple of 32");
  if (bits == 8 && q.element_type() == ffi::S32)
    return ffi::Error::InvalidArgument("amx_matmul: 8-bit codes four a word are the int8 kernel's layout");
  const int64_t M = w.M, K = w.K, N = w.N;
  const int64_t Mp = M <= 16 ? M : (M + 15) / 16 * 16;
  // 64-byte aligned: a tile row that straddles two cache lines makes every tile load of x split
  // (measured: 1.2x the kernel's time at 32 rows, 1.35x at 64)
  std::unique_ptr<uint16_t, decltype(&std::free)> xb(
      static_cast<uint16_t*>(std::aligned_alloc(64, (Mp * K * sizeof(uint16_t) + 63) / 64 * 64)), &std::free);
  if (!xb) return ffi::Error::Internal("amx_matmul: out of memory");
  round_x(x.typed_data(), M, Mp, K, xb.get());
  const Problem p{w.q, w.scale, w.zero, w.offset, xb.get(), y->typed_data(), M, Mp, K, N, group_size, bits, w.cb,
                  static_cast<float>(zero_point), w.half};
  // Units: (row block, column block) pairs, row blocks outer: a thread's units share its row
  // blocks of x (at most RB rows: in its core's L2), which every column of the block reads.
  const int64_t nrb = (Mp + RB - 1) / RB, ncb = (N + NB - 1) / NB;
  std::atomic<bool> ok{true};
  jaxserve::run_claims(pool, nrb * ncb, true, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t rb = u / ncb, cb = u % ncb;
      if (!run(p, cb * NB, std::min(p.N, (cb + 1) * NB), rb * RB, std::min(Mp, (rb + 1) * RB))) ok = false;
    }
  });
  if (!ok) return ffi::Error::Internal("amx_matmul: out of memory");
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("amx_matmul: this build has no AMX (JaxserveAmx() is 0)");
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAmxMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("zero_point")
                                  .Attr<int64_t>("col_block"));

// 1: this build has the AMX kernel and this process may use the tile registers; 0: not.
extern "C" int JaxserveAmx() {
#if JAXSERVE_AMX
  return permitted() ? 1 : 0;
#else
  return 0;
#endif
}
