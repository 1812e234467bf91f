// The CPU kernels' vector width (int4_matvec.cc, paged_attention.cc): L lanes of f32, one
// register. GCC lowers a generic vector wider than the target's registers through the stack,
// element by element: 16-lane vectors on an AVX2-only CPU (Zen 3) ran ~10x slower
// (benchmarks/RESULTS.md, 2026-11-25). 16 lanes with AVX-512, 8 with AVX (AVX2), 16 elsewhere
// (four NEON registers: not measured).
#pragma once

namespace jaxserve {

#if defined(__AVX__) && !defined(__AVX512F__)
#define JAXSERVE_LANES 8
#else
#define JAXSERVE_LANES 16
#endif
constexpr int L = JAXSERVE_LANES;
typedef float vf __attribute__((vector_size(4 * L)));

}  // namespace jaxserve
