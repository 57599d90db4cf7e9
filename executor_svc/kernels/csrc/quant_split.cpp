// Weight-only quantized matmul for the 32-weight block types (Q8_0, Q4_0, Q4_1) in the split
// layout: y[M, N] = x[M, K] @ W^T (+ bias[N]), fp32 activations and accumulation. Part of the
// CPU kernel library (kernels/library.py); called from kernels/quant.py.
//
// The split layout (made at load by llmserve_quant_relayout, same bytes per row as the GGUF
// blocks): a row's G = K / 32 groups of quants first (Q8_0: 32 int8 each; Q4_x: 16 bytes each,
// byte i holding weight i in its low nibble and weight i + 16 in its high one, as in GGUF), then
// its G fp16 scales d, then (Q4_1) its G fp16 minimums m. So the hot loop reads quants alone, and
// a row's scales become fp32 with a few vector conversions instead of one scalar each.
//
// One output element, always in this order:
//   acc (16 lanes) = 0
//   for each group g ascending (x0, x1: x's weights 0-15 and 16-31 of the group):
//     Q8_0:        acc = fma(d_g, fma(q1, x1, q0 * x0), acc)       (q: the int8 quants)
//     Q4_0, Q4_1:  acc = fma(w1, x1, fma(w0, x0, acc))   (w: the de-quantized weights, d * q + m
//                  in one rounding or d * (q - 8) exact: the GGUF reference's values)
//   y = hsum(acc) (a fixed tree) + bias (0 without one)
// The Q4 weights come from a table of the group's 16 values (AVX-512: one fma builds it, a
// vpermps per 16 weights reads it) or a decode and an fma (AVX2): the same bits either way. So
// a Q4 group costs one table per weight row and two fmas per (x row, weight row) pair: a few-row
// call (a speculative verification, a small batch) pays little more than the decode for each
// extra row.
// Nothing in that chain depends on M, the tile a row lands in, how many weight rows share a pass,
// or the threads (they split weight rows), so a decode row and the same row inside a prefill give
// the same bits (step invariance, config/numerics.py), in every build: the fmas are explicit, and
// the quants are exact whether a build converts them (AVX2) or looks them up (AVX-512's vpermps).
//
// One x row (a decode, or one row left after the last whole tile): kOut weight rows per pass, so
// each x load serves kOut rows and kOut chains are in flight (a chain has one dependent fma per
// group, two for Q4); the pass kAheadBlocks ahead is prefetched. 2..kFew rows: one pass of a
// tile that many x rows tall and about kChains accumulators wide. More rows: register tiles of
// kRows x rows by kCols weight rows (AVX-512: 4 x 4; AVX2: 4 x 1), x kept in L2 (kXBytes): a
// group is decoded once per kRows rows, an x group loaded once per kCols weight rows. Tiles
// prefetch their next weight rows too. Measured: docs/benchmarks.md, issue 29 second, fourth
// and fifth passes.

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "quant_common.h"
#include "quant_vec.h"

using namespace llmserve;
using namespace llmserve::quant;

extern "C" int llmserve_quant_dequant_f32(int type, const uint8_t* w, int64_t N, int64_t K,
                                          int64_t row_bytes, const int64_t* rows, int64_t num,
                                          float* out, int64_t ldo);
extern "C" int llmserve_quant_gemm_act8_f32(int type, const float* x, int64_t M, int64_t K,
                                            int64_t ldx, const uint8_t* w, int64_t N,
                                            int64_t row_bytes, const float* bias, float* y,
                                            int64_t ldy, int num_threads);

