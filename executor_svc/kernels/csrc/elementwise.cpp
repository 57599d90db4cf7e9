// Elementwise work of the model's forward for fp32 on the CPU, one pass each where torch takes
// two or three: the MLP's silu(gate) * up, and RMSNorm with the residual add before it. Part of
// the CPU kernel library
// (executor_svc/kernels/library.py builds csrc/*.cpp into one).

#include <cmath>
#include <cstdint>

#include "simd.h"
#include "simd8.h"

using namespace llmserve;

namespace {

// o = silu(g) * u = g / (1 + exp(-g)) * u for 16 floats, the same bits in every build: exp as
// exp16 (exp8 on each half), the division exact (simd8.h div_exact).
inline void silu_mul16(const float* g, const float* u, float* o) {
#if defined(LLMSERVE_AVX2_PATHS)
  for (int h = 0; h < 16; h += 8) {
    const v8 gv = load8(g + h);
    store8(o + h, div_exact(gv, 1.0f + exp8(-gv)) * load8(u + h));
  }
#elif defined(__AVX512F__)
  const v16 gv = load16(g);
  store16(o, div_exact(gv, 1.0f + exp16(-gv)) * load16(u));
#else
  const v16 gv = load16(g);
  store16(o, gv / (1.0f + exp16(-gv)) * load16(u));
#endif
}

}  // namespace

// out[r, j] = silu(x[r, j]) * x[r, n + j] for j < n: x rows [gate | up] with row stride
// x_stride, out [rows, n] contiguous.
extern "C" int llmserve_silu_mul_f32(const float* x, int64_t rows, int64_t n, int64_t x_stride,
                                     float* out, int num_threads) {
  if (n <= 0) return 1;
  const bool parallel = num_threads > 1 && rows > 1 && rows * n >= kParallelMin;
  flush_for(rows, num_threads, parallel, [&](int64_t r) {
    const float* g = x + r * x_stride;
    const float* u = g + n;
    float* o = out + r * n;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) silu_mul16(g + j, u + j, o + j);
    if (j < n) {  // the tail through a zero-padded block: the same arithmetic as the others
      float gt[16] = {}, ut[16] = {}, ot[16];
      for (int64_t i = j; i < n; ++i) gt[i - j] = g[i], ut[i - j] = u[i];
      silu_mul16(gt, ut, ot);
      for (int64_t i = j; i < n; ++i) o[i] = ot[i - j];
    }
  });
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
  const bool parallel = num_threads > 1 && rows > 1 && rows * dim >= kParallelMin;
  flush_for(rows, num_threads, parallel, [&](int64_t r) {
    const float* xr = x + r * x_stride;
    const float* dr = delta ? delta + r * d_stride : nullptr;
    float* sr = sum_out ? sum_out + r * dim : nullptr;
    float* o = out + r * dim;
    // s goes to sum_out, or to out as scratch, then is scaled in place.
    float* s = sr ? sr : o;
    int64_t j = 0;
#if defined(LLMSERVE_AVX2_PATHS)
    // The v16 loop on halves: lanes 0-7 and 8-15 of each 16 in acc0 and acc1 (hsum's order).
    v8 acc0 = v8{}, acc1 = v8{};
    for (; j + 16 <= dim; j += 16) {
      v8 v0 = load8(xr + j), v1 = load8(xr + j + 8);
      if (dr) v0 += load8(dr + j), v1 += load8(dr + j + 8);
      store8(s + j, v0);
      store8(s + j + 8, v1);
      acc0 += v0 * v0;
      acc1 += v1 * v1;
    }
    float ss = hsum2(acc0, acc1);
#else
    v16 acc = v16{};
    for (; j + 16 <= dim; j += 16) {
      v16 v = load16(xr + j);
      if (dr) v += load16(dr + j);
      store16(s + j, v);
      acc += v * v;
    }
    float ss = hsum(acc);
#endif
    for (; j < dim; ++j) {
      const float v = dr ? xr[j] + dr[j] : xr[j];
      s[j] = v;
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / (float)dim + eps);
    j = 0;
#if defined(LLMSERVE_AVX2_PATHS)
    for (; j < dim / 16 * 16; j += 8) store8(o + j, load8(s + j) * inv * load8(w + j));
#endif
    for (; j + 16 <= dim; j += 16) store16(o + j, load16(s + j) * inv * load16(w + j));
    for (; j < dim; ++j) o[j] = s[j] * inv * w[j];
  });
  return 0;
}

namespace {

template <class T>
void gather_rows(const T* src, int64_t r0, int64_t r1, int64_t ld, int64_t rows,
                 const int64_t* ids, int64_t n, T* out) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = src + r * ld;
    for (int64_t t = 0; t < n; ++t) out[t * rows + r] = row[ids[t]];
  }
}

}  // namespace

// out[t, r] = src[r, ids[t]] for r < rows, t < n: the embedding lookup of a [hidden, vocab]
// table (row stride ld, elements of elem_bytes = 2 or 4) into [n, hidden] rows. torch's
// index_select(1) copies it element by element on one thread, each element a cache miss (issue
// 44: ~1 ms of serial time a batch-64 step of SmolLM2-135M); here the threads share the table's
// rows. Bit copies: no floating-point mode applies. 2 when an id is outside [0, cols).
extern "C" int llmserve_gather_cols(const void* src, int64_t rows, int64_t cols, int64_t ld,
                                    int elem_bytes, const int64_t* ids, int64_t n, void* out,
                                    int num_threads) {
  if ((elem_bytes != 2 && elem_bytes != 4) || rows <= 0 || ld < cols || n < 0) return 1;
  for (int64_t t = 0; t < n; ++t)
    if (ids[t] < 0 || ids[t] >= cols) return 2;
  constexpr int64_t kBlock = 16;  // rows a share
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  const bool parallel = num_threads > 1 && blocks > 1 && n * rows >= kParallelMin;
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r0 = b * kBlock, r1 = r0 + kBlock < rows ? r0 + kBlock : rows;
    if (elem_bytes == 2)
      gather_rows((const uint16_t*)src, r0, r1, ld, rows, ids, n, (uint16_t*)out);
    else
      gather_rows((const uint32_t*)src, r0, r1, ld, rows, ids, n, (uint32_t*)out);
  }
  return 0;
}

// The calling thread's MXCSR, and setting it. Loading this library (built with -ffast-math)
// runs a constructor that turns flush-to-zero and denormals-are-zero on in the loading thread
// alone; library.py clears those two bits again right after loading, so torch's own ops keep
// IEEE denormals in every thread alike (the kernels set their own modes, simd.h). The tests set
// a thread's mode with these to check that no kernel result depends on it.
extern "C" unsigned llmserve_get_mxcsr() {
#if defined(__SSE__)
  return _mm_getcsr();
#else
  return 0;
#endif
}

extern "C" int llmserve_set_mxcsr(unsigned csr) {
#if defined(__SSE__)
  _mm_setcsr(csr);
#else
  (void)csr;
#endif
  return 0;
}
