// Step-invariant fp32 GEMM: y[M, N] = x[M, K] @ w[K, N] (+ bias[N]) where every output element
// is computed in one fixed order, whatever M, the other rows, the tile a row lands in, or the
// thread count. Part of the CPU kernel library (executor_svc/kernels/library.py builds
// csrc/*.cpp into one); called from executor_svc/kernels/gemm.py.
//
// The order, by construction: y[m, n] = bias[n] + acc with acc = 0, then acc = fma(x[m, k],
// w[k, n], acc) for k = 0, 1, ..., K - 1, one register accumulator per element, no K split, no
// partial sums. Every tile shape (rows 1..kMR, 1 or several panels) runs the same chain per
// element, so a row computed alone (a decode) and the same row inside a 512-row prefill give the
// same bits. Threads split panels and row blocks, never K. The FMA is an explicit intrinsic, so
// the compiler's contraction choices cannot differ between tile shapes, and each thread pins
// MXCSR to IEEE (no flush-to-zero) for the call, so denormal handling does not depend on which
// thread computes which panel.
//
// Weights: "packed" is the layout this file reads fastest, [ceil(N / kNR)][K][kNR] (panels of
// kNR columns, each contiguous, the last zero-padded); "plain" is [K, N] with a row stride (the
// tensor-parallel shards and anything not packed at load). Both give the same bits.

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

#if defined(__SSE__)
#include <immintrin.h>
#endif

using namespace llmserve;

namespace {

constexpr int kNR = 48;  // panel width: 3 vectors; 576, 960, 1536, 3072, 49152 are multiples
constexpr int kVecs = kNR / 16;
constexpr int kMR = 8;      // rows per tile: 8 x 3 = 24 accumulators of the 32 zmm registers
#if defined(__AVX512F__) || !defined(__FMA__)
constexpr int kGemvP = 4;   // panels in flight for one row: 12 independent chains hide latency
#else
constexpr int kGemvP = 2;   // AVX2: 2 panels x 6 ymm = 12 chains, within the 16 ymm registers
#endif
constexpr int64_t kABytes = 256 * 1024;  // a row block of x kept in L2 across the panels
// Up to this many rows, few_rows (measured one thread, SmolLM2's matrices: faster up to 24 rows,
// level at 32, slower at 48); it walks K in chunks of kChunk rows of 4 panels (37 KB, L1).
constexpr int64_t kFewRowsMax = 24;
constexpr int64_t kChunk = 48;

inline v16 splat16(float s) { return v16{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

// Where panel p's element (k, j) lives: panel(p)[k * ldb + j].
struct Panels {
  const float* base;
  int64_t stride;  // from panel p to p + 1
  int64_t ldb;     // from row k to k + 1 inside a panel
  const float* tail;  // plain weights: the last, partial panel copied and zero-padded; or null
  int64_t num;        // panels
  int64_t n;          // valid columns

  const float* at(int64_t p) const { return tail && p == num - 1 ? tail : base + p * stride; }
  int64_t ld(int64_t p) const { return tail && p == num - 1 ? kNR : ldb; }
  int64_t cols(int64_t p) const { return p == num - 1 ? n - p * kNR : kNR; }
};

#if !defined(__AVX512F__) && defined(__FMA__)
// AVX2 (16 ymm registers): a v16 tile would be twice its registers and spill on every k, so
// tiles run as micro-tiles of R rows x P panels x CV ymm vectors (columns C0 * 8 ..
// (C0 + CV) * 8 - 1 of each panel) with R * P * CV <= 12 accumulators. Each element still gets
// the one chain acc = fma(x[m, k], w[k, n], acc), k = 0..K-1, then bias + acc: the same bits as
// the AVX-512 build, lane by lane (an FMA rounds once whatever its vector width).
template <int R, int P, int C0, int CV>
inline void micro(const float* x, int64_t ldx, int64_t K, const float* b, int64_t stride,
                  int64_t ldb, const float* bias, float* y, int64_t ldy, int64_t ncols,
                  const float* pf = nullptr, int64_t pf_lines = 0) {
  static_assert(R * P * CV <= 12, "accumulators must fit the 16 ymm registers");
  __m256 acc[R][P][CV];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < CV; ++j) acc[r][p][j] = _mm256_setzero_ps();
  const float* b0 = b + 8 * C0;
  for (int64_t k = 0; k < K; ++k) {
    if (k < pf_lines) _mm_prefetch((const char*)(pf + 16 * k), _MM_HINT_T1);  // tile's pf
    __m256 bv[P][CV];
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < CV; ++j) bv[p][j] = _mm256_loadu_ps(b0 + p * stride + k * ldb + 8 * j);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 32
      for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
        for (int j = 0; j < CV; ++j) acc[r][p][j] = _mm256_fmadd_ps(a, bv[p][j], acc[r][p][j]);
    }
  }
  // The bias comes last, after the whole chain: bias + (sum over k), one rounding.
  // (Unrolled, so that acc stays in registers: an indexed loop here would keep it in memory.)
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < CV; ++j) {
        const int64_t c = p * kNR + 8 * (C0 + j);
        __m256 v = acc[r][p][j];
        if (c + 8 <= ncols) {
          if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));
          _mm256_storeu_ps(yr + c, v);
        } else if (c < ncols) {
          float buf[8];
          _mm256_storeu_ps(buf, v);
          for (int64_t i = 0; i < ncols - c; ++i) yr[c + i] = bias ? buf[i] + bias[c + i] : buf[i];
        }
      }
  }
}