namespace {

constexpr int64_t kXBytes = 256 * 1024;  // rows of x kept in L2 while the weights pass
constexpr int64_t kAheadBlocks = 2;      // a decode prefetches this many passes ahead
constexpr int64_t kChunkG = 256;         // groups whose scales a decode pass converts at once
constexpr int64_t kLd = kChunkG + 16;    // floats per weight row in a decode pass's scales
#if defined(__AVX512F__)
constexpr int kOut = 16;  // weight rows per pass over one x row
constexpr int kRows = 4;  // x rows per register tile (many rows)
constexpr int kCols = 4;  // weight rows per register tile: kRows * kCols accumulators
constexpr int kFew = 8;   // at most this many rows go through one pass
#else
constexpr int kOut = 4;  // 16 ymm: 4 accumulators of two, x, the decoded group (6 and 8 slower)
constexpr int kRows = 4;
constexpr int kCols = 1;
constexpr int kFew = 4;
#endif

inline void prefetch(const char* p) {
#if defined(__SSE__)
  _mm_prefetch(p, _MM_HINT_T0);
#else
  __builtin_prefetch(p);
#endif
}

// Per type: quant bytes per group, whether there is a minimum, and how a group enters the chain
// (quant_vec.h, per instruction set): `group` gives Q8_0's quants (a0: weights 0-15, a1: 16-31),
// scaled by d in `step`, or the Q4 types' exactly de-quantized weights.
struct SQ8_0 {
  static constexpr int kType = kQ8_0, kQBytes = 32, kBlockBytes = 34;
  static constexpr bool kMin = false, kDequant = false;
  static void group(const uint8_t* q, float, float, vf& a0, vf& a1) { decode_q8(q, a0, a1); }
};

template <int kType_, int kBlockBytes_, bool kMin_, int kOffset>
struct SQ4 {
  static constexpr int kType = kType_, kQBytes = 16, kBlockBytes = kBlockBytes_;
  static constexpr bool kMin = kMin_, kDequant = true;
  static void group(const uint8_t* q, float d, float m, vf& a0, vf& a1) {
    dequant_q4<kOffset, kMin_>(q, d, m, a0, a1);
  }
};
using SQ4_0 = SQ4<kQ4_0, 18, false, -8>;
using SQ4_1 = SQ4<kQ4_1, 20, true, 0>;

// One group's step of one output element's chain: acc, the group's vectors from D::group and
// the group's x halves x0, x1.
//   Q8_0:    acc = fma(d, fma(q1, x1, q0 * x0), acc)
//   Q4_0/1:  acc = fma(w1, x1, fma(w0, x0, acc))   (w = the de-quantized weights)
template <class D>
inline vf step(vf acc, vf a0, vf a1, float d, vf x0, vf x1) {
  if constexpr (D::kDequant)
    return vfma(a1, x1, vfma(a0, x0, acc));
  else
    return vfma(vsplat(d), vfma(a1, x1, vmul(a0, x0)), acc);
}

// n fp16 values at p as fp32 into out (exact, the same bits whichever instruction converts).
inline void halves(const uint8_t* p, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 2 * i))));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if (i < n) {
    const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p + 2 * i)));
    return;
  }
#endif
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 2 * i))));
#endif
  for (; i < n; ++i) out[i] = half(p + 2 * i);
}

// A weight row's scales as fp32 into sb (G floats), and (Q4_1) its minimums into mb.
template <class D>
inline void row_scales(const uint8_t* row, int64_t G, float* sb, float* mb) {
  halves(row + G * D::kQBytes, G, sb);
  if (D::kMin) halves(row + G * (D::kQBytes + 2), G, mb);
}

// One x row against R consecutive weight rows: y[r] for r < R. sb, mb: R * kLd floats each, a
// row's scales and minimums of a chunk of groups at a fixed offset, so one pointer reaches all
// rows.
template <class D, int R>
inline void gemv(const float* x, int64_t G, const uint8_t* w, int64_t row_bytes,
                 const float* bias, float* y, float* sb, float* mb) {
  const uint8_t* d = w + G * D::kQBytes;  // row 0's scales, then (Q4_1) its minimums
  vf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vzero();
  // The pass kAheadBlocks ahead, a share per group: the weights stream from DRAM once per
  // step, and the hardware prefetcher alone left the loop waiting on them.
  constexpr int64_t kShare = R * D::kBlockBytes;
  const char* ahead = (const char*)w + kAheadBlocks * R * row_bytes;
  for (int64_t g0 = 0; g0 < G; g0 += kChunkG) {
    const int64_t g1 = g0 + kChunkG < G ? g0 + kChunkG : G;
    for (int r = 0; r < R; ++r) {
      halves(d + r * row_bytes + 2 * g0, g1 - g0, sb + r * kLd);
      if (D::kMin) halves(d + r * row_bytes + 2 * (G + g0), g1 - g0, mb + r * kLd);
    }
    for (int64_t g = g0; g < g1; ++g) {
#pragma GCC unroll 8
      for (int64_t j = 0; j < kShare; j += 64) prefetch(ahead + g * kShare + j);
      const vf x0 = vload(x + 32 * g), x1 = vload(x + 32 * g + 16);
      const float* s = sb + (g - g0);
      const float* mn = mb + (g - g0);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        vf a0, a1;
        D::group(w + r * row_bytes + g * D::kQBytes, s[r * kLd], D::kMin ? mn[r * kLd] : 0.0f,
                 a0, a1);
        acc[r] = step<D>(acc[r], a0, a1, s[r * kLd], x0, x1);
      }
    }
  }
