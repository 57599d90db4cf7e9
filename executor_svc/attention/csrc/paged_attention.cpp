// Paged attention for the CPU: one call per layer for the whole flattened batch (decodes and
// prefill chunks alike), reading K/V in place through the block table. fp32 only.
//
// Built by executor_svc/attention/cpu_kernel.py with the system C++ compiler into a plain shared
// library (no torch headers: it compiles in about a second) and called through ctypes.
//
// Layout (docs/internals.md): cache [num_blocks, block_size, num_kv_heads, head_dim]; sequence i
// owns query rows query_start_loc[i] .. query_start_loc[i + 1], the last q_len positions of its
// seq_lens[i] tokens. Query heads h and h' share KV head h / group.
//
// Work is split into items (sequence, KV head, tile of up to TILE query tokens); an item keeps
// the online-softmax state (running max m, sum l, accumulator acc) of its rows = tokens x group
// heads, and walks the sequence's blocks once, so each K/V block is read once per item.
// Scores: with few rows (decode), one dot product per (row, key); with many rows (prefill),
// the block's keys are transposed once into [head_dim][block_size] so each row's scores for a
// whole block are head_dim vector multiply-adds over block_size lanes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// 16 floats; GCC lowers it to AVX-512, AVX2 pairs or SSE quads, whatever -march allows.
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }

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