// Rows [0, R) of one panel: two half panels (3 ymm) of up to 4 rows at a time.
// The prefetch of tile's pf goes with the first micro-tile.
template <int R>
inline void panel_rows(const float* x, int64_t ldx, int64_t K, const float* b, int64_t ldb,
                       const float* bias, float* y, int64_t ldy, int64_t ncols,
                       const float* pf = nullptr, int64_t pf_lines = 0) {
  if constexpr (R >= 4) {
    micro<4, 1, 0, 3>(x, ldx, K, b, 0, ldb, bias, y, ldy, ncols, pf, pf_lines);
    if (ncols > 24) micro<4, 1, 3, 3>(x, ldx, K, b, 0, ldb, bias, y, ldy, ncols);
    panel_rows<R - 4>(x + 4 * ldx, ldx, K, b, ldb, bias, y + 4 * ldy, ldy, ncols);
  } else if constexpr (R == 2 || R == 1) {
    micro<R, 1, 0, 6>(x, ldx, K, b, 0, ldb, bias, y, ldy, ncols, pf, pf_lines);
  } else if constexpr (R == 3) {
    micro<3, 1, 0, 3>(x, ldx, K, b, 0, ldb, bias, y, ldy, ncols, pf, pf_lines);
    if (ncols > 24) micro<3, 1, 3, 3>(x, ldx, K, b, 0, ldb, bias, y, ldy, ncols);
  }
}
#endif

