// Paged attention for the CPU: one call per layer for the whole flattened batch (decodes and
// prefill chunks alike), reading K/V in place through the block table. fp32 K/V, or bf16 K/V
// (csrc/paged_attention_bf16kv.cpp; attention.h, kv_t) with fp32 arithmetic.
//
// Built by executor_svc/kernels/library.py with the system C++ compiler into a plain shared
// library (no torch headers: it compiles in about a second) and called through ctypes.
//
// Layout (docs/internals.md): cache [num_blocks, block_size, num_kv_heads, head_dim]; sequence i
// owns query rows query_start_loc[i] .. query_start_loc[i + 1], the last q_len positions of its
// seq_lens[i] tokens. Query heads h and h' share KV head h / group.
//
// Work is split into items (sequence, tile of up to TILE query tokens, its KV heads); an item
// keeps the softmax state (running max m, sum l, accumulator acc) of its rows = tokens x query
// heads and walks the sequence's blocks, so each K/V block is read once per item.
// head_dim = 16 * DV (32 ... 128): attention_vec.cpp. Keys in chunks of CHUNK_KEYS that start at
// fixed key multiples: first the scores of all the item's rows for the chunk (a dot product per
// (row, key), 16 keys reduced together), then one softmax step per row over the chunk, then the
// weighted sum of V with the rows of a KV head sharing each V load. Reading a block prefetches
// the next, a head slice per key, spread over the work. Any other head_dim: run_item, plain
// loops with an online softmax per block.
//
// Every row is computed the same way whatever else is in the step (how many rows its item has,
// which tile or item it lands in, decode or prefill, shared-prefix group or not, thread count):
// the step-invariance guarantee of docs/internals.md rests on it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "simd.h"

