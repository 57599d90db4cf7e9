// The sampler's per-row reductions over the vocabulary, for fp32 logits on the CPU: the argmax
// (first index of the largest value, as torch.argmax) and the log-sum-exp, in two vector passes
// over each row instead of torch's three (argmax, then max and exp-sum in logsumexp).
// Part of the CPU kernel library (executor_svc/kernels/library.py builds csrc/*.cpp into one).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"
#include "simd8.h"

using namespace llmserve;

namespace {

#if !defined(LLMSERVE_AVX2_PATHS)
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
#else
// The same two passes on 8-lane halves (simd8.h): lanes 0-7 of each 16-wide step in the low
// vectors, 8-15 in the high ones, so every lane's maximum, first step and exp sum, and the
// order they are combined in (lane 0 to 15), are the v16 code's.
void row(const float* x, int64_t n, int64_t* arg, float* lse) {
  int64_t best = 0;
  float mx = n > 0 ? x[0] : 0.0f;
  int64_t j = 0;
  if (n >= 16) {
    v8 m0 = load8(x), m1 = load8(x + 8);
    i8 i0 = i8{}, i1 = i8{}, step = i8{};
    for (j = 16; j + 16 <= n; j += 16) {
      step += 1;
      const v8 a = load8(x + j), b = load8(x + j + 8);
      const i8 ga = a > m0, gb = b > m1;
      m0 = ga ? a : m0;
      m1 = gb ? b : m1;
      i0 = ga ? step : i0;
      i1 = gb ? step : i1;
    }
    float vm[16];
    int32_t vi[16];
    store8(vm, m0);
    store8(vm + 8, m1);
    std::memcpy(vi, &i0, sizeof i0);
    std::memcpy(vi + 8, &i1, sizeof i1);
    mx = vm[0];
    best = (int64_t)vi[0] * 16;
    for (int u = 1; u < 16; ++u) {
      const int64_t idx = (int64_t)vi[u] * 16 + u;
      if (vm[u] > mx || (vm[u] == mx && idx < best)) mx = vm[u], best = idx;
    }
  }
  for (; j < n; ++j)
    if (x[j] > mx) mx = x[j], best = j;
  v8 s0 = v8{}, s1 = v8{};
  for (j = 0; j + 16 <= n; j += 16) {
    s0 += exp8(load8(x + j) - mx);
    s1 += exp8(load8(x + j + 8) - mx);
  }
  float sum[16];
  store8(sum, s0);
  store8(sum + 8, s1);
  float s = 0.0f;
  for (int u = 0; u < 16; ++u) s += sum[u];
  for (; j < n; ++j) s += std::exp(x[j] - mx);
  *arg = best;
  *lse = mx + std::log(s);
}
#endif

}  // namespace

extern "C" int llmserve_argmax_logsumexp_f32(const float* x, int64_t rows, int64_t cols,
                                             int64_t row_stride, int64_t* arg, float* lse,
                                             int num_threads) {
  if (cols <= 0) return 1;
  flush_for(rows, num_threads, num_threads > 1 && rows > 1,
            [&](int64_t r) { row(x + r * row_stride, cols, arg + r, lse + r); });
  return 0;
}
