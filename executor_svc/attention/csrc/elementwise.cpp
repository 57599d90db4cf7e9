// Elementwise work of the model's forward for fp32 on the CPU, one pass each where torch takes
// two or three: the MLP's silu(gate) * up. Part of the CPU kernel library
// (executor_svc/attention/cpu_ops.py builds csrc/*.cpp into one).

#include <cmath>
#include <cstdint>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }

// Same as paged_attention.cpp's exp16 (each source file stands alone).
inline v16 exp16(v16 x) {
  x = x < -87.0f ? v16{} - 87.0f : x;
  x = x > 88.0f ? v16{} + 88.0f : x;
  const v16 y = x * 1.44269504f;
  const i16 n = __builtin_convertvector(y + (y < 0.0f ? v16{} - 0.5f : v16{} + 0.5f), i16);
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
  v16 p = 1.0f / 720 + r * (1.0f / 5040);
  p = 1.0f / 120 + r * p;
  p = 1.0f / 24 + r * p;
  p = 1.0f / 6 + r * p;
  p = 0.5f + r * p;
  p = 1.0f + r * p;
  p = 1.0f + r * p;
  i16 bits;
  __builtin_memcpy(&bits, &p, sizeof bits);
  bits += n << 23;
  __builtin_memcpy(&p, &bits, sizeof p);
  return p;
}

}  // namespace

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