// The online-softmax step of one row over n new scores in s: s becomes the weights
// exp(s - new max), m and l move on, and the factor that rescales the row's accumulator is
// returned (0 on the first block, where m = -1e30).
inline float softmax_update(float* s, int n, float& m, float& l) {
  float mx = m;
  for (int j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  const float corr = std::exp(m - mx);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  m = mx;
  l = l * corr + sum;
  return corr;
}

// One row against n keys of a block for head_dim = 16 * DV, all in registers: scores (one dot
// per key, the keys independent so they overlap), softmax weights, then the weighted sum of V
// into the row's accumulator with two interleaved sets of partial sums (FMA latency).
template <int DV>
void row_block(const float* q, const float* kb, const float* vb, int64_t tok_stride, int n,
               float* s, float& m, float& l, float* acc) {
  v16 qv[DV];
  for (int v = 0; v < DV; ++v) qv[v] = load16(q + 16 * v);
  int j0 = 0;
  for (; j0 + 16 <= n; j0 += 16) {
    v16 a[16];
    for (int u = 0; u < 16; ++u) {
      const float* k = kb + (j0 + u) * tok_stride;
      a[u] = qv[0] * load16(k);
      for (int v = 1; v < DV; ++v) a[u] += qv[v] * load16(k + 16 * v);
    }
    store16(s + j0, reduce16(a));
  }
  for (; j0 < n; ++j0) {
    const float* k = kb + j0 * tok_stride;
    v16 a = qv[0] * load16(k);
    for (int v = 1; v < DV; ++v) a += qv[v] * load16(k + 16 * v);
    s[j0] = hsum(a);
  }
  const float corr = softmax_update(s, n, m, l);
  v16 o0[DV], o1[DV];
  for (int v = 0; v < DV; ++v) {
    o0[v] = load16(acc + 16 * v) * corr;
    o1[v] = v16{};
  }
  int j = 0;
  for (; j + 1 < n; j += 2) {
    const float* v0 = vb + j * tok_stride;
    const float* v1 = v0 + tok_stride;
    for (int v = 0; v < DV; ++v) {
      o0[v] += s[j] * load16(v0 + 16 * v);
      o1[v] += s[j + 1] * load16(v1 + 16 * v);
    }
  }
  if (j < n) {
    const float* v0 = vb + j * tok_stride;
    for (int v = 0; v < DV; ++v) o0[v] += s[j] * load16(v0 + 16 * v);
  }
  for (int v = 0; v < DV; ++v) store16(acc + 16 * v, o0[v] + o1[v]);
}

using RowBlockFn = void (*)(const float*, const float*, const float*, int64_t, int, float*,
                            float&, float&, float*);

RowBlockFn pick_row_block(int head_dim) {
  switch (head_dim) {
    case 32: return row_block<2>;
    case 48: return row_block<3>;
    case 64: return row_block<4>;
    case 80: return row_block<5>;
    case 96: return row_block<6>;
    case 128: return row_block<8>;
    default: return nullptr;  // the generic loops below
  }
}

constexpr int TILE = 16;          // query tokens per work item
constexpr int TRANSPOSE_ROWS = 8; // rows from which transposing a K block pays off

struct Item {
  int seq, t0, t1;  // query tokens [t0, t1) of the batch
  int g0, g1;       // KV heads [g0, g1)
};

struct Args {
  const float* q; int64_t q_stride_t, q_stride_h;  // query [num_tokens, H, D], any row strides
  const float* k_cache; const float* v_cache;
  const int32_t* block_tables; int64_t bt_stride;
  const int32_t* seq_lens; const int32_t* qsl;
  int H, KVH, D, BS;
  float scale;
  float* out;  // [num_tokens, H, D] contiguous
};

// Softmax update and V accumulation of one row for n scores already in s (generic head_dim).
void row_update(float* s, int n, const float* vb, int64_t tok_stride, int D, float& m, float& l,
                float* o) {
  const float corr = softmax_update(s, n, m, l);
#pragma omp simd
  for (int d = 0; d < D; ++d) o[d] *= corr;
  for (int j = 0; j < n; ++j) {
    const float p = s[j];
    const float* v = vb + j * tok_stride;
#pragma omp simd
    for (int d = 0; d < D; ++d) o[d] += p * v[d];
  }
}

// Rows of an item are (token t, head h) for its tokens and the query heads of its KV heads:
// r = t * rows_per_tok + (h - g0 * G). Walking blocks in the outer loop and KV heads inside
// reads each block's K and V front to back once (with all heads, 12 KB contiguous each for the
// benchmark's model), the next block prefetched while this one is computed.
void run_item(const Args& a, const Item& it, std::vector<float>& buf) {
  const int G = a.H / a.KVH, D = a.D, BS = a.BS;
  const int per_tok = (it.g1 - it.g0) * G;
  const int ntok = it.t1 - it.t0, rows = ntok * per_tok;
  const int q_start = a.qsl[it.seq], q_len = a.qsl[it.seq + 1] - q_start;
  const int seq_len = a.seq_lens[it.seq];
  const int first_pos = seq_len - q_len;  // position of the sequence's first query token
  // Scratch: q rows, acc rows, m, l, scores, transposed K block.
  buf.resize((size_t)rows * D * 2 + (size_t)rows * 2 + (size_t)rows * BS + (size_t)D * BS);
  float* qr = buf.data();
  float* acc = qr + (size_t)rows * D;
  float* m = acc + (size_t)rows * D;
  float* l = m + rows;
  float* sc = l + rows;
  float* kt = sc + (size_t)rows * BS;
  for (int t = 0; t < ntok; ++t) {
    for (int j = 0; j < per_tok; ++j) {
      const int r = t * per_tok + j, h = it.g0 * G + j;
      const float* src = a.q + (int64_t)(it.t0 + t) * a.q_stride_t + (int64_t)h * a.q_stride_h;
      for (int d = 0; d < D; ++d) qr[(size_t)r * D + d] = src[d] * a.scale;
    }
  }
  std::fill(acc, acc + (size_t)rows * D, 0.0f);
  // A finite "minus infinity": the library is built with -ffast-math (no infinities).
  std::fill(m, m + rows, -1e30f);
  std::fill(l, l + rows, 0.0f);
  const int pos0 = first_pos + (it.t0 - q_start);  // position of the item's first token
  const int last = pos0 + ntok - 1;                // the last token sees the most keys
  const int nblocks = last / BS + 1;
  const int32_t* table = a.block_tables + (int64_t)it.seq * a.bt_stride;
  const int64_t tok_stride = (int64_t)a.KVH * D;
  const int64_t span = (int64_t)(it.g1 - it.g0) * D;  // floats per token this item reads
  const RowBlockFn fast = pick_row_block(D);
  const bool transpose = !fast && ntok * G >= TRANSPOSE_ROWS;
  for (int b = 0; b < nblocks; ++b) {
    const int64_t block_base = (int64_t)table[b] * BS * tok_stride + (int64_t)it.g0 * D;
    if (b + 1 < nblocks) {
      const int64_t next = (int64_t)table[b + 1] * BS * tok_stride + (int64_t)it.g0 * D;
      // The first lines of each token's span: enough to start the hardware prefetcher on
      // the block (and its TLB entry); prefetching every line stalled on full fill buffers.
      for (int j = 0; j < BS; ++j) {
        __builtin_prefetch(a.k_cache + next + j * tok_stride);
        __builtin_prefetch(a.v_cache + next + j * tok_stride);
      }
    }
    const int keys = std::min(BS, last + 1 - b * BS);
    for (int g = it.g0; g < it.g1; ++g) {
      const float* kb = a.k_cache + block_base + (int64_t)(g - it.g0) * D;
      const float* vb = a.v_cache + block_base + (int64_t)(g - it.g0) * D;
      if (transpose) {
        for (int j = 0; j < keys; ++j)
          for (int d = 0; d < D; ++d) kt[(size_t)d * BS + j] = kb[j * tok_stride + d];
      }
      for (int t = 0; t < ntok; ++t) {
        const int n = std::min(keys, pos0 + t + 1 - b * BS);  // causal: keys up to its position
        if (n <= 0) continue;
        for (int j = 0; j < G; ++j) {
          const int r = t * per_tok + (g - it.g0) * G + j;
          const float* q = qr + (size_t)r * D;
          float* s = sc + (size_t)r * BS;
          float* o = acc + (size_t)r * D;
          if (fast) {
            fast(q, kb, vb, tok_stride, n, s, m[r], l[r], o);
            continue;
          }
          if (transpose) {
            for (int k = 0; k < BS; ++k) s[k] = 0.0f;
            for (int d = 0; d < D; ++d) {
              const float qd = q[d];
              const float* kd = kt + (size_t)d * BS;
#pragma omp simd
              for (int k = 0; k < BS; ++k) s[k] += qd * kd[k];
            }
          } else {
            for (int k = 0; k < n; ++k) {
              const float* kk = kb + k * tok_stride;
              float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
              for (int d = 0; d < D; ++d) dot += q[d] * kk[d];
              s[k] = dot;
            }
          }
          row_update(s, n, vb, tok_stride, D, m[r], l[r], o);
        }
      }
    }
  }
  for (int t = 0; t < ntok; ++t) {
    for (int j = 0; j < per_tok; ++j) {
      const int r = t * per_tok + j, h = it.g0 * G + j;
      float* dst = a.out + ((int64_t)(it.t0 + t) * a.H + h) * D;
      const float inv = 1.0f / l[r];
      for (int d = 0; d < D; ++d) dst[d] = acc[(size_t)r * D + d] * inv;
    }
  }
}

}  // namespace

