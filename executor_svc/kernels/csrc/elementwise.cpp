// Elementwise work of the model's forward for fp32 on the CPU, one pass each where torch takes
// two or three: the MLP's silu(gate) * up, and RMSNorm with the residual add before it. Part of
// the CPU kernel library
// (executor_svc/kernels/library.py builds csrc/*.cpp into one).

#include <cmath>
#include <cstdint>

#include "simd.h"

using namespace llmserve;

// out[r, j] = silu(x[r, j]) * x[r, n + j] for j < n: x rows [gate | up] with row stride
// x_stride, out [rows, n] contiguous.
extern "C" int llmserve_silu_mul_f32(const float* x, int64_t rows, int64_t n, int64_t x_stride,
                                     float* out, int num_threads) {
  if (n <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * n > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = x + r * x_stride;
    const float* u = g + n;
    float* o = out + r * n;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const v16 gv = load16(g + j);
      store16(o + j, gv / (1.0f + exp16(-gv)) * load16(u + j));
    }
    for (; j < n; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
  return 0;
}

// RMSNorm of rows, optionally after a residual add: s = x (+ delta); out = s / rms(s) * w with
// rms(s) = sqrt(mean(s^2) + eps); when sum_out is given, s is stored there too (the new residual
// stream). Rows of dim floats at the given row strides; sum_out and out contiguous.
extern "C" int llmserve_add_rms_norm_f32(const float* x, int64_t x_stride, const float* delta,
                                         int64_t d_stride, const float* w, int64_t rows,
                                         int64_t dim, float eps, float* sum_out, float* out,
                                         int num_threads) {
  if (dim <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * dim > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    const float* dr = delta ? delta + r * d_stride : nullptr;
    float* sr = sum_out ? sum_out + r * dim : nullptr;
    float* o = out + r * dim;
    // s goes to sum_out, or to out as scratch, then is scaled in place.
    float* s = sr ? sr : o;
    v16 acc = v16{};
    int64_t j = 0;
    for (; j + 16 <= dim; j += 16) {
      v16 v = load16(xr + j);
      if (dr) v += load16(dr + j);
      store16(s + j, v);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (; j < dim; ++j) {
      const float v = dr ? xr[j] + dr[j] : xr[j];
      s[j] = v;
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / (float)dim + eps);
    for (j = 0; j + 16 <= dim; j += 16) store16(o + j, load16(s + j) * inv * load16(w + j));
    for (; j < dim; ++j) o[j] = s[j] * inv * w[j];
  }
  return 0;
}
