// A low-rank update of chosen rows, fp32 on the CPU: for the given rows,
// y[row] += (x[row] @ A) @ B_s for each column shard s of a packed projection (q|k|v, gate|up),
// the shard's B landing in its own output columns (the LoRA feature's batched apply:
// executor_svc/features/lora/kernel.py). Part of the CPU kernel library
// (executor_svc/kernels/library.py builds csrc/*.cpp into one).
//
// Step invariance: each row is computed on its own, in one fixed order (x @ A: k ascending for
// each of A's columns; then each output column: the rank index ascending), then added to y once.
// A row's result depends on nothing but the row, the adapter and the shapes: not on how many
// rows share its adapter nor on what else the step holds. The compiler vectorizes across
// independent columns only (-fno-associative-math keeps every sum in the written order).

#include <cstdint>

#include "simd.h"

using namespace llmserve;

namespace {
constexpr int64_t kMaxRankTotal = 256;  // rank * shards: 64 * 3 (q|k|v) fits
constexpr int kRowBlock = 4;

// For each of R rows: out[t][c] = sum over j < depth of v[t][j] * m[j * ld + c], j ascending,
// for c < n. Rows are blocked only so that R independent chains hide the FMA latency and share
// the loads of m; every element's sum is the same one chain whatever R is (the path a column
// takes, 64-wide, 16-wide or scalar, depends on n alone).
template <int R>
inline void rows_times(const float* const* v, int64_t depth, const float* m, int64_t ld,
                       int64_t n, float* const* out) {
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) {
    v16 acc[R][4] = {};
    for (int64_t j = 0; j < depth; ++j) {
      const float* p = m + j * ld + c;
      const v16 m0 = load16(p), m1 = load16(p + 16), m2 = load16(p + 32), m3 = load16(p + 48);
      for (int t = 0; t < R; ++t) {
        const float vj = v[t][j];
        acc[t][0] += vj * m0;
        acc[t][1] += vj * m1;
        acc[t][2] += vj * m2;
        acc[t][3] += vj * m3;
      }
    }
    for (int t = 0; t < R; ++t)
      for (int q = 0; q < 4; ++q) store16(out[t] + c + 16 * q, acc[t][q]);
  }
  for (; c + 16 <= n; c += 16) {
    v16 acc[R] = {};
    for (int64_t j = 0; j < depth; ++j) {
      const v16 m0 = load16(m + j * ld + c);
      for (int t = 0; t < R; ++t) acc[t] += v[t][j] * m0;
    }
    for (int t = 0; t < R; ++t) store16(out[t] + c, acc[t]);
  }
  for (; c < n; ++c) {
    for (int t = 0; t < R; ++t) {
      float acc = 0.0f;
      for (int64_t j = 0; j < depth; ++j) acc += v[t][j] * m[j * ld + c];
      out[t][c] = acc;
    }
  }
}

// The rows of one block (R of them): x @ A, then each shard's B into y.
template <int R>
inline void lowrank_rows(const float* const* xr, float* const* yr, int64_t k, const float* a,
                      int64_t ra, int64_t r, int64_t num_shards, const int64_t* shard_start,
                      const int64_t* shard_size, const float* const* b_ptrs) {
  constexpr int64_t kBlock = 256;
  float xa[R][kMaxRankTotal];
  float delta[R][kBlock];
  float* xa_p[R];
  float* delta_p[R];
  const float* xs[R];
  for (int t = 0; t < R; ++t) xa_p[t] = xa[t], delta_p[t] = delta[t];
  rows_times<R>(xr, k, a, ra, ra, xa_p);  // x @ A: k ascending for each column
  for (int64_t s = 0; s < num_shards; ++s) {
    const int64_t size = shard_size[s];
    for (int t = 0; t < R; ++t) xs[t] = xa[t] + s * r;
    for (int64_t c0 = 0; c0 < size; c0 += kBlock) {
      const int64_t n = size - c0 < kBlock ? size - c0 : kBlock;
      rows_times<R>(xs, r, b_ptrs[s] + c0, size, n, delta_p);  // rank index ascending
      for (int t = 0; t < R; ++t) {
        float* ys = yr[t] + shard_start[s] + c0;
        for (int64_t c = 0; c < n; ++c) ys[c] = ys[c] + delta[t][c];
      }
    }
  }
}
}  // namespace

// x: rows of k floats at row stride ldx; rows: the num_rows row indices of the group (into x
// and y); a: [k, ra] row-major; shards: num_shards of (start, size) in shard_start/size, B_s
// [r, size] row-major at b_ptrs[s], A's columns [s * r, (s + 1) * r); y: rows at stride ldy.
extern "C" int llmserve_lowrank_rows_f32(const float* x, int64_t ldx, int64_t k, const int64_t* rows,
                                 int64_t num_rows, const float* a, int64_t ra, int64_t r,
                                 int64_t num_shards, const int64_t* shard_start,
                                 const int64_t* shard_size, const float* const* b_ptrs,
                                 float* y, int64_t ldy, int num_threads) {
  if (ra <= 0 || ra > kMaxRankTotal || r <= 0 || num_shards * r > ra) return 1;
  const int64_t num_blocks = (num_rows + kRowBlock - 1) / kRowBlock;
  flush_for(num_blocks, num_threads, num_threads > 1 && num_blocks >= 2, [&](int64_t blk) {
    const int64_t first = blk * kRowBlock;
    const int64_t count = num_rows - first < kRowBlock ? num_rows - first : kRowBlock;
    const float* xr[kRowBlock];
    float* yr[kRowBlock];
    for (int64_t t = 0; t < count; ++t) {
      xr[t] = x + rows[first + t] * ldx;
      yr[t] = y + rows[first + t] * ldy;
    }
    if (count == kRowBlock) {
      lowrank_rows<kRowBlock>(xr, yr, k, a, ra, r, num_shards, shard_start, shard_size, b_ptrs);
    } else {
      for (int64_t t = 0; t < count; ++t)
        lowrank_rows<1>(xr + t, yr + t, k, a, ra, r, num_shards, shard_start, shard_size, b_ptrs);
    }
  });
  return 0;
}
