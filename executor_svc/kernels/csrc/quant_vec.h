// The 16-lane vector of the split-layout kernels (quant_split.cpp), written per instruction set:
// one zmm with AVX-512; two ymm halves with AVX2, each op applied to both (GCC lowers simd.h's
// generic v16 shuffles through the stack there: that build ran ~10x slower); simd.h's v16
// elsewhere. Every op is lane-wise, and vsum is simd.h's hsum tree, so each build computes the
// same bits for the same chain.
#pragma once

#include <cstdint>

#include "quant_common.h"

namespace llmserve {
namespace quant {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define LLMSERVE_QUANT_VEC_AVX2 1
struct vf {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vsplat(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, vf a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vfma(vf a, vf b, vf c) {  // c + a * b, one rounding per lane
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline float vsum(vf a) {  // hsum: halves, then quarters, then (c0 + c2) + (c1 + c3)
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}
inline __m256 ints8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
inline __m256 uints8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
// 16 bytes as 16 floats, unsigned or signed.
template <bool kSigned>
inline vf to_vf(__m128i v) {
  const __m128i h = _mm_srli_si128(v, 8);
  return kSigned ? vf{ints8(v), ints8(h)} : vf{uints8(v), uints8(h)};
}
// 8 bytes at p as 8 int32 lanes (vpmovsxbd / vpmovzxbd straight from memory: no 128-bit
// load and byte shift before the widening).
inline __m256i ints8_at(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
}
inline __m256i uints8_at(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}
// The 32 quants of a Q8_0 group.
inline void decode_q8(const uint8_t* q, vf& q0, vf& q1) {
  q0 = {_mm256_cvtepi32_ps(ints8_at(q)), _mm256_cvtepi32_ps(ints8_at(q + 8))};
  q1 = {_mm256_cvtepi32_ps(ints8_at(q + 16)), _mm256_cvtepi32_ps(ints8_at(q + 24))};
}
// The 32 nibbles of a Q4 group plus kOffset (exact small integers): bytes widened to int32
// lanes first, so a nibble is one and / shift of the lane.
template <int kOffset>
inline void decode_q4(const uint8_t* q, vf& q0, vf& q1) {
  const __m256i b0 = uints8_at(q), b1 = uints8_at(q + 8), m = _mm256_set1_epi32(0x0F);
  const __m256i o = _mm256_set1_epi32(kOffset);  // added as integers (exact either way)
  auto f = [&](__m256i v) {
    return _mm256_cvtepi32_ps(kOffset != 0 ? _mm256_add_epi32(v, o) : v);
  };
  q0 = {f(_mm256_and_si256(b0, m)), f(_mm256_and_si256(b1, m))};
  q1 = {f(_mm256_srli_epi32(b0, 4)), f(_mm256_srli_epi32(b1, 4))};
}
#else
struct vf {
  v16 v;
};
inline vf vzero() { return {v16{}}; }
inline vf vsplat(float s) { return {v16{} + s}; }
inline vf vload(const float* p) { return {load16(p)}; }
inline void vstore(float* p, vf a) { store16(p, a.v); }
inline vf vadd(vf a, vf b) { return {a.v + b.v}; }
inline vf vmul(vf a, vf b) { return {a.v * b.v}; }
inline vf vfma(vf a, vf b, vf c) { return {fma16(a.v, b.v, c.v)}; }
inline float vsum(vf a) { return hsum(a.v); }
template <bool kSigned>
inline vf to_vf(b16 v) {
  return {to_v16<kSigned>(v)};
}
#if defined(__AVX512F__)
inline void decode_q8(const uint8_t* q, vf& q0, vf& q1) {
  q0 = {(v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)))};
  q1 = {(v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))))};
}
// The 32 weights of a Q4 group de-quantized through a table of the group's 16 values (each
// d * (v + kOffset) + m in one rounding, or d * (v + kOffset) exact): one vector op builds the
// table, and the nibble in the low 4 bits of each 32-bit lane picks its entry (vpermps reads
// only those bits), the same bits as decode + fma would give.
template <int kOffset, bool kMin>
inline void dequant_q4(const uint8_t* q, float d, float m, vf& w0, vf& w1) {
  const __m512 iota = _mm512_setr_ps(kOffset, kOffset + 1, kOffset + 2, kOffset + 3, kOffset + 4,
                                     kOffset + 5, kOffset + 6, kOffset + 7, kOffset + 8,
                                     kOffset + 9, kOffset + 10, kOffset + 11, kOffset + 12,
                                     kOffset + 13, kOffset + 14, kOffset + 15);
  const __m512 table = kMin ? _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(m))
                            : _mm512_mul_ps(_mm512_set1_ps(d), iota);
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
  w0 = {(v16)_mm512_permutexvar_ps(b, table)};
  w1 = {(v16)_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table)};
}
#else
inline void decode_q8(const uint8_t* q, vf& q0, vf& q1) {
  q0 = {to_v16<true>(load_b16(q))};
  q1 = {to_v16<true>(load_b16(q + 16))};
}
template <int kOffset>
inline void decode_q4(const uint8_t* q, vf& q0, vf& q1) {
  const b16 v = load_b16(q);
  q0 = {to_v16<false>(low_nibbles(v))};
  q1 = {to_v16<false>(high_nibbles(v))};
  if constexpr (kOffset != 0) {
    q0 = vadd(q0, vsplat((float)kOffset));
    q1 = vadd(q1, vsplat((float)kOffset));
  }
}
#endif
#endif

#if !defined(__AVX512F__)
// The 32 weights of a Q4 group de-quantized (kMin: d * (q + kOffset) + m in one rounding, as
// fma; else d * (q + kOffset), exact): the same bits as the GGUF reference's d * q + m (and as
// AVX-512's table of them).
template <int kOffset, bool kMin>
inline void dequant_q4(const uint8_t* q, float d, float m, vf& w0, vf& w1) {
  vf q0, q1;
  decode_q4<kOffset>(q, q0, q1);
  if constexpr (kMin) {
    w0 = vfma(vsplat(d), q0, vsplat(m));
    w1 = vfma(vsplat(d), q1, vsplat(m));
  } else {
    w0 = vmul(vsplat(d), q0);
    w1 = vmul(vsplat(d), q1);
  }
}
#endif

}  // namespace quant
}  // namespace llmserve
