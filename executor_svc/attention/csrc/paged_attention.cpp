// Paged attention for the CPU: one call per layer for the whole flattened batch (decodes and
// prefill chunks alike), reading K/V in place through the block table. fp32 only.
//
// Built by executor_svc/attention/cpu_ops.py with the system C++ compiler into a plain shared
// library (no torch headers: it compiles in about a second) and called through ctypes.
//
// Layout (docs/internals.md): cache [num_blocks, block_size, num_kv_heads, head_dim]; sequence i
// owns query rows query_start_loc[i] .. query_start_loc[i + 1], the last q_len positions of its
// seq_lens[i] tokens. Query heads h and h' share KV head h / group.
//
// Work is split into items (sequence, tile of up to TILE query tokens, its KV heads); an item
// keeps the softmax state (running max m, sum l, accumulator acc) of its rows = tokens x query
// heads and walks the sequence's blocks, so each K/V block is read once per item.
// head_dim = 16 * DV (32 ... 128): run_item_vec. Keys in chunks of up to 32 blocks: first the
// scores of all rows for the chunk (few rows, i.e. decodes: a dot product per (row, key), 16 keys
// reduced together; many rows: the block's keys transposed to [head_dim][16] and one broadcast
// multiply-add per (row, dim)), then one softmax step per row over the chunk, then the weighted
// sum of V with the rows of a KV head sharing each V load. Reading a block prefetches the next,
// a head slice per key, spread over the work. Any other head_dim: run_item, plain loops with an
// online softmax per block.

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

// exp of 16 floats: 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2, e^r by its
// degree-6 Taylor polynomial (relative error < 2e-7). Inputs below -87 give ~1e-38, not 0 (the
// scores here are s - max <= 0, and a weight of 1e-38 is 0 to every sum it enters).
inline v16 exp16(v16 x) {
  typedef int32_t i16 __attribute__((vector_size(64)));
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

// The online-softmax step of one row over n new scores in s: s becomes the weights
// exp(s - new max), m and l move on, and the factor that rescales the row's accumulator is
// returned (0 on the first block, where m = -1e30).
inline float softmax_update(float* s, int n, float& m, float& l) {
  float mx = m;
  int j = 0;
  if (n >= 16) {
    v16 vm = load16(s);
    for (j = 16; j + 16 <= n; j += 16) {
      const v16 x = load16(s + j);
      vm = x > vm ? x : vm;
    }
    for (int u = 0; u < 16; ++u) mx = std::max(mx, vm[u]);
  }
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  v16 vsum = v16{};
  for (j = 0; j + 16 <= n; j += 16) {
    const v16 e = exp16(load16(s + j) - mx);
    store16(s + j, e);
    vsum += e;
  }
  if (j < n) {  // the tail through a padded vector: lanes past n get exp(-87) and are dropped
    v16 t = v16{} - 1e30f;
    for (int u = 0; u < n - j; ++u) t[u] = s[j + u];
    const v16 e = exp16(t - mx);
    for (int u = 0; u < n - j; ++u) {
      s[j + u] = e[u];
      vsum[u] += e[u];
    }
  }
  const float corr = exp16(v16{} + (m - mx))[0];
  m = mx;
  l = l * corr + hsum(vsum);
  return corr;
}

constexpr int TILE = 16;          // query tokens per work item
constexpr int TRANSPOSE_ROWS = 8; // rows per KV head from which transposing a K block pays off

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
  // Rotary embedding (neox: halves rotated) of query token t: cos/sin [num_tokens, D / 2]
  // rows; null = the query arrives rotated.
  const float* cos; const float* sin;
};

