// Step-invariant bf16 GEMM: y[M, N] = x[M, K] @ w[K, N] (+ bias[N]) with x and w in bf16, fp32
// accumulation, y in fp32 or rounded to bf16. Part of the CPU kernel library
// (executor_svc/kernels/library.py); called from executor_svc/kernels/gemm_bf16.py.
//
// The order, by construction: one fp32 register accumulator per output element, acc = 0, then
// for each pair of k (k = 2i, 2i + 1; i ascending): acc += x[2i+1] * w[2i+1], then
// acc += x[2i] * w[2i], each a single rounding; then bias, then the optional bf16 rounding (to
// nearest even). That is what AVX512-BF16's vdpbf16ps does per lane (odd element first, products
// of two bf16 exact in fp32, round to nearest even, denormals flushed). Tiles of several rows
// widen bf16 by a 16-bit shift and issue those two FMAs in that order under MXCSR flush-to-zero
// + denormals-are-zero, the same bits; on this project's AVX512-BF16 CPU an FMA pair is ~2x the
// multiply-adds per second of one vdpbf16ps. A single row (decode, memory-bound) takes
// vdpbf16ps where the variant has it, the widening FMAs elsewhere. Tests check every variant and
// both paths give the same bits (tests/unit/test_gemm_bf16.py). No K split, no partial sums;
// threads split panels and row blocks: a row computed alone and the same row in a 512-row
// prefill give the same bits (step invariance, config/numerics.py).
//
// Weights, packed once at load: [ceil(N / kNR)][K2s][kNR][2] (panels of kNR columns; for each
// pair of k, the kNR columns' two values side by side, the operand layout of vdpbf16ps; the last
// panel zero-padded). K must be even (the wrapper pads). K2s = K / 2 but in the amx variant,
// whose panels are 32 columns wide and whose K2s is padded to whole tiles (with bf16 -0).
//
// The amx variant (gemm_bf16_amx.h) runs every row count on AMX tiles instead: TDPBF16PS does
// not round as the chain above (measured), so its bits are its own, the same for a row whatever
// the step around it; its vdpbf16ps and FMA paths stay for tests and benchmarks.

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "simd.h"
#include "simd8.h"

#if defined(__SSE__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

using namespace llmserve;