// R rows x P panels (consecutive, sharing ld and stride) of y; ncols valid columns from col 0.
// pf: the next panel's first pf_lines cache lines, prefetched into L2 one per k step (a
// panel's row tiles each take a share, so the next panel streams in from DRAM while this one is
// computed instead of stalling its first tile).
template <int R, int P>
inline void tile(const float* x, int64_t ldx, int64_t K, const float* b, int64_t stride,
                 int64_t ldb, const float* bias, float* y, int64_t ldy, int64_t ncols,
                 const float* pf = nullptr, int64_t pf_lines = 0) {
#if !defined(__AVX512F__) && defined(__FMA__)
  if constexpr (P == 1) {
    panel_rows<R>(x, ldx, K, b, ldb, bias, y, ldy, ncols, pf, pf_lines);
  } else {
    micro<R, P, 0, kVecs * 2>(x, ldx, K, b, stride, ldb, bias, y, ldy, ncols);
  }
  return;
#endif
  v16 acc[R][P][kVecs];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < kVecs; ++j) acc[r][p][j] = v16{};
  for (int64_t k = 0; k < K; ++k) {
#if defined(__SSE__)
    if (k < pf_lines) _mm_prefetch((const char*)(pf + 16 * k), _MM_HINT_T1);
#endif
    v16 bv[P][kVecs];
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < kVecs; ++j) bv[p][j] = load16(b + p * stride + k * ldb + 16 * j);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const v16 a = splat16(x[r * ldx + k]);
#pragma GCC unroll 32
      for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
        for (int j = 0; j < kVecs; ++j) acc[r][p][j] = fma16(a, bv[p][j], acc[r][p][j]);
    }
  }
  // The bias comes last, after the whole chain: bias + (sum over k), one rounding.
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    if (ncols == P * kNR) {
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < kVecs; ++j) {
          v16 v = acc[r][p][j];
          if (bias) v += load16(bias + p * kNR + 16 * j);
          store16(yr + p * kNR + 16 * j, v);
        }
    } else {
      float buf[P * kNR];
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < kVecs; ++j) store16(buf + p * kNR + 16 * j, acc[r][p][j]);
      for (int64_t c = 0; c < ncols; ++c) yr[c] = bias ? buf[c] + bias[c] : buf[c];
    }
  }
}

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t,
                        const float*, float*, int64_t, int64_t, const float*, int64_t);
// Row-tile kernels by row count, for the remainder tile of a row block.
constexpr TileFn kRowTiles[kMR + 1] = {nullptr,       tile<1, 1>, tile<2, 1>, tile<3, 1>,
                                       tile<4, 1>,    tile<5, 1>, tile<6, 1>, tile<7, 1>,
                                       tile<kMR, 1>};

// Rows [m0, m1) of one panel, in tiles of kMR rows and one smaller tile at the end.
void rows_of_panel(const float* x, int64_t ldx, int64_t K, const Panels& w, int64_t p,
                   const float* bias, float* y, int64_t ldy, int64_t m0, int64_t m1) {
  const float* b = w.at(p);
  const int64_t ldb = w.ld(p), col = p * kNR, ncols = w.cols(p);
  const float* bp = bias ? bias + col : nullptr;
  // The next panel (when it is whole and packed: a plain matrix's rows are not one run), in
  // equal shares over this panel's row tiles.
  const bool next = p + 1 < w.num && !w.tail && w.ldb == kNR;
  const float* pf = next ? w.base + (p + 1) * w.stride : nullptr;
  const int64_t tiles = (m1 - m0 + kMR - 1) / kMR;
  const int64_t lines = next ? K * kNR / 16 : 0, share = (lines + tiles - 1) / tiles;
  for (int64_t m = m0, t = 0; m < m1; m += kMR, ++t) {
    const int64_t r = m1 - m < kMR ? m1 - m : kMR;
    const int64_t first = t * share, n = lines - first < share ? lines - first : share;
    kRowTiles[r](x + m * ldx, ldx, K, b, 0, ldb, bp, y + m * ldy + col, ldy, ncols,
                 n > 0 ? pf + 16 * first : nullptr, n > 0 ? (n < K ? n : K) : 0);
  }
}

// One row (a decode step): memory-bound, so kGemvP panels per pass keep enough loads and
// independent FMA chains in flight; panels [p0, p1).
void gemv(const float* x, int64_t K, const Panels& w, const float* bias, float* y, int64_t p0,
          int64_t p1) {
  const int64_t full = w.tail ? w.num - 1 : w.num;  // panels readable at base + p * stride
  int64_t p = p0;
  for (; p + kGemvP <= p1 && p + kGemvP <= full; p += kGemvP) {
    const int64_t ncols = (p + kGemvP == w.num) ? w.n - p * kNR : kGemvP * kNR;
    tile<1, kGemvP>(x, 0, K, w.base + p * w.stride, w.stride, w.ldb,
                    bias ? bias + p * kNR : nullptr, y + p * kNR, 0, ncols);
  }
  for (; p < p1; ++p) rows_of_panel(x, 0, K, w, p, bias, y, 0, 0, 1);
}