// Row `src` (D floats) into dst: rotated by the token's cos/sin rows when given, times scale.
inline void load_row(const float* src, const float* cs, const float* sn, int D, float scale,
                     float* dst) {
  if (!cs) {
    for (int d = 0; d < D; ++d) dst[d] = src[d] * scale;
    return;
  }
  const int half = D / 2;
  for (int d = 0; d < half; ++d) {
    const float x1 = src[d], x2 = src[d + half];
    dst[d] = (x1 * cs[d] - x2 * sn[d]) * scale;
    dst[d + half] = (x2 * cs[d] + x1 * sn[d]) * scale;
  }
}


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
      const int64_t tok = it.t0 + t;
      const float* src = a.q + tok * a.q_stride_t + (int64_t)h * a.q_stride_h;
      load_row(src, a.cos ? a.cos + tok * (D / 2) : nullptr, a.sin ? a.sin + tok * (D / 2) : nullptr,
               D, a.scale, qr + (size_t)r * D);
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
      const float* kb = a.k_cache + block_base + (int64_t)(g - it.g0) * D;
      const float* vb = a.v_cache + block_base + (int64_t)(g - it.g0) * D;
      for (int t = 0; t < ntok; ++t) {
        const int n = std::min(keys, pos0 + t + 1 - b * BS);  // causal: keys up to its position
        if (n <= 0) continue;
        for (int j = 0; j < G; ++j) {
          const int r = t * per_tok + (g - it.g0) * G + j;
          const float* q = qr + (size_t)r * D;
          float* s = sc + (size_t)r * BS;
          float* o = acc + (size_t)r * D;
          for (int k = 0; k < n; ++k) {
            const float* kk = kb + k * tok_stride;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; ++d) dot += q[d] * kk[d];
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

// ---- The vectorised path, head_dim = 16 * DV ------------------------------------------------
//
// An item's rows are grouped by KV head (r = head * rows_per_head + t * G + j), so the rows of
// a head share each K and V block. Keys are taken in chunks of up to 32 blocks: the scores of
// every row for the whole chunk first, then one softmax step per row over the chunk (vector
// max, exp and sum; the accumulator rescaled once per chunk, not per block), then the weighted
// sum of V. A decode's chunk is usually its whole context, i.e. a plain two-pass softmax.

constexpr int SCORE_FLOATS = 1 << 16;  // score scratch per item (rows x chunk keys): 256 KB

// In-place transpose of a 16 x 16 tile held as 16 vectors: four rounds that swap the
// off-diagonal h x h sub-blocks, h = 8, 4, 2, 1.
inline void transpose16(v16* r) {
#define LLMS_IDX(...) __VA_ARGS__
#define LLMS_ROUND(H, A, B)                                     \
  for (int i = 0; i < 16; ++i) {                                \
    if (i & H) continue;                                        \
    const v16 x = r[i], y = r[i + H];                           \
    r[i] = __builtin_shufflevector(x, y, A);                    \
    r[i + H] = __builtin_shufflevector(x, y, B);                \
  }
  LLMS_ROUND(8, LLMS_IDX(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
             LLMS_IDX(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
  LLMS_ROUND(4, LLMS_IDX(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
             LLMS_IDX(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
  LLMS_ROUND(2, LLMS_IDX(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
             LLMS_IDX(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
  LLMS_ROUND(1, LLMS_IDX(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
             LLMS_IDX(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#undef LLMS_ROUND
#undef LLMS_IDX
}

// Scores of n <= 16 keys for few rows (decodes): one dot product per (row, key), the 16 keys'
// partial sums reduced together. s has row stride ss.
template <int DV>
void scores_dot(const float* q, int rows, const float* kb, int64_t ts, int n, float* s, int ss,
                const float* next) {
  for (int i = 0; i < rows; ++i, q += 16 * DV, s += ss) {
    v16 qv[DV];
    for (int v = 0; v < DV; ++v) qv[v] = load16(q + 16 * v);
    if (n == 16) {
      v16 acc[16];
      for (int u = 0; u < 16; ++u) {
        const float* k = kb + u * ts;
        if (next && i == 0)
          for (int v = 0; v < DV; ++v) __builtin_prefetch(next + u * ts + 16 * v);
        acc[u] = qv[0] * load16(k);
        for (int v = 1; v < DV; ++v) acc[u] += qv[v] * load16(k + 16 * v);
      }
      store16(s, reduce16(acc));
      continue;
    }
    for (int u = 0; u < n; ++u) {
      const float* k = kb + u * ts;
      v16 acc = qv[0] * load16(k);
      for (int v = 1; v < DV; ++v) acc += qv[v] * load16(k + 16 * v);
      s[u] = hsum(acc);
    }
  }
}

// Scores of RB rows against a transposed block kt [16 * DV][16]: one broadcast multiply-add
// per (row, dim) over the 16 keys.
template <int DV, int RB>
void scores_t(const float* q, int rows, const float* kt, float* s, int ss) {
  int i = 0;
  for (; i + RB <= rows; i += RB) {
    v16 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = v16{};
    const float* qi = q + (size_t)i * 16 * DV;
    for (int d = 0; d < 16 * DV; ++d) {
      const v16 k = load16(kt + 16 * d);
      for (int r = 0; r < RB; ++r) acc[r] += qi[r * 16 * DV + d] * k;
    }
    for (int r = 0; r < RB; ++r) store16(s + (size_t)(i + r) * ss, acc[r]);
  }
  if constexpr (RB > 1)
    if (i < rows) scores_t<DV, RB - 1>(q + (size_t)i * 16 * DV, rows - i, kt, s + (size_t)i * ss, ss);
}

// acc[r] += sum over keys j < n of s[r][j] * V[j], RB rows at a time with their accumulators
// in registers (RB * DV <= 16 vectors).
template <int DV, int RB>
void weighted_v(const float* s, int rows, int ss, const float* vb, int64_t ts, int n, float* acc,
                const float* next) {
  int i = 0;
  for (; i + RB <= rows; i += RB, next = nullptr) {
    v16 o[RB][DV];
    float* ai = acc + (size_t)i * 16 * DV;
    for (int r = 0; r < RB; ++r)
      for (int v = 0; v < DV; ++v) o[r][v] = load16(ai + (r * DV + v) * 16);
    const float* si = s + (size_t)i * ss;
    for (int j = 0; j < n; ++j) {
      v16 vv[DV];
      for (int v = 0; v < DV; ++v) vv[v] = load16(vb + j * ts + 16 * v);
      if (next)
        for (int v = 0; v < DV; ++v) __builtin_prefetch(next + j * ts + 16 * v);
      for (int r = 0; r < RB; ++r) {
        const float p = si[(size_t)r * ss + j];
        for (int v = 0; v < DV; ++v) o[r][v] += p * vv[v];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int v = 0; v < DV; ++v) store16(ai + (r * DV + v) * 16, o[r][v]);
  }
  if constexpr (RB > 1)
    if (i < rows)
      weighted_v<DV, RB - 1>(s + (size_t)i * ss, rows - i, ss, vb, ts, n,
                             acc + (size_t)i * 16 * DV, next);
}

// One row's softmax step over its n visible scores of a chunk of nk: s[0, n) become weights
// exp(s - new max), s[n, nk) zero; m and l move on; returns the accumulator's rescale factor.
inline float chunk_softmax(float* s, int n, int nk, float& m, float& l) {
  const int n16 = n & ~15;
  v16 vm = v16{} - 1e30f;
  for (int j = 0; j < n16; j += 16) {
    const v16 x = load16(s + j);
    vm = x > vm ? x : vm;
  }
  float mx = m;
  for (int u = 0; u < 16; ++u) mx = std::max(mx, vm[u]);
  for (int j = n16; j < n; ++j) mx = std::max(mx, s[j]);
  v16 sum = v16{};
  for (int j = 0; j < n16; j += 16) {
    const v16 e = exp16(load16(s + j) - mx);
    store16(s + j, e);
    sum += e;
  }
  float tail = 0.0f;
  for (int j = n16; j < n; ++j) tail += (s[j] = std::exp(s[j] - mx));
  for (int j = n; j < nk; ++j) s[j] = 0.0f;
  const float corr = std::exp(m - mx);
  m = mx;
  l = l * corr + hsum(sum) + tail;
  return corr;
}

// The rows of one work item and where they attend: blocks [b0, b1) of `table`, keys below
// key_end; rows grouped by KV head (heads x per_head, heads from g0), row r at position pos[r]
// (it sees keys <= pos[r]). q rows are loaded (rotated, scaled); m, l, acc hold the softmax state
// the walk starts from and ends with.
struct Rows {
  const int32_t* table;
  int b0, b1, key_end;
  int heads, per_head, g0;
  const float* q; const int* pos;
  float* m; float* l; float* acc;
};

template <int DV>
void attend_rows(const Args& a, const Rows& w, std::vector<float>& buf) {
  constexpr int D = 16 * DV;
  constexpr int RB_S = 8, RB_V = 16 / DV > 8 ? 8 : 16 / DV;
  const int BS = a.BS, rows = w.heads * w.per_head;
  if (w.b0 >= w.b1 || rows == 0) return;
  const int chunk = std::max(1, std::min(32, SCORE_FLOATS / (rows * BS)));  // blocks
  const int ss = chunk * BS + 16;  // score row stride: a block of < 16 keys still stores 16
  const int64_t ts = (int64_t)a.KVH * D;
  buf.resize((size_t)rows * ss + (size_t)D * 16);
  float* sc = buf.data();
  float* kt = sc + (size_t)rows * ss;
  const bool transpose = w.per_head >= TRANSPOSE_ROWS;
  const int64_t head0 = (int64_t)w.g0 * D;
  for (int c0 = w.b0; c0 < w.b1; c0 += chunk) {
    const int c1 = std::min(w.b1, c0 + chunk), key0 = c0 * BS;
    const int nk = std::min(c1 * BS, w.key_end) - key0;
    for (int b = c0; b < c1; ++b) {
      const int keys = std::min(BS, w.key_end - b * BS);
      const float* kb = a.k_cache + (int64_t)w.table[b] * BS * ts + head0;
      // What this block's reads prefetch, a head slice per key: the next K block, and after
      // the chunk's last one the chunk's first V block (where the weighted sum starts).
      const float* kn = (b + 1 < c1 ? a.k_cache + (int64_t)w.table[b + 1] * BS * ts
                                    : a.v_cache + (int64_t)w.table[c0] * BS * ts) + head0;
      for (int hl = 0; hl < w.heads; ++hl)
        for (int k0 = 0; k0 < keys; k0 += 16) {  // 16 keys at a time (block_size may be 32)
          const int n = std::min(16, keys - k0);
          const float* kk = kb + hl * D + k0 * ts;
          const float* q = w.q + (size_t)hl * w.per_head * D;
          float* s = sc + (size_t)hl * w.per_head * ss + (b - c0) * BS + k0;
          if (!transpose) {
            scores_dot<DV>(q, w.per_head, kk, ts, n, s, ss, kn + hl * D + k0 * ts);
            continue;
          }
          for (int c = 0; c < DV; ++c) {
            v16 tile[16];
            for (int u = 0; u < 16; ++u) tile[u] = u < n ? load16(kk + u * ts + 16 * c) : v16{};
            transpose16(tile);
            for (int e = 0; e < 16; ++e) store16(kt + (16 * c + e) * 16, tile[e]);
          }
          scores_t<DV, RB_S>(q, w.per_head, kt, s, ss);
        }
    }
    for (int r = 0; r < rows; ++r) {
      float* s = sc + (size_t)r * ss;
      const int n = std::min(nk, w.pos[r] + 1 - key0);  // causal
      if (n <= 0) {
        std::fill(s, s + nk, 0.0f);
        continue;
      }
      const v16 corr = v16{} + chunk_softmax(s, n, nk, w.m[r], w.l[r]);
      float* o = w.acc + (size_t)r * D;
      for (int v = 0; v < DV; ++v) store16(o + 16 * v, load16(o + 16 * v) * corr);
    }
    for (int b = c0; b < c1; ++b) {
      const int keys = std::min(BS, w.key_end - b * BS);
      const float* vb = a.v_cache + (int64_t)w.table[b] * BS * ts + head0;
      const float* vn = b + 1 < c1 ? a.v_cache + (int64_t)w.table[b + 1] * BS * ts + head0
                        : c1 < w.b1 ? a.k_cache + (int64_t)w.table[c1] * BS * ts + head0
                                    : nullptr;
      for (int hl = 0; hl < w.heads; ++hl, vb += D)
        weighted_v<DV, RB_V>(sc + (size_t)hl * w.per_head * ss + (b - c0) * BS, w.per_head, ss,
                             vb, ts, keys, w.acc + (size_t)hl * w.per_head * D,
                             vn ? vn + hl * D : nullptr);
    }
  }
}

// Softmax state of every (query token, head) after the shared prefix of its sequence's group;
// empty when the batch has no group (see find_groups).
struct Shared {
  std::vector<int> prefix_blocks;  // per sequence: leading blocks attended by its group
  std::vector<float> m, l, acc;    // per (token, head): [T * H], [T * H], [T * H * D]
};

// Per-item scratch: q rows, acc rows, m, l, positions.
struct ItemScratch {
  std::vector<float> f, buf;
  std::vector<int> pos;
};

template <int DV>
void run_item_vec(const Args& a, const Item& it, ItemScratch& sc, const Shared& sh) {
  constexpr int D = 16 * DV;
  const int G = a.H / a.KVH;
  const int heads = it.g1 - it.g0, ntok = it.t1 - it.t0;
  const int per_head = ntok * G, rows = heads * per_head;
  const int q_start = a.qsl[it.seq], q_len = a.qsl[it.seq + 1] - q_start;
  const int pos0 = a.seq_lens[it.seq] - q_len + (it.t0 - q_start);  // the item's first token
  const int prefix = sh.prefix_blocks.empty() ? 0 : sh.prefix_blocks[it.seq];
  sc.f.resize((size_t)rows * (2 * D + 2));
  sc.pos.resize(rows);
  float* qr = sc.f.data();
  float* acc = qr + (size_t)rows * D;
  float* m = acc + (size_t)rows * D;
  float* l = m + rows;
  for (int r = 0; r < rows; ++r) {
    const int hl = r / per_head, t = (r % per_head) / G, h = (it.g0 + hl) * G + r % G;
    const int64_t tok = it.t0 + t;
    const float* src = a.q + tok * a.q_stride_t + (int64_t)h * a.q_stride_h;
    load_row(src, a.cos ? a.cos + tok * (D / 2) : nullptr, a.sin ? a.sin + tok * (D / 2) : nullptr,
             D, a.scale, qr + (size_t)r * D);
    sc.pos[r] = pos0 + t;
    if (prefix > 0) {  // start from the state after the group's shared blocks
      const int64_t th = tok * a.H + h;
      m[r] = sh.m[th], l[r] = sh.l[th];
      std::copy_n(sh.acc.data() + th * D, D, acc + (size_t)r * D);
    } else {
      m[r] = -1e30f, l[r] = 0.0f;  // finite: the library is built with -ffast-math
      std::fill_n(acc + (size_t)r * D, D, 0.0f);
    }
  }
  const int last = pos0 + ntok - 1;
  const Rows w{a.block_tables + (int64_t)it.seq * a.bt_stride, prefix, last / a.BS + 1, last + 1,
               heads, per_head, it.g0, qr, sc.pos.data(), m, l, acc};
  attend_rows<DV>(a, w, sc.buf);
  for (int r = 0; r < rows; ++r) {
    const int hl = r / per_head, t = (r % per_head) / G, h = (it.g0 + hl) * G + r % G;
    float* dst = a.out + ((int64_t)(it.t0 + t) * a.H + h) * D;
    const v16 inv = v16{} + 1.0f / l[r];
    for (int v = 0; v < DV; ++v) store16(dst + 16 * v, load16(acc + (size_t)r * D + 16 * v) * inv);
  }
}

// A group: sequences whose block tables start with the same `blocks` blocks, all of whose query
// rows see all of them. Its rows for one KV head, tiled, attend to those blocks once for the
// whole group (many rows: the transposed-K path), and each sequence's own items then start
// after them from the saved state: a shared system prompt is read once per tile, not once per
// sequence, and its scores are computed at the many-row rate.
struct Group {
  std::vector<int> seqs;
  int blocks;
};

constexpr int MIN_SHARED_BLOCKS = 4;
constexpr int GROUP_TILE_TOKENS = 48;  // query tokens per group work item (x G rows)

std::vector<Group> find_groups(const Args& a, int num_seqs) {
  std::vector<Group> groups;
  std::vector<char> used(num_seqs, 0);
  for (int i = 0; i < num_seqs; ++i) {
    if (used[i]) continue;
    const int32_t* ti = a.block_tables + (int64_t)i * a.bt_stride;
    const int q_len_i = a.qsl[i + 1] - a.qsl[i];
    int blocks = (a.seq_lens[i] - q_len_i + 1) / a.BS;  // full blocks every row of i sees
    Group g{{i}, blocks};
    for (int j = i + 1; j < num_seqs && blocks >= MIN_SHARED_BLOCKS; ++j) {
      const int32_t* tj = a.block_tables + (int64_t)j * a.bt_stride;
      if (used[j] || tj[0] != ti[0]) continue;
      const int q_len_j = a.qsl[j + 1] - a.qsl[j];
      int n = std::min(blocks, (a.seq_lens[j] - q_len_j + 1) / a.BS);
      int k = 1;
      while (k < n && tj[k] == ti[k]) ++k;
      if (k < MIN_SHARED_BLOCKS) continue;
      g.seqs.push_back(j);
      g.blocks = std::min(g.blocks, k);
    }
    if (g.seqs.size() < 2 || g.blocks < MIN_SHARED_BLOCKS) continue;
    for (int s : g.seqs) used[s] = 1;
    groups.push_back(std::move(g));
  }
  return groups;
}

struct GroupItem {
  int group, g;     // group, KV head
  int tok0, tok1;   // range in the group's token list
};

// A group item's rows (its tokens x the query heads of KV head g) over the shared blocks; the
// state goes to sh.m/l/acc at each (token, head).
template <int DV>
void run_group_item(const Args& a, const Group& grp, const std::vector<int>& toks,
                    const GroupItem& gi, ItemScratch& sc, Shared& sh) {
  constexpr int D = 16 * DV;
  const int G = a.H / a.KVH, ntok = gi.tok1 - gi.tok0, rows = ntok * G;
  sc.f.resize((size_t)rows * (2 * D + 2));
  sc.pos.assign(rows, 1 << 30);  // every row sees every shared key
  float* qr = sc.f.data();
  float* acc = qr + (size_t)rows * D;
  float* m = acc + (size_t)rows * D;
  float* l = m + rows;
  for (int r = 0; r < rows; ++r) {
    const int64_t tok = toks[gi.tok0 + r / G];
    const int h = gi.g * G + r % G;
    load_row(a.q + tok * a.q_stride_t + (int64_t)h * a.q_stride_h,
             a.cos ? a.cos + tok * (D / 2) : nullptr, a.sin ? a.sin + tok * (D / 2) : nullptr, D,
             a.scale, qr + (size_t)r * D);
    m[r] = -1e30f, l[r] = 0.0f;
    std::fill_n(acc + (size_t)r * D, D, 0.0f);
  }
  const Rows w{a.block_tables + (int64_t)grp.seqs[0] * a.bt_stride, 0, grp.blocks,
               grp.blocks * a.BS, 1, rows, gi.g, qr, sc.pos.data(), m, l, acc};
  attend_rows<DV>(a, w, sc.buf);
  for (int r = 0; r < rows; ++r) {
    const int64_t th = (int64_t)toks[gi.tok0 + r / G] * a.H + gi.g * G + r % G;
    sh.m[th] = m[r], sh.l[th] = l[r];
    std::copy_n(acc + (size_t)r * D, D, sh.acc.data() + th * D);
  }
}

// Both phases for head_dim 16 * DV: the groups' shared prefixes, then every item.
template <int DV>
void run_all_vec(const Args& a, int num_seqs, int num_tokens, const std::vector<Item>& items,
                 int num_threads) {
  Shared sh;
  const std::vector<Group> groups = find_groups(a, num_seqs);
  std::vector<std::vector<int>> toks(groups.size());
  std::vector<GroupItem> gitems;
  if (!groups.empty()) {
    sh.prefix_blocks.assign(num_seqs, 0);
    sh.m.resize((size_t)num_tokens * a.H);
    sh.l.resize((size_t)num_tokens * a.H);
    sh.acc.resize((size_t)num_tokens * a.H * 16 * DV);
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      for (int s : groups[gi].seqs) {
        sh.prefix_blocks[s] = groups[gi].blocks;
        for (int t = a.qsl[s]; t < a.qsl[s + 1]; ++t) toks[gi].push_back(t);
      }
      const int n = (int)toks[gi].size();
      for (int g = 0; g < a.KVH; ++g)
        for (int t0 = 0; t0 < n; t0 += GROUP_TILE_TOKENS)
          gitems.push_back({(int)gi, g, t0, std::min(n, t0 + GROUP_TILE_TOKENS)});
    }
  }
  const int ng = (int)gitems.size(), n = (int)items.size();
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    ItemScratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int k = 0; k < ng; ++k)
      run_group_item<DV>(a, groups[gitems[k].group], toks[gitems[k].group], gitems[k], sc, sh);
#pragma omp for schedule(dynamic, 1)
    for (int k = 0; k < n; ++k) run_item_vec<DV>(a, items[k], sc, sh);
  }
}

// The generic path for any head_dim, item by item.
void run_all_generic(const Args& a, const std::vector<Item>& items, int num_threads) {
  const int n = (int)items.size();
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int k = 0; k < n; ++k) run_item(a, items[k], buf);
  }
}

}  // namespace

// The attention of one layer over the paged cache. When num_new > 0 it first stores the step's
// new K/V rows (k_new, v_new: [num_new, KVH, D], row strides given, heads contiguous) at their
// slots (-1 = skip), K rotated by cos/sin when those are given; the query is rotated by the
// same rows, so a layer's rope, K/V write and attention are this one call.
extern "C" int llmserve_paged_attention_f32(
    const float* q, int64_t q_stride_t, int64_t q_stride_h,
    const float* k_cache, const float* v_cache,
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
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && num_new > 256)
  for (int t = 0; t < num_new; ++t) {
    if (slots[t] < 0) continue;
    float* kd = const_cast<float*>(k_cache) + slots[t] * kv_row;
    float* vd = const_cast<float*>(v_cache) + slots[t] * kv_row;
    for (int g = 0; g < num_kv_heads; ++g)
      load_row(k_new + t * k_stride_t + (int64_t)g * head_dim, cos ? cos + (int64_t)t * (head_dim / 2) : nullptr,
               sin ? sin + (int64_t)t * (head_dim / 2) : nullptr, head_dim, 1.0f, kd + (int64_t)g * head_dim);
    __builtin_memcpy(vd, v_new + t * v_stride_t, sizeof(float) * kv_row);
  }
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
      if (split_heads)
        for (int g = 0; g < num_kv_heads; ++g) items.push_back({i, t0, t1, g, g + 1});
      else
        items.push_back({i, t0, t1, 0, num_kv_heads});
    }
  }
  const int num_tokens = query_start_loc[num_seqs];
  switch (head_dim) {
    case 32: run_all_vec<2>(a, num_seqs, num_tokens, items, num_threads); break;
    case 48: run_all_vec<3>(a, num_seqs, num_tokens, items, num_threads); break;
    case 64: run_all_vec<4>(a, num_seqs, num_tokens, items, num_threads); break;
    case 80: run_all_vec<5>(a, num_seqs, num_tokens, items, num_threads); break;
    case 96: run_all_vec<6>(a, num_seqs, num_tokens, items, num_threads); break;
    case 128: run_all_vec<8>(a, num_seqs, num_tokens, items, num_threads); break;
    default: run_all_generic(a, items, num_threads);  // plain loops for any other head_dim
  }
  return 0;
}
