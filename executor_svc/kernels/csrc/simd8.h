// 8-float helpers for the AVX2 build (x86-64-v3: 16 ymm registers, no AVX-512). A 64-byte v16
// of simd.h is lowered there to ymm pairs through memory and its tiles spill, so the kernels'
// AVX2 paths (under !__AVX512F__) work on native 8-lane vectors instead. They must give the
// AVX-512 build's bits: a v16 lane u < 8 is lane u of the "lo" v8, lane u >= 8 lane u - 8 of
// the "hi" v8, every lanewise operation is written with the same expression (so the compiler
// contracts the same multiply-adds), and the reductions below add in the order of simd.h's
// hsum / reduce16.
#pragma once

#include <cstdint>
#include <cstring>

#include "simd.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
#define LLMSERVE_AVX2_PATHS 1
#include <immintrin.h>

namespace llmserve {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// 8 bf16 widened to fp32 (exact): a 16-bit shift of each zero-extended element.
inline v8 load_bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128((const __m128i*)p);
  return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// hsum of the v16 whose halves are lo, hi: (lo + hi), then 128-bit halves, then
// (c0 + c2) + (c1 + c3), simd.h's order.
inline float hsum2(v8 lo, v8 hi) {
  const v8 a = lo + hi;
  const __m128 c =
      _mm_add_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));  // c0 + c2, c1 + c3
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

// Lane k = the horizontal sum of key k's 16 lanes, given s[k] = lo + hi of key k (8 keys):
// the tree of simd.h's reduce16 (t_j = s_j + s_{j+4}, u_j = t_j + t_{j+2}, u_0 + u_1), four keys
// per step through 128-bit and in-lane shuffles. Pairs (k, k + 4) share a register in the first
// step, so the lanes come out in key order.
inline v8 reduce8(const v8* s) {
  __m256 x[4];
  for (int k = 0; k < 4; ++k)  // [t of key k | t of key k + 4]
    x[k] = _mm256_add_ps(_mm256_permute2f128_ps((__m256)s[k], (__m256)s[k + 4], 0x20),
                         _mm256_permute2f128_ps((__m256)s[k], (__m256)s[k + 4], 0x31));
  // [u of keys 0, 1 | u of keys 4, 5] and [u of keys 2, 3 | u of keys 6, 7]
  const __m256 y0 =
      _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], 0x44), _mm256_shuffle_ps(x[0], x[1], 0xEE));
  const __m256 y1 =
      _mm256_add_ps(_mm256_shuffle_ps(x[2], x[3], 0x44), _mm256_shuffle_ps(x[2], x[3], 0xEE));
  return (v8)_mm256_add_ps(_mm256_shuffle_ps(y0, y1, 0x88), _mm256_shuffle_ps(y0, y1, 0xDD));
}

// simd.h's exp16 on 8 lanes: the same expressions, so each lane gets exp16's bits.
inline v8 exp8(v8 x) {
  x = x < -87.0f ? v8{} - 87.0f : x;
  x = x > 88.0f ? v8{} + 88.0f : x;
  const v8 y = x * 1.44269504f;
  const i8 n = __builtin_convertvector(y + (y < 0.0f ? v8{} - 0.5f : v8{} + 0.5f), i8);
  const v8 nf = __builtin_convertvector(n, v8);
  const v8 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
  v8 p = 1.0f / 720 + r * (1.0f / 5040);
  p = 1.0f / 120 + r * p;
  p = 1.0f / 24 + r * p;
  p = 1.0f / 6 + r * p;
  p = 0.5f + r * p;
  p = 1.0f + r * p;
  p = 1.0f + r * p;
  i8 bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += n << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

}  // namespace llmserve
#endif

namespace llmserve {

// a / b correctly rounded in every build. Under -ffast-math GCC turns a vector division into a
// reciprocal estimate and a Newton step, and the estimate differs per instruction set (vrcp14ps
// on AVX-512, vrcpps on AVX2): different bits. The instruction itself cannot be rewritten.
#if defined(__AVX512F__)
inline v16 div_exact(v16 a, v16 b) {
  v16 r;
  asm("vdivps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
  return r;
}
#elif defined(LLMSERVE_AVX2_PATHS)
inline v8 div_exact(v8 a, v8 b) {
  v8 r;
  asm("vdivps %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
  return r;
}
#endif

}  // namespace llmserve