#if !defined(LLMSERVE_QUANT_VEC_AVX2)
  if constexpr (R == 16) {  // the 16 sums in one vector, each the same tree as hsum
    v16 a[16];
    for (int r = 0; r < 16; ++r) a[r] = acc[r].v;
    const v16 sums = reduce16(a);
    store16(y, bias ? sums + load16(bias) : sums + 0.0f);
    return;
  }
#endif
  for (int r = 0; r < R; ++r) y[r] = vsum(acc[r]) + (bias ? bias[r] : 0.0f);
}

// XR x rows (row stride ldx) against C consecutive weight rows (their scales in sb and
// minimums in mb, C rows of ldsb floats each): y[r * ldy + c]. Each (x row, weight row) pair
// runs gemv's chain; a register tile of XR x C accumulators lets every group decoded serve XR
// x rows and every x load C weight rows.
template <class D, int XR, int C>
inline void tile(const float* x, int64_t ldx, int64_t G, const uint8_t* w, int64_t row_bytes,
                 const float* sb, const float* mb, int64_t ldsb, const float* bias, float* y,
                 int64_t ldy) {
  vf acc[XR][C];
  for (int r = 0; r < XR; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  // The tile kAheadBlocks ahead (the next weight rows), a share per group, as in gemv: a
  // tile's rows are short streams the hardware prefetcher does not pick up in time.
  constexpr int64_t kShare = C * D::kBlockBytes;
  const char* ahead = (const char*)w + kAheadBlocks * C * row_bytes;
  for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 8
    for (int64_t j = 0; j < kShare; j += 64) prefetch(ahead + g * kShare + j);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      vf a0, a1;
      D::group(w + c * row_bytes + g * D::kQBytes, sb[c * ldsb + g],
               D::kMin ? mb[c * ldsb + g] : 0.0f, a0, a1);
#pragma GCC unroll 8
      for (int r = 0; r < XR; ++r) {
        const float* xr = x + r * ldx + 32 * g;
        acc[r][c] = step<D>(acc[r][c], a0, a1, sb[c * ldsb + g], vload(xr), vload(xr + 16));
      }
    }
  }
  for (int r = 0; r < XR; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = vsum(acc[r][c]) + (bias ? bias[c] : 0.0f);
}

// Weight rows per tile beside XR x rows: about kChains accumulators in flight (a chain has
// dependent fmas, so a tile of a few accumulators waits on their latency).
#if defined(LLMSERVE_QUANT_VEC_AVX2)
constexpr int kChains = 4;
#else
constexpr int kChains = 16;
#endif
template <int XR>
constexpr int cols_for() {
  return XR >= kChains ? 1 : kChains / XR;
}

// XR x rows against all N weight rows, C at a time (the team shares the weight rows); the
// scales of a tile's weight rows go into sb and mb (C * G floats each).
template <class D, int XR, int C>
void pass(const float* x, int64_t ldx, int64_t G, const uint8_t* w, int64_t N,
          int64_t row_bytes, const float* bias, float* y, int64_t ldy, float* sb, float* mb) {
#pragma omp for schedule(static)
  for (int64_t i = 0; i < N / C; ++i) {
    const uint8_t* rows = w + i * C * row_bytes;
    for (int c = 0; c < C; ++c) row_scales<D>(rows + c * row_bytes, G, sb + c * G, mb + c * G);
    tile<D, XR, C>(x, ldx, G, rows, row_bytes, sb, mb, G, bias ? bias + i * C : nullptr,
                   y + i * C, ldy);
  }
#pragma omp for schedule(static)
  for (int64_t n = N / C * C; n < N; ++n) {
    row_scales<D>(w + n * row_bytes, G, sb, mb);
    tile<D, XR, 1>(x, ldx, G, w + n * row_bytes, row_bytes, sb, mb, G, bias ? bias + n : nullptr,
                   y + n, ldy);
  }
}

