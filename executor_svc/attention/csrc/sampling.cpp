// The sampler's per-row reductions over the vocabulary, for fp32 logits on the CPU: the argmax
// (first index of the largest value, as torch.argmax) and the log-sum-exp, in two vector passes
// over each row instead of torch's three (argmax, then max and exp-sum in logsumexp).
// Part of the CPU kernel library (executor_svc/attention/cpu_ops.py builds csrc/*.cpp into one).

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

void row(const float* x, int64_t n, int64_t* arg, float* lse) {
  int64_t best = 0;
  float mx = n > 0 ? x[0] : 0.0f;
  int64_t j = 0;
  if (n >= 16) {
    // Per lane: the largest value and the first 16-wide step where it occurs.
    v16 vm = load16(x);
    i16 vi = i16{};
    i16 step = i16{};
    for (j = 16; j + 16 <= n; j += 16) {
      step += 1;
      const v16 v = load16(x + j);
      const i16 gt = v > vm;
      vm = gt ? v : vm;
      vi = gt ? step : vi;
    }
    mx = vm[0];
    best = (int64_t)vi[0] * 16;
    for (int u = 1; u < 16; ++u) {
      const int64_t idx = (int64_t)vi[u] * 16 + u;
      if (vm[u] > mx || (vm[u] == mx && idx < best)) mx = vm[u], best = idx;
    }
  }
  for (; j < n; ++j)
    if (x[j] > mx) mx = x[j], best = j;
  v16 sum = v16{};
  for (j = 0; j + 16 <= n; j += 16) sum += exp16(load16(x + j) - mx);
  float s = 0.0f;
  for (int u = 0; u < 16; ++u) s += sum[u];
  for (; j < n; ++j) s += std::exp(x[j] - mx);
  *arg = best;
  *lse = mx + std::log(s);
}

}  // namespace

extern "C" int llmserve_argmax_logsumexp_f32(const float* x, int64_t rows, int64_t cols,
                                             int64_t row_stride, int64_t* arg, float* lse,
                                             int num_threads) {
  if (cols <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows > 1)
  for (int64_t r = 0; r < rows; ++r) row(x + r * row_stride, cols, arg + r, lse + r);
  return 0;
}
