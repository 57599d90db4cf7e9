// Vector helpers shared by the CPU kernel library's sources (csrc/*.cpp): 16-float vectors that
// GCC lowers to AVX-512, AVX2 pairs or SSE quads, whatever -march allows.
#pragma once

#include <cstdint>

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace llmserve {

typedef float v16 __attribute__((vector_size(64)));

// MXCSR set to kCsr for the duration of a kernel call or a thread's share of it (fast-math may
// have changed it in the loading thread only; OpenMP workers differ), restored after.
template <unsigned kCsr>
struct CsrScope {
#if defined(__SSE__)
  unsigned saved = _mm_getcsr();
  CsrScope() { _mm_setcsr(kCsr); }
  ~CsrScope() { _mm_setcsr(saved); }
#endif
};
// Round to nearest, all exceptions masked, no FTZ / DAZ: denormal handling does not depend on
// which thread computes what.
using IeeeMode = CsrScope<0x1F80>;
// The other kernels (attention, norms, SiLU, sampling, LoRA, the shared-memory sum; the bf16
// GEMM for its own reason, gemm_bf16.cpp): round to nearest, exceptions masked, flush-to-zero +
// denormals-are-zero, set by each thread for its share. Left to the calling thread, the mode
// was whatever that thread had: loading this library (built with -ffast-math) turns FTZ/DAZ on
// in the loading thread only, so a step run by a gRPC thread started earlier took denormal
// assists in attention's weighted sums (25 % slower prefill steps, docs/benchmarks.md) and
// could round differently from the same step run offline. This is the mode those kernels had
// when called from the loading thread.
using FlushMode = CsrScope<0x9FC0>;

// MXCSR set to a value read at run time for the duration of a thread's share, restored after:
// an OpenMP worker taking the calling thread's mode (decoder_bf16.cpp's glue, which must round
// as the torch ops it replaces do in that thread).
struct CsrAs {
#if defined(__SSE__)
  unsigned saved = _mm_getcsr();
  explicit CsrAs(unsigned csr) { _mm_setcsr(csr); }
  ~CsrAs() { _mm_setcsr(saved); }
#else
  explicit CsrAs(unsigned) {}
#endif
};

inline unsigned current_csr() {
#if defined(__SSE__)
  return _mm_getcsr();
#else
  return 0;
#endif
}

// The least work (elements of a row-wise pass: norms, SiLU, the K/V write, the decoder's glue)
// worth sharing out: a fork and join of a warm OpenMP pool costs a few microseconds, ~8k
// elements of such a pass. Below it the calling thread does the pass alone, and that is serial
// time on a many-core host (issue 44: a batch-64 decode step's norms and K/V writes were).
constexpr int64_t kParallelMin = int64_t(1) << 13;

// body(i) for i in [0, n), shared out over num_threads OpenMP threads when `parallel` (the
// static schedule of `omp parallel for`), each thread in FlushMode for its share.
template <class Body>
inline void flush_for(int64_t n, int num_threads, bool parallel, Body&& body) {
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    FlushMode mode;
#pragma omp for
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}
typedef int32_t i16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }

// c + a * b in one rounding per lane (the GEMMs' chains: the same in every tile and build).
inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  typedef float v8 __attribute__((vector_size(32)));
  const v8 lo = (v8)_mm256_fmadd_ps(
      (__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
      (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
      (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
  const v8 hi = (v8)_mm256_fmadd_ps(
      (__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
      (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
      (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return a * b + c;  // no FMA instruction: a product and a sum, the same in every tile
#endif
}

inline float hsum(v16 v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  v8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  a += b;
  v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3);
  v4 d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// The lane sums of 16 vectors as one vector (lane u = sum of a[u]): four rounds of two-source
// shuffles and adds, ~3 operations per key where a horizontal sum each would take ~8.
inline v16 reduce16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: a[2i] partials, 8-15: a[2i + 1]
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // lanes 4k..4k+3: key 4i + k
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // lanes 2k, 2k+1: key 8i + k
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// exp of 16 floats: 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2, e^r by its
// degree-6 Taylor polynomial (relative error < 2e-7). Inputs below -87 give ~1e-38, not 0 (the
// scores here are s - max <= 0, and a weight of 1e-38 is 0 to every sum it enters).
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

}  // namespace llmserve
