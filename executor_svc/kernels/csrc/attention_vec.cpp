// The vectorised paged-attention path (head_dim = 16 * DV) and shared-prefix groups; see
// paged_attention.cpp for the layout and the work items.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "simd.h"

namespace llmserve {
namespace {

// An item's rows are grouped by KV head (r = head * rows_per_head + t * G + j), so the rows of
// a head share each K and V block. Keys are taken in chunks of CHUNK_KEYS: the scores of every
// row for the whole chunk first, then one softmax step per row over the chunk (vector max, exp
// and sum; the accumulator rescaled once per chunk, not per block), then the weighted sum of V.
//
// Step invariance (docs/internals.md): a row's result depends only on its query, its position
// and the cache, never on the other rows of its step. So every row takes the same arithmetic in
// the same order: one score formula (scores_dot) whatever the number of rows, chunks that start
// at fixed key multiples (not sized by the rows' scratch), keys past a row's position weighted
// by an exact 0, and shared-prefix groups that end on a chunk boundary.

#if !defined(LLMSERVE_AVX2_PATHS)
// A score's 16 lane partials over head_dim 16 * DV: lane j sums q[16v + j] * k[16v + j] over v
// ascending, fma(q0, k0, q1 * k1) first and then one multiply-add per term (the chain GCC
// contracted this loop's plain `acc = q0 * k0; acc += q1 * k1 ...` to; written with explicit
// FMAs so that no contraction choice is left and attention_rows.h can give the same bits).
template <int DV>
inline v16 lane_chain(const v16* qv, const kv_t* k) {
  if constexpr (DV == 1) return qv[0] * load_kv16(k);
  v16 acc = fma16(qv[0], load_kv16(k), qv[1] * load_kv16(k + 16));
  for (int v = 2; v < DV; ++v) acc = fma16(qv[v], load_kv16(k + 16 * v), acc);
  return acc;
}

// Scores of n <= 16 keys for few rows (decodes): one dot product per (row, key), the 16 keys'
// partial sums reduced together. s has row stride ss.
template <int DV>
void scores_dot(const float* q, int rows, const kv_t* kb, int64_t ts, int n, float* s, int ss,
                const kv_t* next) {
  for (int i = 0; i < rows; ++i, q += 16 * DV, s += ss) {
    v16 qv[DV];
    for (int v = 0; v < DV; ++v) qv[v] = load16(q + 16 * v);
    if (n == 16) {
      v16 acc[16];
      for (int u = 0; u < 16; ++u) {
        const kv_t* k = kb + u * ts;
        if (next && i == 0)
          for (int v = 0; v < DV; ++v) __builtin_prefetch(next + u * ts + 16 * v);
        acc[u] = lane_chain<DV>(qv, k);
      }
      store16(s, reduce16(acc));
      continue;
    }
    for (int u = 0; u < n; ++u) s[u] = hsum(lane_chain<DV>(qv, kb + u * ts));
  }
}

// acc[r] += sum over keys j < n of s[r * ss + j * ks] * V[j], RB rows at a time with their
// accumulators in registers (RB * DV <= 16 vectors).
template <int DV, int RB>
void weighted_v(const float* s, int rows, int ss, int ks, const kv_t* vb, int64_t ts, int n,
                float* acc, const kv_t* next) {
  int i = 0;
  for (; i + RB <= rows; i += RB, next = nullptr) {
    v16 o[RB][DV];
    float* ai = acc + (size_t)i * 16 * DV;
    for (int r = 0; r < RB; ++r)
      for (int v = 0; v < DV; ++v) o[r][v] = load16(ai + (r * DV + v) * 16);
    const float* si = s + (size_t)i * ss;
    for (int j = 0; j < n; ++j) {
      v16 vv[DV];
      for (int v = 0; v < DV; ++v) vv[v] = load_kv16(vb + j * ts + 16 * v);
      if (next)
        for (int v = 0; v < DV; ++v) __builtin_prefetch(next + j * ts + 16 * v);
      for (int r = 0; r < RB; ++r) {
        const float p = si[(size_t)r * ss + (size_t)j * ks];
        for (int v = 0; v < DV; ++v) o[r][v] += p * vv[v];
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int v = 0; v < DV; ++v) store16(ai + (r * DV + v) * 16, o[r][v]);
  }
  if constexpr (RB > 1)
    if (i < rows)
      weighted_v<DV, RB - 1>(s + (size_t)i * ss, rows - i, ss, ks, vb, ts, n,
                             acc + (size_t)i * 16 * DV, next);
}
#else
#include "attention_avx2.h"
#endif

// One row's softmax step over its n visible scores of a chunk of nk: s[0, n) become weights
// exp(s - new max), s[n, nk) zero; m and l move on; returns the accumulator's rescale factor.
inline float chunk_softmax(float* s, int n, int nk, float& m, float& l) {
  const float corr = softmax_update(s, n, m, l);
  std::fill(s + n, s + nk, 0.0f);
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
  // The item this thread walks next (its blocks [next_b0, next_b1) of next_table, KV heads
  // from next_g0; none: null), whose first blocks are fetched while this walk ends.
  const int32_t* next_table = nullptr;
  int next_b0 = 0, next_b1 = 0, next_g0 = 0;
};

// Blocks per chunk: CHUNK_KEYS keys (a whole number of blocks, at least one). Fixed per block
// size, so a chunk boundary is the same key for a decode, a prefill and a group.
inline int chunk_blocks(int BS) { return std::max(1, CHUNK_KEYS / BS); }

// Blocks a walk reads ahead of the one in hand, towards L2 (the next block's prefetches in
// scores and weigh then find it there). Measured on a Zen 4 core, 64 decodes x 193 keys over
// 30 layers' bf16 caches (docs/benchmarks.md, "bf16 decode attention"): 36-39 ms without,
// 25-27 ms with 2 to 6 blocks ahead into L2; into L1 (2 or 3 ahead) slower than none.
constexpr int AHEAD_BLOCKS = 4;

// The blocks of a walk in the order it reads them, one chunk after the other: the chunk's K
// blocks, then its V blocks; then those of the walk after it (Rows::next_*), if any.
struct BlockOrder {
  const Args& a;
  const int32_t* table;
  int b0, b1, g0, c0, c1, b;
  bool v = false;  // in the chunk's V blocks
  BlockOrder(const Args& args, const int32_t* t, int first, int end, int head0)
      : a(args), table(t), b0(first), b1(end), g0(head0), c0(first), b(first) {
    c1 = std::min(b1, (c0 / chunk_blocks(a.BS) + 1) * chunk_blocks(a.BS));
  }
  bool done() const { return !table || c0 >= b1; }
  const kv_t* block() const {
    const int64_t ts = (int64_t)a.KVH * a.D;
    return (v ? a.v_cache : a.k_cache) + (int64_t)table[b] * a.BS * ts + (int64_t)g0 * a.D;
  }
  void next() {
    if (++b < c1) return;
    b = c0;
    if (!v) {
      v = true;
      return;
    }
    v = false;
    c0 = b = c1;
    c1 = std::min(b1, (c0 / chunk_blocks(a.BS) + 1) * chunk_blocks(a.BS));
  }
};

// The walk over a work item's chunks that both layouts share. Chunks start at multiples of
// `chunk` blocks counted from block 0, whatever b0 is (a group's rows continue at b0 = a
// multiple of chunk, see find_groups). Per chunk: scores(i, keys, kb, kn) for its i-th block
// (K at kb, this head group's slice; kn: what its reads prefetch, the next K block and after
// the chunk's last one the chunk's first V block, where the weighted sum starts), then
// softmax(key0, nk) over its nk keys from key0, then weigh(i, keys, vb, vn) for each block's V
// (vn: the next V block, or the next chunk's first K block). Before each block, the one
// AHEAD_BLOCKS further in the reading order goes towards L2 (not when `far` is false: the
// many-row walks, whose work per block hides the latency). Prefetches only: what is computed,
// and in which order, is the same with or without them.
template <class Scores, class Softmax, class Weigh>
inline void walk_chunks(const Args& a, const Rows& w, Scores&& scores, Softmax&& softmax,
                        Weigh&& weigh, bool far = true) {
  const int BS = a.BS, chunk = chunk_blocks(BS);
  const int64_t ts = (int64_t)a.KVH * a.D, head0 = (int64_t)w.g0 * a.D;
  const auto block = [&](const kv_t* cache, int b) {
    return cache + (int64_t)w.table[b] * BS * ts + head0;
  };
  BlockOrder later(a, w.table, w.b0, w.b1, w.g0);
  BlockOrder after(a, w.next_table, w.next_b0, w.next_b1, w.next_g0);
  for (int i = 0; i < AHEAD_BLOCKS && !later.done(); ++i) later.next();
  const int64_t key_bytes = (int64_t)w.heads * a.D * sizeof(kv_t);
  const auto ahead = [&]() {
    if (!far) return;
    BlockOrder& o = later.done() ? after : later;
    if (o.done()) return;
    const char* p = (const char*)o.block();
    if (w.heads == a.KVH) {  // the block's keys are one run of memory
      for (int64_t off = 0; off < BS * key_bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
    } else {
      for (int u = 0; u < BS; ++u)
        for (int64_t off = 0; off < key_bytes; off += 64)
          __builtin_prefetch(p + u * ts * (int64_t)sizeof(kv_t) + off, 0, 2);
    }
    o.next();
  };
  for (int c0 = w.b0; c0 < w.b1; c0 = (c0 / chunk + 1) * chunk) {
    const int c1 = std::min(w.b1, (c0 / chunk + 1) * chunk), key0 = c0 * BS;
    for (int b = c0; b < c1; ++b) {
      ahead();
      scores(b - c0, std::min(BS, w.key_end - b * BS), block(a.k_cache, b),
             b + 1 < c1 ? block(a.k_cache, b + 1) : block(a.v_cache, c0));
    }
    softmax(key0, std::min(c1 * BS, w.key_end) - key0);
    for (int b = c0; b < c1; ++b) {
      ahead();
      weigh(b - c0, std::min(BS, w.key_end - b * BS), block(a.v_cache, b),
            b + 1 < c1 ? block(a.v_cache, b + 1) : c1 < w.b1 ? block(a.k_cache, c1) : nullptr);
    }
  }
}

// Rows per weighted-sum tile (weighted_v's RB), their accumulators in registers.
#if defined(LLMSERVE_AVX2_PATHS)
template <int DV>
constexpr int RB_V = 6;  // 12 ymm accumulators
#else
template <int DV>
constexpr int RB_V = 16 / DV > 8 ? 8 : 16 / DV;
#endif

#if !defined(LLMSERVE_AVX2_PATHS)
// Rows per KV head from which a walk takes attend_lanes (16 rows to a vector).
constexpr int LANES_MIN_ROWS = 16;
#include "attention_rows.h"
#endif

template <int DV>
void attend_rows(const Args& a, const Rows& w, std::vector<float>& buf) {
  const int BS = a.BS, rows = w.heads * w.per_head;
  if (w.b0 >= w.b1 || rows == 0) return;
#if !defined(LLMSERVE_AVX2_PATHS)
  if (w.per_head >= LANES_MIN_ROWS) return attend_lanes<DV>(a, w, buf);
#endif
  constexpr int D = 16 * DV;
  const int ss = chunk_blocks(BS) * BS + 16;  // score row stride: < 16 keys still store 16
  const int64_t ts = (int64_t)a.KVH * D;
  buf.resize((size_t)rows * ss);
  float* sc = buf.data();
  const auto scores = [&](int i, int keys, const kv_t* kb, const kv_t* kn) {
    for (int hl = 0; hl < w.heads; ++hl)
      for (int k0 = 0; k0 < keys; k0 += 16)  // 16 keys at a time (block_size may be 32)
        scores_dot<DV>(w.q + (size_t)hl * w.per_head * D, w.per_head, kb + hl * D + k0 * ts, ts,
                       std::min(16, keys - k0), sc + (size_t)hl * w.per_head * ss + i * BS + k0,
                       ss, kn + hl * D + k0 * ts);
  };
  const auto softmax = [&](int key0, int nk) {
    for (int r = 0; r < rows; ++r) {
      float* s = sc + (size_t)r * ss;
      const int n = std::min(nk, w.pos[r] + 1 - key0);  // causal
      if (n <= 0) {
        std::fill(s, s + nk, 0.0f);
        continue;
      }
      float* o = w.acc + (size_t)r * D;
#if defined(LLMSERVE_AVX2_PATHS)
      const float corr = chunk_softmax(s, n, nk, w.m[r], w.l[r]);
      for (int d = 0; d < D; ++d) o[d] *= corr;
#else
      const v16 corr = v16{} + chunk_softmax(s, n, nk, w.m[r], w.l[r]);
      for (int v = 0; v < DV; ++v) store16(o + 16 * v, load16(o + 16 * v) * corr);
#endif
    }
  };
  const auto weigh = [&](int i, int keys, const kv_t* vb, const kv_t* vn) {
    for (int hl = 0; hl < w.heads; ++hl, vb += D)
      weighted_v<DV, RB_V<DV>>(sc + (size_t)hl * w.per_head * ss + i * BS, w.per_head, ss, 1,
                               vb, ts, keys, w.acc + (size_t)hl * w.per_head * D,
                               vn ? vn + hl * D : nullptr);
  };
  walk_chunks(a, w, scores, softmax, weigh);
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
void run_item_vec(const Args& a, const Item& it, ItemScratch& sc, const Shared& sh,
                  const Item* next) {
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
    load_query(a, tok, h, qr + (size_t)r * D);
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
  Rows w{a.block_tables + (int64_t)it.seq * a.bt_stride, prefix, last / a.BS + 1, last + 1,
         heads, per_head, it.g0, qr, sc.pos.data(), m, l, acc};
  if (next) {  // where its walk starts: after its group's blocks, up to its last token's block
    const int nq0 = a.qsl[next->seq], nq = a.qsl[next->seq + 1] - nq0;
    const int nlast = a.seq_lens[next->seq] - nq + (next->t1 - 1 - nq0);
    w.next_table = a.block_tables + (int64_t)next->seq * a.bt_stride;
    w.next_b0 = sh.prefix_blocks.empty() ? 0 : sh.prefix_blocks[next->seq];
    w.next_b1 = nlast / a.BS + 1;
    w.next_g0 = next->g0;
  }
  attend_rows<DV>(a, w, sc.buf);
  for (int r = 0; r < rows; ++r) {
    const int hl = r / per_head, t = (r % per_head) / G, h = (it.g0 + hl) * G + r % G;
    float* dst = a.out + ((int64_t)(it.t0 + t) * a.H + h) * D;
#if defined(LLMSERVE_AVX2_PATHS)
    const float inv = 1.0f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = acc[(size_t)r * D + d] * inv;
#else
    const v16 inv = v16{} + 1.0f / l[r];
    for (int v = 0; v < DV; ++v) store16(dst + 16 * v, load16(acc + (size_t)r * D + 16 * v) * inv);
#endif
  }
}

// A group: sequences whose block tables start with the same `blocks` blocks, all of whose query
// rows see all of them. Its rows for one KV head, tiled, attend to those blocks once for the
// whole group, and each sequence's own items then start
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
    // The shared part ends on a chunk boundary, so each member continues with the chunks it
    // would have taken alone.
    const int chunk = chunk_blocks(a.BS);
    g.blocks -= g.blocks % chunk;
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
    load_query(a, tok, h, qr + (size_t)r * D);
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
void run_all_dv(const Args& a, int num_seqs, int num_tokens, const std::vector<Item>& items,
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
  std::atomic<int> next_item{0};
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    FlushMode mode;  // this thread's share (simd.h)
    ItemScratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int k = 0; k < ng; ++k)
      run_group_item<DV>(a, groups[gitems[k].group], toks[gitems[k].group], gitems[k], sc, sh);
    // Items one at a time, as omp's dynamic schedule hands them out, but each thread claims
    // its next item before it runs the one in hand, so that the walk can fetch the next one's
    // first blocks while it ends. Which thread runs an item changes nothing in its rows.
    int k = next_item++;
    while (k < n) {
      const int after = next_item++;
      run_item_vec<DV>(a, items[k], sc, sh, after < n ? &items[after] : nullptr);
      k = after;
    }
  }
}

}  // namespace

bool run_all_vec(const Args& a, int num_seqs, int num_tokens, const std::vector<Item>& items,
                 int num_threads) {
  switch (a.D) {
    case 32: run_all_dv<2>(a, num_seqs, num_tokens, items, num_threads); return true;
    case 48: run_all_dv<3>(a, num_seqs, num_tokens, items, num_threads); return true;
    case 64: run_all_dv<4>(a, num_seqs, num_tokens, items, num_threads); return true;
    case 80: run_all_dv<5>(a, num_seqs, num_tokens, items, num_threads); return true;
    case 96: run_all_dv<6>(a, num_seqs, num_tokens, items, num_threads); return true;
    case 128: run_all_dv<8>(a, num_seqs, num_tokens, items, num_threads); return true;
    default: return false;
  }
}

}  // namespace llmserve