// xr (2..kFew) rows in one pass (a speculative verification's few rows, a small batch, the rows
// after the last whole tile): the tile's width picked for xr.
template <class D, int XR = kFew>
void partial(int64_t xr, const float* x, int64_t ldx, int64_t G, const uint8_t* w, int64_t N,
             int64_t row_bytes, const float* bias, float* y, int64_t ldy, float* sb, float* mb) {
  if constexpr (XR > 2) {
    if (xr < XR) return partial<D, XR - 1>(xr, x, ldx, G, w, N, row_bytes, bias, y, ldy, sb, mb);
  }
  pass<D, XR, cols_for<XR>()>(x, ldx, G, w, N, row_bytes, bias, y, ldy, sb, mb);
}

// What each thread does; its `omp for`s share the weight rows among the team, or run them all
// when called outside a parallel region (one thread: no team is started).
template <class D>
void work(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* w, int64_t N,
          int64_t row_bytes, const float* bias, float* y, int64_t ldy) {
  const int64_t G = K / 32;
  // Whole tiles of kRows rows, x kept in L2 by blocks of mc rows (more than kFew rows); then the
  // rest: one row is a decode (gemv, its pass), 2..kFew rows one pass of a tile that wide.
  const int64_t tiled = M > kFew ? M / kRows * kRows : 0, rest = M - tiled;
  int64_t mc = kXBytes / (K * (int64_t)sizeof(float)) / kRows * kRows;
  if (mc < kRows) mc = kRows;
  // Scales and minimums of a tile's weight rows, or of a decode pass's rows by chunks of
  // groups. Not zeroed (every entry read is written first): a decode would clear KBs for nothing.
  const int64_t tile_floats = M > 1 ? kChains * G : 1;
  std::unique_ptr<float[]> row_sb(new float[2 * tile_floats]), sb(new float[2 * kOut * kLd]);
  float* row_mb = row_sb.get() + tile_floats;
  for (int64_t m0 = 0; m0 < tiled; m0 += mc) {
    const int64_t m1 = m0 + mc < tiled ? m0 + mc : tiled;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N / kCols; ++i) {
      const uint8_t* rows = w + i * kCols * row_bytes;
      for (int c = 0; c < kCols; ++c)
        row_scales<D>(rows + c * row_bytes, G, row_sb.get() + c * G, row_mb + c * G);
      for (int64_t m = m0; m < m1; m += kRows)
        tile<D, kRows, kCols>(x + m * ldx, ldx, G, rows, row_bytes, row_sb.get(), row_mb, G,
                              bias ? bias + i * kCols : nullptr, y + m * ldy + i * kCols, ldy);
    }
#pragma omp for schedule(static)
    for (int64_t n = N / kCols * kCols; n < N; ++n) {
      const uint8_t* row = w + n * row_bytes;
      row_scales<D>(row, G, row_sb.get(), row_mb);
      for (int64_t m = m0; m < m1; m += kRows)
        tile<D, kRows, 1>(x + m * ldx, ldx, G, row, row_bytes, row_sb.get(), row_mb, G,
                          bias ? bias + n : nullptr, y + m * ldy + n, ldy);
    }
  }
  if (rest > 1) {
    partial<D>(rest, x + tiled * ldx, ldx, G, w, N, row_bytes, bias, y + tiled * ldy, ldy,
               row_sb.get(), row_mb);
    return;
  }
  if (rest == 0) return;
  const float* xm = x + tiled * ldx;
  float* ym = y + tiled * ldy;
  float* mb = sb.get() + kOut * kLd;
  const int64_t blocks = N / kOut;
#pragma omp for schedule(static)
  for (int64_t i = 0; i < blocks; ++i)
    gemv<D, kOut>(xm, G, w + i * kOut * row_bytes, row_bytes, bias ? bias + i * kOut : nullptr,
                  ym + i * kOut, sb.get(), mb);
#pragma omp for schedule(static)
  for (int64_t n = blocks * kOut; n < N; ++n)
    gemv<D, 1>(xm, G, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, ym + n, sb.get(),
               mb);
}

template <class D>
void run(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* w, int64_t N,
         int64_t row_bytes, const float* bias, float* y, int64_t ldy, int num_threads) {
  IeeeMode caller;
  if (num_threads > 1 && M * K * N >= (1 << 17)) {
#pragma omp parallel num_threads(num_threads)
    {
      IeeeMode ieee;  // per thread: no flush-to-zero, whichever thread computes a row
      work<D>(x, M, K, ldx, w, N, row_bytes, bias, y, ldy);
    }
  } else {
    work<D>(x, M, K, ldx, w, N, row_bytes, bias, y, ldy);
  }
}