namespace {

#if defined(__AMX_BF16__)
constexpr int kNR = 32;       // panel width: two B tiles of 16 columns
constexpr int kK2Align = 16;  // K / 2 padded to whole tiles (gemm_bf16_amx.h)
#else
constexpr int kNR = 48;  // panel width: 3 vectors of 16 fp32 accumulators (32 bf16 per load)
constexpr int kK2Align = 1;
#endif
constexpr int kVecs = kNR / 16;
constexpr int kMR = 8;      // rows per tile: 8 x 3 = 24 accumulators
#if defined(LLMSERVE_AVX2_PATHS)
constexpr int kGemvP = 2;   // AVX2: 2 panels x 6 ymm = 12 chains, within the 16 ymm registers
#else
constexpr int kGemvP = 4;   // panels in flight for one row (memory-bound decode)
#endif
constexpr int64_t kABytes = 256 * 1024;  // a row block of x kept in L2 across the panels
constexpr int64_t kFewRowsMax = 8;  // rows up to this: few_rows (vdpbf16ps builds)

#if defined(__AMX_BF16__)
constexpr const char* kPath = "amx";
#elif defined(__AVX512BF16__)
constexpr const char* kPath = "avx512bf16";
#elif defined(__AVX512F__)
constexpr const char* kPath = "avx512f";
#elif defined(__AVX2__)
constexpr const char* kPath = "avx2";
#else
constexpr const char* kPath = "generic";
#endif

typedef uint32_t u16x __attribute__((vector_size(64)));  // 16 bf16 pairs

// Pairs of k per panel row block in the packed weights.
inline int64_t pairs_stride(int64_t K2) { return (K2 + kK2Align - 1) / kK2Align * kK2Align; }

inline v16 splat(float s) { return v16{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

// acc + a * b with one rounding, as an explicit instruction where there is one (so contraction
// choices of the compiler cannot differ between tile shapes).
inline v16 fma_v(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  typedef float v8 __attribute__((vector_size(32)));
  const v8 lo = (v8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                                    (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                                    (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
  const v8 hi = (v8)_mm256_fmadd_ps(
      (__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
      (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
      (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return a * b + c;  // no FMA (below x86-64-v3): not a variant the library dispatches to
#endif
}

// The two halves of 16 packed pairs as fp32: element 2i + 1 (high 16 bits) and 2i (low).
inline void widen(const uint16_t* w, v16* hi, v16* lo) {
  u16x wv;
  std::memcpy(&wv, w, sizeof wv);
  const u16x h = wv & 0xFFFF0000u, l = wv << 16;
  std::memcpy(hi, &h, sizeof h);
  std::memcpy(lo, &l, sizeof l);
}

// MXCSR for the duration of a thread's share: simd.h's FlushMode (flush-to-zero +
// denormals-are-zero), which vdpbf16ps applies whatever MXCSR says: the widening variants then
// match it bit for bit.
using BfMode = FlushMode;

inline uint16_t to_bf16(float f) {  // round to nearest even (finite values)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

struct Out {
  float* f32;      // fp32 output, or null
  uint16_t* bf16;  // bf16 output, or null
  int64_t ld;

  Out row(int64_t m) const {  // the same output from row m on
    return Out{f32 ? f32 + m * ld : nullptr, bf16 ? bf16 + m * ld : nullptr, ld};
  }

  void put(int64_t r, int64_t c, float v) const {
    if (f32)
      f32[r * ld + c] = v;
    else
      bf16[r * ld + c] = to_bf16(v);
  }
};

// Bias, then the store (fp32, or rounded to bf16) of a tile's accumulators.
template <int R, int P>
inline void finish(const v16 (&acc)[R][P][kVecs], const float* bias, const Out& y, int64_t row0,
                   int64_t col0, int64_t ncols) {
  for (int r = 0; r < R; ++r) {
    float buf[P * kNR];
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < kVecs; ++j) store16(buf + p * kNR + 16 * j, acc[r][p][j]);
    for (int64_t c = 0; c < ncols; ++c) y.put(row0 + r, col0 + c, bias ? buf[c] + bias[c] : buf[c]);
  }
}

#if defined(LLMSERVE_AVX2_PATHS)
// AVX2 (16 ymm registers, no vdpbf16ps): v16 tiles spill and their shuffles go through memory,
// so tiles run as micro-tiles of R rows x P panels x CV ymm vectors (8 columns each, from column
// 8 * C0 of each panel) with R * P * CV <= 12 accumulators. A weight vector is 8 packed pairs,
// widened by a mask (element 2i + 1) and a shift (element 2i) and shared by the R rows. Each
// element keeps the module's chain (fma with element 2i + 1, then 2i; bias last): the bits of
// every other build.
template <int R, int P, int C0, int CV>
inline void micro(const float* xf, int64_t ldx, int64_t K2, const uint16_t* w, const float* bias,
                  const Out& y, int64_t row0, int64_t col0, int64_t ncols) {
  static_assert(R * P * CV <= 12, "accumulators must fit the 16 ymm registers");
  const int64_t pstride = pairs_stride(K2) * kNR * 2;
  const __m256i mask = _mm256_set1_epi32((int)0xFFFF0000u);
  __m256 acc[R][P][CV];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < CV; ++j) acc[r][p][j] = _mm256_setzero_ps();
  const uint16_t* w0 = w + 16 * C0;
  for (int64_t i = 0; i < K2; ++i) {
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < CV; ++j) {
        const __m256i wv =
            _mm256_loadu_si256((const __m256i*)(w0 + p * pstride + i * (kNR * 2) + 16 * j));
        const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(wv, mask));
        const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
#pragma GCC unroll 32
        for (int r = 0; r < R; ++r) {
          const float* xr = xf + r * ldx + 2 * i;
          acc[r][p][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), hi, acc[r][p][j]);
          acc[r][p][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), lo, acc[r][p][j]);
        }
      }
  }
  // Bias and store as `finish` does (unrolled, so acc stays in registers).
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < CV; ++j) {
        const int64_t c = p * kNR + 8 * (C0 + j);
        if (c >= ncols) continue;
        float buf[8];
        _mm256_storeu_ps(buf, acc[r][p][j]);
        const int64_t n = ncols - c < 8 ? ncols - c : 8;
        for (int64_t e = 0; e < n; ++e)
          y.put(row0 + r, col0 + c + e, bias ? buf[e] + bias[c + e] : buf[e]);
      }
}

// Rows [0, R) of one panel: two half panels (3 ymm) of up to 4 rows at a time.
template <int R>
inline void panel_rows(const float* xf, int64_t ldx, int64_t K2, const uint16_t* w,
                       const float* bias, const Out& y, int64_t row0, int64_t col0,
                       int64_t ncols) {
  if constexpr (R >= 4) {
    micro<4, 1, 0, 3>(xf, ldx, K2, w, bias, y, row0, col0, ncols);
    if (ncols > 24) micro<4, 1, 3, 3>(xf, ldx, K2, w, bias, y, row0, col0, ncols);
    panel_rows<R - 4>(xf + 4 * ldx, ldx, K2, w, bias, y, row0 + 4, col0, ncols);
  } else if constexpr (R == 2 || R == 1) {
    micro<R, 1, 0, 6>(xf, ldx, K2, w, bias, y, row0, col0, ncols);
  } else if constexpr (R == 3) {
    micro<3, 1, 0, 3>(xf, ldx, K2, w, bias, y, row0, col0, ncols);
    if (ncols > 24) micro<3, 1, 3, 3>(xf, ldx, K2, w, bias, y, row0, col0, ncols);
  }
}
#endif

// R rows x P consecutive panels of y, from row `row0` and column `col0`; ncols valid columns.
// xf: the rows widened to fp32. Weights widened by shift and mask, two FMAs per pair (the
// rows share each widened weight vector); this is the compute-bound shape (several rows), where
// FMAs outrun vdpbf16ps on the CPUs measured (docs/benchmarks.md).
// pf: the next panel's first pf_lines cache lines, prefetched into L2 one per pair step (as in
// gemm.cpp: a panel's row tiles each take a share, so it streams in while this one computes).
template <int R, int P>
void tile(const float* xf, int64_t ldx, int64_t K2, const uint16_t* w, const float* bias,
          const Out& y, int64_t row0, int64_t col0, int64_t ncols,
          const uint16_t* pf = nullptr, int64_t pf_lines = 0) {
#if defined(LLMSERVE_AVX2_PATHS)
  if constexpr (P == 1)
    panel_rows<R>(xf, ldx, K2, w, bias, y, row0, col0, ncols);
  else
    micro<R, P, 0, kVecs * 2>(xf, ldx, K2, w, bias, y, row0, col0, ncols);
  return;
#endif
  const int64_t pstride = pairs_stride(K2) * kNR * 2;  // uint16 per panel
  v16 acc[R][P][kVecs];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < kVecs; ++j) acc[r][p][j] = v16{};
  for (int64_t i = 0; i < K2; ++i) {
    if (i < pf_lines) __builtin_prefetch(pf + 32 * i, 0, 2);
    v16 hi[P][kVecs], lo[P][kVecs];
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < kVecs; ++j)
        widen(w + p * pstride + i * (kNR * 2) + 32 * j, &hi[p][j], &lo[p][j]);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const v16 xh = splat(xf[r * ldx + 2 * i + 1]), xl = splat(xf[r * ldx + 2 * i]);
#pragma GCC unroll 32
      for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
        for (int j = 0; j < kVecs; ++j)
          acc[r][p][j] = fma_v(xl, lo[p][j], fma_v(xh, hi[p][j], acc[r][p][j]));
    }
  }
  finish<R, P>(acc, bias, y, row0, col0, ncols);
}

#if defined(__AVX512BF16__)
// One row (a decode) with vdpbf16ps, one instruction per pair and 16 columns: the same chain as
// `tile` (module comment), from the bf16 row itself.
template <int P>
void tile_dp(const uint16_t* x, int64_t K2, const uint16_t* w, const float* bias, const Out& y,
             int64_t col0, int64_t ncols) {
  const int64_t pstride = pairs_stride(K2) * kNR * 2;
  v16 acc[1][P][kVecs];
#pragma GCC unroll 32
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
    for (int j = 0; j < kVecs; ++j) acc[0][p][j] = v16{};
  for (int64_t i = 0; i < K2; ++i) {
    uint32_t pair;
    std::memcpy(&pair, x + 2 * i, 4);
    const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < kVecs; ++j)
        acc[0][p][j] = (v16)_mm512_dpbf16_ps(
            (__m512)acc[0][p][j], a,
            (__m512bh)_mm512_loadu_si512(w + p * pstride + i * (kNR * 2) + 32 * j));
  }
  finish<1, P>(acc, bias, y, 0, col0, ncols);
}
#endif