// R rows x P panels over k in [k0, k1) only, for few_rows: the accumulators start at 0 (first
// chunk) or at the partial sums left in `part` ([R][P * kNR]) by the chunk before, and go back
// there. An fp32 store and load are exact, so each element still runs tile's chain.
template <int R, int P>
inline void tile_k(const float* x, int64_t ldx, int64_t k0, int64_t k1, const float* b,
                   int64_t stride, int64_t ldb, float* part, bool first) {
  v16 acc[R][P][kVecs];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < kVecs; ++j)
        acc[r][p][j] = first ? v16{} : load16(part + r * P * kNR + p * kNR + 16 * j);
  for (int64_t k = k0; k < k1; ++k) {
    v16 bv[P][kVecs];
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < kVecs; ++j) bv[p][j] = load16(b + p * stride + k * ldb + 16 * j);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const v16 a = splat16(x[r * ldx + k]);
#pragma GCC unroll 32
      for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
        for (int j = 0; j < kVecs; ++j) acc[r][p][j] = fma16(a, bv[p][j], acc[r][p][j]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 32
      for (int j = 0; j < kVecs; ++j) store16(part + r * P * kNR + p * kNR + 16 * j, acc[r][p][j]);
}

// A few rows (2..kFewRowsMax: a batch of a few decodes, or one decode with speculative
// proposals) are still memory-bound: like gemv, keep PP panels in flight (more DRAM streams at
// once), and walk K in chunks of kChunk: all the row pairs run over a chunk of the PP panels
// (the first pair brings it from memory, the others find it in L1) before the next chunk, their
// partial sums kept between chunks (AVX2: one panel at a time, as before; its 16 ymm registers
// hold no more). Panels [p0, p1); the same chain per element as every other tile shape.
// Measured (CPU time, one thread, SmolLM2's 30 layers of matrices; 1 row 29 ms): 2 rows 36 ->
// 30, 5 rows 45 -> 36, 8 rows 50 -> 40, 16 rows 65 -> 55 (before -> after).
void few_rows(const float* x, int64_t ldx, int64_t K, const Panels& w, const float* bias,
              float* y, int64_t ldy, int64_t M, int64_t p0, int64_t p1) {
#if defined(__AVX512F__) || !defined(__FMA__)
  constexpr int PP = 4;
#else
  constexpr int PP = 1;
#endif
  const int64_t full = w.tail ? w.num - 1 : w.num;
  int64_t p = p0;
  if constexpr (PP > 1) {
    float part[kFewRowsMax][PP * kNR];
    for (; p + PP <= p1 && p + PP <= full; p += PP) {
      const int64_t ncols = (p + PP == w.num) ? w.n - p * kNR : PP * kNR;
      const float* b = w.base + p * w.stride;
      if (M == 2) {  // one row pair: nothing to share a chunk with (measured: direct is faster)
        const float* bp = bias ? bias + p * kNR : nullptr;
        tile<2, PP>(x, ldx, K, b, w.stride, w.ldb, bp, y + p * kNR, ldy, ncols);
        continue;
      }
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t k1 = K - k0 < kChunk ? K : k0 + kChunk;
        int64_t r = 0;
        for (; r + 2 <= M; r += 2)
          tile_k<2, PP>(x + r * ldx, ldx, k0, k1, b, w.stride, w.ldb, part[r], k0 == 0);
        if (r < M) tile_k<1, PP>(x + r * ldx, ldx, k0, k1, b, w.stride, w.ldb, part[r], k0 == 0);
      }
      // The bias after the whole chain, as in tile.
      for (int64_t r = 0; r < M; ++r) {
        float* yr = y + r * ldy + p * kNR;
        const float* bp = bias ? bias + p * kNR : nullptr;
        for (int64_t c = 0; c < ncols; ++c) yr[c] = bp ? part[r][c] + bp[c] : part[r][c];
      }
    }
  }
  for (; p < p1; ++p) rows_of_panel(x, ldx, K, w, p, bias, y, ldy, 0, M);
}

