// Elementwise work of the model's forward for fp32 on the CPU, one pass each where torch takes
// two or three: the MLP's silu(gate) * up. Part of the CPU kernel library
// (executor_svc/attention/cpu_ops.py builds csrc/*.cpp into one).

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