extern "C" int llmserve_paged_attention_f32(
    const float* q, int64_t q_stride_t, int64_t q_stride_h,
    const float* k_cache, const float* v_cache,
    const int32_t* block_tables, int64_t bt_stride,
    const int32_t* seq_lens, const int32_t* query_start_loc, int num_seqs,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
    float* out, int num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0)
    return 1;
  Args a{q, q_stride_t, q_stride_h, k_cache, v_cache, block_tables, bt_stride, seq_lens,
         query_start_loc, num_heads, num_kv_heads, head_dim, block_size, scale, out};
  // One item per (sequence, tile) reads whole blocks; with threads to spare and few such items,
  // KV heads get items of their own so every thread has work.
  int num_items = 0;
  for (int i = 0; i < num_seqs; ++i)
    num_items += (query_start_loc[i + 1] - query_start_loc[i] + TILE - 1) / TILE;
  const bool split_heads = num_threads > 1 && num_items < 4 * num_threads;
  std::vector<Item> items;
  for (int i = 0; i < num_seqs; ++i) {
    const int s = query_start_loc[i], e = query_start_loc[i + 1];
    if (seq_lens[i] < 0) continue;  // attended elsewhere by the caller; its rows are left as is
    if (e - s > seq_lens[i]) return 2;
    // Later tiles of a prefill see more keys: put them first so the long items start early.
    for (int t1 = e; t1 > s; t1 -= TILE) {
      const int t0 = std::max(s, t1 - TILE);
      if (split_heads)
        for (int g = 0; g < num_kv_heads; ++g) items.push_back({i, t0, t1, g, g + 1});
      else
        items.push_back({i, t0, t1, 0, num_kv_heads});
    }
  }
  const int n = (int)items.size();
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int k = 0; k < n; ++k) run_item(a, items[k], buf);
  }
  return 0;
}