using TileFn = void (*)(const float*, int64_t, int64_t, const uint16_t*, const float*,
                        const Out&, int64_t, int64_t, int64_t, const uint16_t*, int64_t);
constexpr TileFn kRowTiles[kMR + 1] = {nullptr,    tile<1, 1>, tile<2, 1>, tile<3, 1>, tile<4, 1>,
                                       tile<5, 1>, tile<6, 1>, tile<7, 1>, tile<kMR, 1>};

struct Gemm {
  const uint16_t* x;  // [M, ldx] bf16
  const float* xf;    // the same rows widened to fp32, [M, 2 * K2]
  int64_t M, K2, ldx;
  const uint16_t* w;
  int64_t N, P;
  const float* bias;
  Out y;

  int64_t cols(int64_t p) const { return p == P - 1 ? N - p * kNR : kNR; }
  const uint16_t* panel(int64_t p) const { return w + p * pairs_stride(K2) * kNR * 2; }

  void rows_of_panel(int64_t p, int64_t m0, int64_t m1) const {
    const uint16_t* wp = panel(p);
    const float* bp = bias ? bias + p * kNR : nullptr;
    // The next panel in equal shares over this panel's row tiles (kNR / 16 lines per pair).
    const uint16_t* pf = p + 1 < P ? panel(p + 1) : nullptr;
    const int64_t tiles = (m1 - m0 + kMR - 1) / kMR;
    const int64_t lines = pf ? pairs_stride(K2) * kNR / 16 : 0;
    const int64_t share = (lines + tiles - 1) / tiles;
    for (int64_t m = m0, t = 0; m < m1; m += kMR, ++t) {
      const int64_t r = m1 - m < kMR ? m1 - m : kMR;
      const int64_t first = t * share, n = lines - first < share ? lines - first : share;
      kRowTiles[r](xf + m * 2 * K2, 2 * K2, K2, wp, bp, y, m, p * kNR, cols(p),
                   n > 0 ? pf + 32 * first : nullptr, n > 0 ? (n < K2 ? n : K2) : 0);
    }
  }

