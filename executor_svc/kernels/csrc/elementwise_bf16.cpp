// The fused elementwise ops of csrc/elementwise.cpp for bf16 rows: bf16 in and out, fp32 inside,
// rounded where the reference (Hugging Face's bf16 modules) rounds. Part of the CPU kernel
// library (executor_svc/kernels/library.py); called from executor_svc/kernels/elementwise.py.
// Every row is computed alone, in one fixed order (step invariance, config/numerics.py).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

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
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * n > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* g = x + r * x_stride;
    const uint16_t* u = g + n;
    uint16_t* o = out + r * n;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const v16 gv = load_bf16(g + j);
      store_bf16(o + j, gv / (1.0f + exp16(-gv)) * load_bf16(u + j));
    }
    for (; j < n; ++j) {
      const float gv = widen(g[j]);
      o[j] = narrow(gv / (1.0f + std::exp(-gv)) * widen(u[j]));
    }
  }
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
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * dim > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * x_stride;
    const uint16_t* dr = delta ? delta + r * d_stride : nullptr;
    uint16_t* sr = sum_out ? sum_out + r * dim : nullptr;
    uint16_t* o = out + r * dim;
    // The rounded sum goes to sum_out, or to out as scratch (bf16 holds it exactly).
    uint16_t* s = sr ? sr : o;
    v16 acc = v16{};
    int64_t j = 0;
    for (; j + 16 <= dim; j += 16) {
      v16 v = load_bf16(xr + j);
      if (dr) v = round_bf16(v + load_bf16(dr + j));
      store_bf16(s + j, v);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (; j < dim; ++j) {
      const float v = dr ? round_bf16(widen(xr[j]) + widen(dr[j])) : widen(xr[j]);
      s[j] = narrow(v);
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / (float)dim + eps);
    for (j = 0; j + 16 <= dim; j += 16)
      store_bf16(o + j, load_bf16(w + j) * round_bf16(load_bf16(s + j) * inv));
    for (; j < dim; ++j) o[j] = narrow(widen(w[j]) * round_bf16(widen(s[j]) * inv));
  }
  return 0;
}