// One row between the GGUF block layout and the split layout.
template <class D>
void relayout(const uint8_t* src, int64_t G, uint8_t* dst, bool to_split) {
  constexpr int64_t kHead = D::kBlockBytes - D::kQBytes;  // d (and m) in front of the quants
  for (int64_t g = 0; g < G; ++g) {
    const int64_t blk = g * D::kBlockBytes, qs = g * D::kQBytes, sc = G * D::kQBytes + 2 * g;
    if (to_split) {
      std::memcpy(dst + qs, src + blk + kHead, D::kQBytes);
      std::memcpy(dst + sc, src + blk, 2);
      if (D::kMin) std::memcpy(dst + sc + 2 * G, src + blk + 2, 2);
    } else {
      std::memcpy(dst + blk + kHead, src + qs, D::kQBytes);
      std::memcpy(dst + blk, src + sc, 2);
      if (D::kMin) std::memcpy(dst + blk + 2, src + sc + 2 * G, 2);
    }
  }
}

template <class F>
int dispatch(int type, F&& f) {
  switch (type) {
    case kQ8_0: return f(SQ8_0{});
    case kQ4_0: return f(SQ4_0{});
    case kQ4_1: return f(SQ4_1{});
    default: return 2;
  }
}

}  // namespace

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T (+ bias [N] when not null), W as
// N split-layout rows of row_bytes bytes of `type` (Q8_0, Q4_0, Q4_1; with kActInt8 set, int8
// activations: quant_act8.cpp). Returns 0; 1 for arguments it rejects, 2 for a type it does not
// take.
extern "C" int llmserve_quant_gemm_split_f32(int type, const float* x, int64_t M, int64_t K,
                                             int64_t ldx, const uint8_t* w, int64_t N,
                                             int64_t row_bytes, const float* bias, float* y,
                                             int64_t ldy, int num_threads) {
  if (M < 0 || K <= 0 || K % 32 || N <= 0 || ldx < K || ldy < N) return 1;
  const int nt = num_threads < 1 ? 1 : num_threads;
  return dispatch(type & ~kActInt8, [&](auto d) {
    using D = decltype(d);
    if (row_bytes != K / 32 * D::kBlockBytes) return 1;
    if (M == 0) return 0;
    if (type & kActInt8)  // the opt-in int8-activation mode (quant_act8.cpp)
      return llmserve_quant_gemm_act8_f32(D::kType, x, M, K, ldx, w, N, row_bytes, bias, y, ldy,
                                          nt);
    run<D>(x, M, K, ldx, w, N, row_bytes, bias, y, ldy, nt);
    return 0;
  });
}

// dst = the N rows of src (row_bytes each, K weights of `type`) moved between the GGUF block
// layout and the split one (to_split != 0: GGUF -> split). Returns 0, 1 or 2 as above.
extern "C" int llmserve_quant_relayout(int type, const uint8_t* src, int64_t N, int64_t K,
                                       int64_t row_bytes, uint8_t* dst, int to_split) {
  if (N < 0 || K <= 0 || K % 32) return 1;
  return dispatch(type, [&](auto d) {
    using D = decltype(d);
    if (row_bytes != K / 32 * D::kBlockBytes) return 1;
    for (int64_t n = 0; n < N; ++n)
      relayout<D>(src + n * row_bytes, K / 32, dst + n * row_bytes, to_split != 0);
    return 0;
  });
}

// out [num, K] (row stride ldo) = the de-quantized rows rows[0..num) (null: 0..num) of W, N
// split-layout rows: bit for bit llmserve_quant_dequant_f32 of the same rows as GGUF blocks.
extern "C" int llmserve_quant_dequant_split_f32(int type, const uint8_t* w, int64_t N, int64_t K,
                                                int64_t row_bytes, const int64_t* rows,
                                                int64_t num, float* out, int64_t ldo) {
  if (N <= 0 || K <= 0 || K % 32 || ldo < K) return 1;
  std::vector<uint8_t> block_row(row_bytes > 0 ? row_bytes : 0);
  for (int64_t i = 0; i < num; ++i) {
    const int64_t r = rows ? rows[i] : i;
    if (r < 0 || r >= N) return 1;
    int rc = llmserve_quant_relayout(type, w + r * row_bytes, 1, K, row_bytes, block_row.data(), 0);
    if (rc == 0)
      rc = llmserve_quant_dequant_f32(type, block_row.data(), 1, K, row_bytes, nullptr, 1,
                                      out + i * ldo, ldo);
    if (rc != 0) return rc;
  }
  return 0;
}
