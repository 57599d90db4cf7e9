// The fused elementwise ops of csrc/elementwise.cpp for bf16 rows: bf16 in and out, fp32 inside,
// rounded where the reference (Hugging Face's bf16 modules) rounds. Part of the CPU kernel
// library (executor_svc/kernels/library.py); called from executor_svc/kernels/elementwise.py.
// Every row is computed alone, in one fixed order (step invariance, config/numerics.py).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"
#include "simd8.h"

using namespace llmserve;

namespace {

typedef uint32_t u16x __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));

inline v16 load_bf16(const uint16_t* p) {  // 16 bf16 widened (exact)
  h16 h;
  std::memcpy(&h, p, sizeof h);
  const u16x bits = __builtin_convertvector(h, u16x) << 16;
  v16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline void store_bf16(uint16_t* p, v16 v) {  // round to nearest even (finite values)
  u16x bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const h16 h = __builtin_convertvector(bits, h16);
  std::memcpy(p, &h, sizeof h);
}

#if defined(LLMSERVE_AVX2_PATHS)
typedef uint32_t u8x __attribute__((vector_size(32)));

inline void store_bf16x8(uint16_t* p, v8 v) {  // store_bf16 on 8 lanes
  u8x bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const __m256i b = (__m256i)bits;
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128((__m128i*)p, h);
}

inline v8 round_bf16x8(v8 v) {
  u8x bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = ((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16) << 16;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
#endif

// o = bf16(silu(g) * u) for 16 bf16, fp32 inside, the same bits in every build: exp as exp16
// (exp8 on each half), the division exact (simd8.h div_exact), one rounding.
inline void silu_mul16(const uint16_t* g, const uint16_t* u, uint16_t* o) {
#if defined(LLMSERVE_AVX2_PATHS)
  for (int h = 0; h < 16; h += 8) {
    const v8 gv = load_bf16x8(g + h);
    store_bf16x8(o + h, div_exact(gv, 1.0f + exp8(-gv)) * load_bf16x8(u + h));
  }
#elif defined(__AVX512F__)
  const v16 gv = load_bf16(g);
  store_bf16(o, div_exact(gv, 1.0f + exp16(-gv)) * load_bf16(u));
#else
  const v16 gv = load_bf16(g);
  store_bf16(o, gv / (1.0f + exp16(-gv)) * load_bf16(u));
#endif
}

inline float widen(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t narrow(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline float round_bf16(float f) { return widen(narrow(f)); }

inline v16 round_bf16(v16 v) {
  u16x bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = ((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16) << 16;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

}  // namespace

// out[r, j] = bf16(silu(g) * u) for g = x[r, j], u = x[r, n + j] (one rounding: fp32 inside).
extern "C" int llmserve_silu_mul_bf16(const uint16_t* x, int64_t rows, int64_t n,
                                      int64_t x_stride, uint16_t* out, int num_threads) {
  if (n <= 0) return 1;
  const bool parallel = num_threads > 1 && rows > 1 && rows * n >= kParallelMin;
  flush_for(rows, num_threads, parallel, [&](int64_t r) {
    const uint16_t* g = x + r * x_stride;
    const uint16_t* u = g + n;
    uint16_t* o = out + r * n;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) silu_mul16(g + j, u + j, o + j);
    if (j < n) {  // the tail through a zero-padded block: the same arithmetic as the others
      uint16_t gt[16] = {}, ut[16] = {}, ot[16];
      for (int64_t i = j; i < n; ++i) gt[i - j] = g[i], ut[i - j] = u[i];
      silu_mul16(gt, ut, ot);
      for (int64_t i = j; i < n; ++i) o[i] = ot[i - j];
    }
  });
  return 0;
}

// RMSNorm of bf16 rows after an optional residual add, rounded as the bf16 reference does:
// s = bf16(x + delta) (the new residual stream, stored to sum_out when given), statistics of s
// in fp32, then out = bf16(w * bf16(s / rms(s))).
extern "C" int llmserve_add_rms_norm_bf16(const uint16_t* x, int64_t x_stride,
                                          const uint16_t* delta, int64_t d_stride,
                                          const uint16_t* w, int64_t rows, int64_t dim, float eps,
                                          uint16_t* sum_out, uint16_t* out, int num_threads) {
  if (dim <= 0) return 1;
  const bool parallel = num_threads > 1 && rows > 1 && rows * dim >= kParallelMin;
  flush_for(rows, num_threads, parallel, [&](int64_t r) {
    const uint16_t* xr = x + r * x_stride;
    const uint16_t* dr = delta ? delta + r * d_stride : nullptr;
    uint16_t* sr = sum_out ? sum_out + r * dim : nullptr;
    uint16_t* o = out + r * dim;
    // The rounded sum goes to sum_out, or to out as scratch (bf16 holds it exactly).
    uint16_t* s = sr ? sr : o;
    int64_t j = 0;
#if defined(LLMSERVE_AVX2_PATHS)
    // The v16 loop on halves: lanes 0-7 and 8-15 of each 16 in acc0 and acc1 (hsum's order).
    v8 acc0 = v8{}, acc1 = v8{};
    for (; j + 16 <= dim; j += 16) {
      v8 v0 = load_bf16x8(xr + j), v1 = load_bf16x8(xr + j + 8);
      if (dr) {
        v0 = round_bf16x8(v0 + load_bf16x8(dr + j));
        v1 = round_bf16x8(v1 + load_bf16x8(dr + j + 8));
      }
      store_bf16x8(s + j, v0);
      store_bf16x8(s + j + 8, v1);
      acc0 += v0 * v0;
      acc1 += v1 * v1;
    }
    float ss = hsum2(acc0, acc1);
#else
    v16 acc = v16{};
    for (; j + 16 <= dim; j += 16) {
      v16 v = load_bf16(xr + j);
      if (dr) v = round_bf16(v + load_bf16(dr + j));
      store_bf16(s + j, v);
      acc += v * v;
    }
    float ss = hsum(acc);
#endif
    for (; j < dim; ++j) {
      const float v = dr ? round_bf16(widen(xr[j]) + widen(dr[j])) : widen(xr[j]);
      s[j] = narrow(v);
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / (float)dim + eps);
    j = 0;
#if defined(LLMSERVE_AVX2_PATHS)
    for (; j < dim / 16 * 16; j += 8)
      store_bf16x8(o + j, load_bf16x8(w + j) * round_bf16x8(load_bf16x8(s + j) * inv));
#endif
    for (; j + 16 <= dim; j += 16)
      store_bf16(o + j, load_bf16(w + j) * round_bf16(load_bf16(s + j) * inv));
    for (; j < dim; ++j) o[j] = narrow(widen(w[j]) * round_bf16(widen(s[j]) * inv));
  });
  return 0;
}