  // One row: kGemvP panels per pass keep enough loads and independent chains in flight.
  void gemv(int64_t p0, int64_t p1) const {
    int64_t p = p0;
    for (; p + kGemvP <= p1; p += kGemvP) {
      const int64_t ncols = (p + kGemvP == P) ? N - p * kNR : kGemvP * kNR;
      const float* bp = bias ? bias + p * kNR : nullptr;
#if defined(__AVX512BF16__)
      tile_dp<kGemvP>(x, K2, panel(p), bp, y, p * kNR, ncols);
#else
      tile<1, kGemvP>(xf, 2 * K2, K2, panel(p), bp, y, 0, p * kNR, ncols);
#endif
    }
    for (; p < p1; ++p) rows_of_panel(p, 0, 1);
  }

#if defined(__AVX512BF16__)
  // A few rows (2..kFewRowsMax: a few decodes, or a decode with speculative proposals) are
  // still memory-bound: each row as in gemv (vdpbf16ps, kGemvP panels in flight), row after
  // row over the same panels, the first row streaming them from memory and the others finding
  // them in L2, instead of one panel at a time (measured, CPU time of SmolLM2's matrices, one
  // thread: 2 rows 28 -> 21 ms, 5 rows 34 -> 30, 8 rows 38 -> 37; 1 row 18-20). The same
  // chain per element as every tile (module comment).
  void few_rows(int64_t p0, int64_t p1) const {
    int64_t p = p0;
    for (; p + kGemvP <= p1; p += kGemvP) {
      const int64_t ncols = (p + kGemvP == P) ? N - p * kNR : kGemvP * kNR;
      const float* bp = bias ? bias + p * kNR : nullptr;
      for (int64_t m = 0; m < M; ++m)
        tile_dp<kGemvP>(x + m * ldx, K2, panel(p), bp, y.row(m), p * kNR, ncols);
    }
    for (; p < p1; ++p) rows_of_panel(p, 0, M);
  }
#endif
};

inline void share(int64_t total, int t, int nt, int64_t* begin, int64_t* end) {
  *begin = total * t / nt;
  *end = total * (t + 1) / nt;
}

#if defined(__AMX_BF16__)
#include "gemm_bf16_amx.h"
#endif

}  // namespace

// Panel width of the packed layout, and which instruction path this build runs.
extern "C" int llmserve_gemm_bf16_nr() { return kNR; }
extern "C" const char* llmserve_gemm_bf16_path() { return kPath; }
// The packed layout's K / 2 multiple (see top).
extern "C" int llmserve_gemm_bf16_k2_align() { return kK2Align; }

// Linux hands out AMX tile state only to a process that asked for it (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA; without it the first tile instruction faults). Asked once per
// process, which it is granted to. 0: granted (the tile path is on); -1: not an AMX build; else
// the errno of the refusal (load() then takes the avx512bf16 variant; this build alone would
// keep to its vdpbf16ps and FMA paths).
extern "C" int llmserve_amx_init() {
#if defined(__AMX_BF16__)
  constexpr long kGetPerm = 0x1022, kReqPerm = 0x1023;
  constexpr int kXtiledata = 18;
  static const int rc = [] {
    if (syscall(SYS_arch_prctl, kReqPerm, kXtiledata) != 0) return errno ? errno : 1;
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, kGetPerm, &granted) != 0) return errno ? errno : 1;
    if (!(granted & (1ul << kXtiledata))) return 1;
    g_amx_ready.store(true);
    return 0;
  }();
  return rc;
