// Issue rate of vdpbf16ps against an fp32 FMA on this CPU: 24 independent register chains of
// each, nothing read from memory (docs/benchmarks.md, "bf16 on the CPU"). Needs AVX512-BF16.
//
//   g++ -O2 -march=x86-64-v4 -mavx512bf16 benchmarks/peak_dpbf16.cpp -o /tmp/peak \
//     && taskset -c 1 /tmp/peak
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  __m512 acc[24];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1e-3f), b = _mm512_set1_ps(1e-3f);
  __m512bh ab = (__m512bh)_mm512_set1_epi32(0x3c003c00), bb = ab;
  const long n = 20000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < 24; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], ab, bb);
    __asm__ volatile("" : "+v"(ab));  // keeps the loop from being folded
  }
  const double s1 = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < 24; ++j) acc[j] = _mm512_fmadd_ps(a, b, acc[j]);
    __asm__ volatile("" : "+v"(a));
  }
  const double s2 = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sum = 0;
  for (auto& x : acc) sum += _mm512_reduce_add_ps(x);
  std::printf("vdpbf16ps: %.2f G/s (%.1f GMAC/s)   vfmadd ps: %.2f G/s (%.1f GMAC/s)   [%g]\n",
              n * 24 / s1 / 1e9, n * 24 * 32 / s1 / 1e9, n * 24 / s2 / 1e9,
              n * 24 * 16 / s2 / 1e9, sum);
}
