// The sampler's per-row reductions over the vocabulary, for fp32 logits on the CPU: the argmax
// (first index of the largest value, as torch.argmax) and the log-sum-exp, in two vector passes
// over each row instead of torch's three (argmax, then max and exp-sum in logsumexp).
// Part of the CPU kernel library (executor_svc/kernels/library.py builds csrc/*.cpp into one).

#include <cmath>
#include <cstdint>

#include "simd.h"

using namespace llmserve;

namespace {

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