namespace llmserve {
namespace {

// Softmax update and V accumulation of one row for n scores already in s (generic head_dim).
void row_update(float* s, int n, const kv_t* vb, int64_t tok_stride, int D, float& m, float& l,
                float* o) {
  const float corr = softmax_update(s, n, m, l);
#pragma omp simd
  for (int d = 0; d < D; ++d) o[d] *= corr;
  for (int j = 0; j < n; ++j) {
    const float p = s[j];
    const kv_t* v = vb + j * tok_stride;
#pragma omp simd
    for (int d = 0; d < D; ++d) o[d] += p * kv_get(v[d]);
  }
}

// The generic path. Rows of an item are (token t, head h) for its tokens and the query heads of
// its KV heads: r = t * rows_per_tok + (h - g0 * G); blocks outer, KV heads inside.
void run_item(const Args& a, const Item& it, std::vector<float>& buf) {
  const int G = a.H / a.KVH, D = a.D, BS = a.BS;
  const int per_tok = (it.g1 - it.g0) * G;
  const int ntok = it.t1 - it.t0, rows = ntok * per_tok;
  const int q_start = a.qsl[it.seq], q_len = a.qsl[it.seq + 1] - q_start;
  const int seq_len = a.seq_lens[it.seq];
  const int first_pos = seq_len - q_len;  // position of the sequence's first query token
  // Scratch: q rows, acc rows, m, l, scores.
  buf.resize((size_t)rows * D * 2 + (size_t)rows * 2 + (size_t)rows * BS);
  float* qr = buf.data();
  float* acc = qr + (size_t)rows * D;
  float* m = acc + (size_t)rows * D;
  float* l = m + rows;
  float* sc = l + rows;
  for (int t = 0; t < ntok; ++t) {
    for (int j = 0; j < per_tok; ++j) {
      const int r = t * per_tok + j, h = it.g0 * G + j;
      load_query(a, it.t0 + t, h, qr + (size_t)r * D);
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
  for (int b = 0; b < nblocks; ++b) {
    const int64_t block_base = (int64_t)table[b] * BS * tok_stride + (int64_t)it.g0 * D;
    const int keys = std::min(BS, last + 1 - b * BS);
    for (int g = it.g0; g < it.g1; ++g) {
      const kv_t* kb = a.k_cache + block_base + (int64_t)(g - it.g0) * D;
      const kv_t* vb = a.v_cache + block_base + (int64_t)(g - it.g0) * D;
      for (int t = 0; t < ntok; ++t) {
        const int n = std::min(keys, pos0 + t + 1 - b * BS);  // causal: keys up to its position
        if (n <= 0) continue;
        for (int j = 0; j < G; ++j) {
          const int r = t * per_tok + (g - it.g0) * G + j;
          const float* q = qr + (size_t)r * D;
          float* s = sc + (size_t)r * BS;
          float* o = acc + (size_t)r * D;
          for (int k = 0; k < n; ++k) {
            const kv_t* kk = kb + k * tok_stride;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; ++d) dot += q[d] * kv_get(kk[d]);
            s[k] = dot;
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

// The generic path for any head_dim, item by item.
void run_all_generic(const Args& a, const std::vector<Item>& items, int num_threads) {
  const int n = (int)items.size();
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    FlushMode mode;  // this thread's share (simd.h)
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int k = 0; k < n; ++k) run_item(a, items[k], buf);
  }
}

}  // namespace
}  // namespace llmserve

using namespace llmserve;

// The attention of one layer over the paged cache. When num_new > 0 it first stores the step's
// new K/V rows (k_new, v_new: [num_new, KVH, D], row strides given, heads contiguous) at their
// slots (-1 = skip), K rotated by cos/sin when those are given; the query is rotated by the
// same rows, so a layer's rope, K/V write and attention are this one call.
extern "C" int LLMSERVE_PAGED_ATTENTION(
    const float* q, int64_t q_stride_t, int64_t q_stride_h,
    kv_t* k_cache, kv_t* v_cache,
    const int32_t* block_tables, int64_t bt_stride,
    const int32_t* seq_lens, const int32_t* query_start_loc, int num_seqs,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
    float* out, int num_threads,
    const float* k_new, int64_t k_stride_t, const float* v_new, int64_t v_stride_t,
    const int64_t* slots, int num_new, const float* cos, const float* sin) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0 ||
      (cos && head_dim % 2))
    return 1;
  Args a{q, q_stride_t, q_stride_h, k_cache, v_cache, block_tables, bt_stride, seq_lens,
         query_start_loc, num_heads, num_kv_heads, head_dim, block_size, scale, out, cos, sin};
  const int64_t kv_row = (int64_t)num_kv_heads * head_dim;
  const bool parallel = num_threads > 1 && num_new > 1 && num_new * 2 * kv_row >= kParallelMin;
  flush_for(num_new, num_threads, parallel, [&](int64_t t) {
    if (slots[t] < 0) return;
    kv_t* kd = k_cache + slots[t] * kv_row;
    kv_t* vd = v_cache + slots[t] * kv_row;
    const float* cs = cos ? cos + (int64_t)t * (head_dim / 2) : nullptr;
    const float* sn = sin ? sin + (int64_t)t * (head_dim / 2) : nullptr;
#if defined(LLMSERVE_KV_BF16)
    // The rotated key in fp32, then rounded once; on the stack for the usual head sizes (no
    // allocation per token).
    float stack_row[256];
    std::vector<float> heap_row;
    float* row = stack_row;
    if (head_dim > 256) heap_row.resize(head_dim), row = heap_row.data();
    for (int g = 0; g < num_kv_heads; ++g) {
      load_row(k_new + t * k_stride_t + (int64_t)g * head_dim, cs, sn, head_dim, 1.0f, row);
      for (int d = 0; d < head_dim; ++d) kd[(int64_t)g * head_dim + d] = kv_from(row[d]);
    }
    for (int64_t i = 0; i < kv_row; ++i) vd[i] = kv_from(v_new[t * v_stride_t + i]);
#else
    for (int g = 0; g < num_kv_heads; ++g)
      load_row(k_new + t * k_stride_t + (int64_t)g * head_dim, cs, sn, head_dim, 1.0f,
               kd + (int64_t)g * head_dim);
    __builtin_memcpy(vd, v_new + t * v_stride_t, sizeof(float) * kv_row);
#endif
  });
  // One item per (sequence, tile) reads whole blocks; with threads to spare and few such items,
  // KV heads get items of their own so every thread has work.
  int num_items = 0;
  for (int i = 0; i < num_seqs; ++i)
    num_items += (query_start_loc[i + 1] - query_start_loc[i] + TILE - 1) / TILE;
  const bool split_heads = num_threads > 1 && num_items < 4 * num_threads;
  std::vector<Item> items;
  for (int i = 0; i < num_seqs; ++i) {
    const int s = query_start_loc[i], e = query_start_loc[i + 1];
    if (e - s > seq_lens[i]) return 2;
    // Later tiles of a prefill see more keys: put them first so the long items start early.
    for (int t1 = e; t1 > s; t1 -= TILE) {
      const int t0 = std::max(s, t1 - TILE);
      if (split_heads || (t1 - t0) * num_heads > MAX_ITEM_ROWS)
        for (int g = 0; g < num_kv_heads; ++g) items.push_back({i, t0, t1, g, g + 1});
      else
        items.push_back({i, t0, t1, 0, num_kv_heads});
    }
  }
  if (!run_all_vec(a, num_seqs, query_start_loc[num_seqs], items, num_threads))
    run_all_generic(a, items, num_threads);  // plain loops for any other head_dim
  return 0;
}