#else
  return -1;
#endif
}

// Tests and benchmarks: what = 0, the rows from which the amx variant takes the tiles; 1, its
// prefetch distance in tile steps; 2, its load order (gemm_bf16_amx.h). value < 0 leaves it.
// Returns the value before (-1: no AMX).
extern "C" int64_t llmserve_gemm_bf16_amx_set(int what, int64_t value) {
#if defined(__AMX_BF16__)
  std::atomic<int64_t>& knob = what == 0 ? g_amx_min_rows : what == 1 ? g_amx_prefetch
                                                                       : g_amx_interleave;
  return value < 0 ? knob.load() : knob.exchange(value);
#else
  (void)what, (void)value;
  return -1;
#endif
}

namespace {

// bf16 is fp32's high half: a bit copy, vectorised (a function of its own, so that the stores
// need not be assumed to alias the OpenMP region's shared variables).
void widen_row(const uint16_t* __restrict src, int64_t n, float* __restrict dst) {
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t bits = (uint32_t)src[k] << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    dst[k] = f;
  }
}

}  // namespace

// y = x [M, K] bf16 (row stride ldx) @ w (packed, see top) (+ bias [N] fp32 when not null); y
// fp32 [M, N] (y_f32) or bf16 (y_bf16; exactly one is given) with row stride ldy. Returns 0, or
// 1 for arguments it rejects (K odd, strides too small, no or two outputs).
extern "C" int llmserve_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t ldx,
                                  const uint16_t* w, int64_t N, const float* bias, float* y_f32,
                                  uint16_t* y_bf16, int64_t ldy, int num_threads) {
  if (M < 0 || K <= 0 || K % 2 || N <= 0 || ldx < K || ldx % 2 || ldy < N ||
      (y_f32 == nullptr) == (y_bf16 == nullptr))
    return 1;
  if (M == 0) return 0;
  if (num_threads < 1) num_threads = 1;
#if defined(__AMX_BF16__)
  if (g_amx_ready.load(std::memory_order_relaxed) &&
      M >= g_amx_min_rows.load(std::memory_order_relaxed)) {
    amx_gemm(x, M, K / 2, ldx, w, N, bias, Out{y_f32, y_bf16, ldy}, num_threads);
    return 0;
  }
#endif
  // The rows widened once (M x K floats, against M x K x N multiply-adds), by the threads that
  // then run the product (issue 44: in the calling thread alone, and zeroed first, this was
  // ~1 ms of serial time a batch-64 step of SmolLM2-135M; bit copies, no FP mode applies).
  std::unique_ptr<float[]> xf(new float[(size_t)M * K]);
  const Gemm g{x, xf.get(), M, K / 2, ldx, w, N, (N + kNR - 1) / kNR, bias,
               Out{y_f32, y_bf16, ldy}};
  int64_t mc = kABytes / (K * 2) / kMR * kMR;
  if (mc < kMR) mc = kMR;
  const int64_t blocks = (M + mc - 1) / mc;
  mc = ((M + blocks - 1) / blocks + kMR - 1) / kMR * kMR;
  const bool parallel = num_threads > 1 && M * K * N >= (1 << 17) && g.P * blocks > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    BfMode mode;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) widen_row(x + m * ldx, K, xf.get() + m * K);
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t i0, i1;
    if (M == 1) {
      share(g.P, t, nt, &i0, &i1);
      g.gemv(i0, i1);
#if defined(__AVX512BF16__)
    } else if (M <= kFewRowsMax && g.P >= 2 * nt) {
      share(g.P, t, nt, &i0, &i1);
      g.few_rows(i0, i1);
#endif
    } else if (g.P >= 2 * nt) {
      share(g.P, t, nt, &i0, &i1);
      for (int64_t m0 = 0; m0 < M; m0 += mc)
        for (int64_t p = i0; p < i1; ++p) g.rows_of_panel(p, m0, m0 + mc < M ? m0 + mc : M);
    } else {
      share(blocks * g.P, t, nt, &i0, &i1);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t m0 = i / g.P * mc;
        g.rows_of_panel(i % g.P, m0, m0 + mc < M ? m0 + mc : M);
      }
    }
  }
  return 0;
}