// [begin, end) of `total` items for thread t of nt, contiguous, sizes differing by at most 1.
inline void share(int64_t total, int t, int nt, int64_t* begin, int64_t* end) {
  *begin = total * t / nt;
  *end = total * (t + 1) / nt;
}

int run(const float* x, int64_t M, int64_t K, int64_t ldx, const Panels& w, const float* bias,
        float* y, int64_t ldy, int num_threads) {
  const int64_t P = w.num;
  // Row blocks of equal size (a multiple of kMR) whose x rows fit kABytes: the block stays in
  // L2 while the panels stream past it, each panel read once per block.
  int64_t mc = kABytes / (K * (int64_t)sizeof(float)) / kMR * kMR;
  if (mc < kMR) mc = kMR;
  const int64_t blocks = (M + mc - 1) / mc;
  mc = ((M + blocks - 1) / blocks + kMR - 1) / kMR * kMR;
  // Threads only where there is enough work to pay for waking them (a few microseconds).
  const bool parallel = num_threads > 1 && M * K * w.n >= (1 << 17) && P * blocks > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    IeeeMode ieee;
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t i0, i1;
    if (M == 1) {
      share(P, t, nt, &i0, &i1);
      gemv(x, K, w, bias, y, i0, i1);
    } else if (M <= kFewRowsMax && P >= 2 * nt) {
      share(P, t, nt, &i0, &i1);
      few_rows(x, ldx, K, w, bias, y, ldy, M, i0, i1);
    } else if (P >= 2 * nt) {
      // Each thread its share of the panels in every block: equal work, same x block.
      share(P, t, nt, &i0, &i1);
      for (int64_t m0 = 0; m0 < M; m0 += mc)
        for (int64_t p = i0; p < i1; ++p)
          rows_of_panel(x, ldx, K, w, p, bias, y, ldy, m0, m0 + mc < M ? m0 + mc : M);
    } else {
      // Few panels: split (block, panel) pairs instead.
      share(blocks * P, t, nt, &i0, &i1);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t m0 = i / P * mc;
        rows_of_panel(x, ldx, K, w, i % P, bias, y, ldy, m0, m0 + mc < M ? m0 + mc : M);
      }
    }
  }
  return 0;
}

}  // namespace

// Panel width of the packed layout (the Python side pads N up to a multiple of it).
extern "C" int llmserve_gemm_nr() { return kNR; }

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w (+ bias [N] when not null).
// ldw = 0: w is packed, [ceil(N / kNR)][K][kNR]; ldw >= N: w is plain [K, N] with row stride
// ldw. Returns 0, or 1 for arguments it rejects.
extern "C" int llmserve_gemm_f32(const float* x, int64_t M, int64_t K, int64_t ldx,
                                 const float* w, int64_t N, int64_t ldw, const float* bias,
                                 float* y, int64_t ldy, int num_threads) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K || ldy < N || (ldw != 0 && ldw < N)) return 1;
  if (M == 0) return 0;
  Panels panels{w, ldw ? kNR : K * kNR, ldw ? ldw : kNR, nullptr, (N + kNR - 1) / kNR, N};
  std::vector<float> tail;
  if (ldw && N % kNR) {
    // The plain matrix's last panel would be read past its rows' ends: copy it, zero-padded.
    const int64_t c0 = (panels.num - 1) * kNR;
    tail.assign(K * kNR, 0.0f);
    for (int64_t k = 0; k < K; ++k) std::memcpy(&tail[k * kNR], w + k * ldw + c0, (N - c0) * 4);
    panels.tail = tail.data();
  }
  return run(x, M, K, ldx, panels, bias, y, ldy, num_threads < 1 ? 1 : num_threads);
}
