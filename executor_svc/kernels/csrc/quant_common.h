// Helpers shared by the quantized matmul sources (quant_gemm.cpp: the GGUF block layout and the
// K-quants; quant_split.cpp: the split layout of Q8_0 / Q4_0 / Q4_1): ggml type ids, exact
// fp16 conversion, products rounded apart, 16 bytes as 16 floats, the IEEE mode of a call.
#pragma once

#include <cstdint>
#include <cstring>

#include "simd.h"

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace llmserve {
namespace quant {

// ggml type ids (gguf.GGMLQuantizationType)
enum : int { kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kBF16 = 30 };
// Or'ed into a split type's id: the matmul quantizes its activations to int8 (quant_act8.cpp).
constexpr int kActInt8 = 0x100;

inline v16 splat(float s) { return v16{} + s; }

// A product rounded on its own (numpy's order), never fused into a following sum.
inline float mul_rounded(float a, float b) {
  float r = a * b;
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+x"(r));
#else
  __asm__("" : "+w"(r));
#endif
  return r;
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400)) man <<= 1, --exp;
    bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// 16 bytes as 16 floats, unsigned or signed. Written per ISA: GCC's generic vector
// conversions of byte vectors come out as scalar code.
#if defined(__SSE4_1__)
typedef __m128i b16;
inline b16 load_b16(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }
inline b16 low_nibbles(b16 v) { return _mm_and_si128(v, _mm_set1_epi8(0x0F)); }
inline b16 high_nibbles(b16 v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)); }
inline b16 shift_right(b16 v, int n) { return _mm_srl_epi16(v, _mm_cvtsi32_si128(n)); }
inline b16 and_bytes(b16 v, int m) { return _mm_and_si128(v, _mm_set1_epi8((char)m)); }
inline b16 or_shifted4(b16 lo, b16 hi) {  // lo | hi << 4, hi < 16
  return _mm_or_si128(lo, _mm_slli_epi16(hi, 4));
}
template <bool kSigned>
inline v16 to_v16(b16 v) {
#if defined(__AVX512F__)
  const __m512i w = kSigned ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
  return (v16)_mm512_cvtepi32_ps(w);
#elif defined(__AVX2__)
  const b16 h = _mm_srli_si128(v, 8);
  const __m256 lo = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
  const __m256 hi = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h));
  typedef float v8 __attribute__((vector_size(32)));
  return __builtin_shufflevector((v8)lo, (v8)hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                 14, 15);
#else
  alignas(16) uint8_t b[16];
  _mm_store_si128((__m128i*)b, v);
  v16 f;
  for (int i = 0; i < 16; ++i) f[i] = kSigned ? (float)(int8_t)b[i] : (float)b[i];
  return f;
#endif
}
#else  // portable fallback: plain byte arrays
struct b16 {
  uint8_t b[16];
};
inline b16 load_b16(const uint8_t* p) {
  b16 v;
  std::memcpy(v.b, p, 16);
  return v;
}
inline b16 shift_right(b16 v, int n) {
  for (auto& x : v.b) x = (uint8_t)(x >> n);
  return v;
}
inline b16 and_bytes(b16 v, int m) {
  for (auto& x : v.b) x = (uint8_t)(x & m);
  return v;
}
inline b16 low_nibbles(b16 v) { return and_bytes(v, 0x0F); }
inline b16 high_nibbles(b16 v) { return shift_right(v, 4); }
inline b16 or_shifted4(b16 lo, b16 hi) {
  for (int i = 0; i < 16; ++i) lo.b[i] = (uint8_t)(lo.b[i] | (hi.b[i] << 4));
  return lo;
}
template <bool kSigned>
inline v16 to_v16(b16 v) {
  v16 f;
  for (int i = 0; i < 16; ++i) f[i] = kSigned ? (float)(int8_t)v.b[i] : (float)v.b[i];
  return f;
}
#endif

}  // namespace quant
}  // namespace llmserve
