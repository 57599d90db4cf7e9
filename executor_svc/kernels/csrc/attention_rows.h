// The rows-in-lanes walk of attention_vec.cpp for prefill tiles and shared-prefix groups (many
// query rows per KV head): 16 rows of one head share each vector, lane r = row r. Included by
// attention_vec.cpp inside its namespace, after lane_chain, weighted_v, walk_chunks and RB_V.
//
// Same bits as attend_rows' row-by-row walk (step invariance, docs/internals.md): a score is
// lane_chain's 16 lane partials summed in reduce16's order; the softmax takes each row's max,
// exp and sum of its visible keys in chunk_softmax's order; the weighted sum is weighted_v on
// the same weights. What differs is only which lanes hold what: a key's 16 partials are 16
// vectors over rows, so reduce16's tree is plain vector adds (no shuffles), and the softmax
// runs 16 rows in parallel instead of one row's chain of scalar steps at a time.
#pragma once

// The same chains for 16 rows at once and KT keys: p[u] = partial j of key u, lane r = row r
// (qt: the 16 rows' queries transposed, [D][16]; each query vector loaded once for the keys).
template <int DV, int KT>
[[gnu::always_inline]] inline void chains_rows(const float* qt, const float* const* k, int j,
                                               v16* p) {
  v16 q[DV];
  for (int v = 0; v < DV; ++v) q[v] = load16(qt + (16 * v + j) * 16);
#pragma GCC unroll 8
  for (int u = 0; u < KT; ++u) {
    if constexpr (DV == 1) {
      p[u] = q[0] * (v16{} + k[u][j]);
    } else {
      p[u] = fma16(q[0], v16{} + k[u][j], q[1] * (v16{} + k[u][16 + j]));
      for (int v = 2; v < DV; ++v) p[u] = fma16(q[v], v16{} + k[u][16 * v + j], p[u]);
    }
  }
}

// (partial j + partial j + 8) + (partial j + 4 + partial j + 12) for KT keys.
template <int DV, int KT>
[[gnu::always_inline]] inline void quad_rows(const float* qt, const float* const* k, int j,
                                             v16* out) {
  v16 a[KT], b[KT];
  chains_rows<DV, KT>(qt, k, j, a);
  chains_rows<DV, KT>(qt, k, j + 8, b);
#pragma GCC unroll 8
  for (int u = 0; u < KT; ++u) a[u] += b[u];
  chains_rows<DV, KT>(qt, k, j + 4, b);
  chains_rows<DV, KT>(qt, k, j + 12, out);
#pragma GCC unroll 8
  for (int u = 0; u < KT; ++u) out[u] = a[u] + (b[u] + out[u]);
}

// KT keys' scores for 16 rows: each key's 16 lane partials summed in reduce16's (and hsum's)
// order, ((p0 + p8) + (p4 + p12)) + ((p2 + p10) + (p6 + p14)) for the even half, the same for
// the odd one, the halves added last.
template <int DV, int KT>
[[gnu::always_inline]] inline void keys_rows(const float* qt, const float* k, int64_t ks,
                                             v16* out) {
  const float* kp[KT];
  for (int u = 0; u < KT; ++u) kp[u] = k + u * ks;
  v16 even[KT], x[KT];
  quad_rows<DV, KT>(qt, kp, 0, even);
  quad_rows<DV, KT>(qt, kp, 2, x);
#pragma GCC unroll 8
  for (int u = 0; u < KT; ++u) even[u] += x[u];
  quad_rows<DV, KT>(qt, kp, 1, out);
  quad_rows<DV, KT>(qt, kp, 3, x);
#pragma GCC unroll 8
  for (int u = 0; u < KT; ++u) out[u] = even[u] + (out[u] + x[u]);
}

// Scores of n <= 16 keys for the rows of one head: key u of row r to s[u * rp + r]. qt holds
// the rows' queries by tiles of 16 rows, each tile transposed ([D][16]; rp = rows rounded up to
// 16, the last tile padded with zero rows).
template <int DV>
void scores_rows(const float* qt, int rp, const kv_t* kb, int64_t ts, int n, float* s,
                 const kv_t* next) {
  constexpr int D = 16 * DV, KT = 4;  // keys per register tile
#if defined(LLMSERVE_KV_BF16)
  alignas(64) float kf[16 * D];  // the keys widened once for every row tile
  for (int u = 0; u < n; ++u)
    for (int v = 0; v < DV; ++v) store16(kf + u * D + 16 * v, load_kv16(kb + u * ts + 16 * v));
  const float* k = kf;
  const int64_t ks = D;
#else
  const float* k = kb;
  const int64_t ks = ts;
#endif
  if (next)
    for (int u = 0; u < n; ++u)
      for (int v = 0; v < DV; ++v) __builtin_prefetch(next + u * ts + 16 * v);
  for (int r0 = 0; r0 < rp; r0 += 16) {
    const float* q = qt + (size_t)r0 * D;
    int u0 = 0;
    for (; u0 + KT <= n; u0 += KT) {
      // A compiler barrier: each key tile loads its query vectors again (from L1). Without it
      // GCC hoists all 16 * DV of them out of this loop and spills them to the stack.
      asm volatile("" ::: "memory");
      v16 out[KT];
      keys_rows<DV, KT>(q, k + u0 * ks, ks, out);
      for (int u = 0; u < KT; ++u) store16(s + (size_t)(u0 + u) * rp + r0, out[u]);
    }
    for (; u0 < n; ++u0) {
      v16 out[1];
      keys_rows<DV, 1>(q, k + u0 * ks, ks, out);
      store16(s + (size_t)u0 * rp + r0, out[0]);
    }
  }
}

// chunk_softmax for 16 rows (lane r = row r), lane by lane the same arithmetic: key j's scores
// at s[j * rp], nk keys; row r sees keys j <= lim[r] (none when lim[r] < 0). The weights
// replace the scores (0 past lim), m and l move on, the accumulators' rescale factors are
// returned (exactly 1 for a row that sees no key of the chunk).
inline v16 softmax_rows(float* s, int rp, int nk, i16 lim, v16& m, v16& l) {
  v16 mj[4] = {m, m, m, m};  // four chains (a max is exact in any order)
#pragma GCC unroll 4
  for (int j = 0; j < nk; ++j) {
    const v16 x = load16(s + (size_t)j * rp);
    v16& mx = mj[j & 3];
    mx = ((i16{} + j) <= lim) & (x > mx) ? x : mx;
  }
  const v16 m01 = mj[0] > mj[1] ? mj[0] : mj[1], m23 = mj[2] > mj[3] ? mj[2] : mj[3];
  const v16 mx = m01 > m23 ? m01 : m23;
  v16 part[16] = {};  // part[u]: keys u, u + 16, ... in order, as chunk_softmax's lane u
#pragma GCC unroll 16
  for (int j = 0; j < nk; ++j) {
    float* p = s + (size_t)j * rp;
    const v16 e = (i16{} + j) <= lim ? exp16(load16(p) - mx) : v16{};
    store16(p, e);
    part[j & 15] += e;
  }
  const v16 even = ((part[0] + part[8]) + (part[4] + part[12])) +
                   ((part[2] + part[10]) + (part[6] + part[14]));
  const v16 odd = ((part[1] + part[9]) + (part[5] + part[13])) +
                  ((part[3] + part[11]) + (part[7] + part[15]));
  const v16 corr = exp16(m - mx);
  m = mx;
  l = fma16(l, corr, even + odd);
  return corr;
}

// attend_rows for a walk whose rows per head (w.per_head) fill 16-row tiles.
template <int DV>
void attend_lanes(const Args& a, const Rows& w, std::vector<float>& buf) {
  constexpr int D = 16 * DV;
  const int BS = a.BS, ph = w.per_head, rp = (ph + 15) / 16 * 16;
  const int ck = chunk_blocks(BS) * BS;
  const int64_t ts = (int64_t)a.KVH * D;
  // Per head: the chunk's weights [ck][rp], then the queries in transposed 16-row tiles.
  const size_t per = (size_t)ck * rp + (size_t)rp * D;
  buf.resize(per * w.heads);
  for (int hl = 0; hl < w.heads; ++hl) {
    float* qt = buf.data() + hl * per + (size_t)ck * rp;
    for (int r = 0; r < rp; ++r) {
      float* dst = qt + (size_t)(r / 16 * 16) * D + r % 16;
      const float* src = w.q + ((size_t)hl * ph + r) * D;
      for (int d = 0; d < D; ++d) dst[d * 16] = r < ph ? src[d] : 0.0f;
    }
  }
  const auto scores = [&](int i, int keys, const kv_t* kb, const kv_t* kn) {
    for (int hl = 0; hl < w.heads; ++hl) {
      float* st = buf.data() + hl * per;
      for (int k0 = 0; k0 < keys; k0 += 16)
        scores_rows<DV>(st + (size_t)ck * rp, rp, kb + hl * D + k0 * ts, ts,
                        std::min(16, keys - k0), st + (size_t)(i * BS + k0) * rp,
                        kn + hl * D + k0 * ts);
    }
  };
  const auto softmax = [&](int key0, int nk) {
    for (int hl = 0; hl < w.heads; ++hl)
      for (int r0 = 0; r0 < ph; r0 += 16) {
        const int nr = std::min(16, ph - r0), base = hl * ph + r0;
        v16 m = v16{} - 1e30f, l = v16{};
        i16 lim = i16{} - 1;
        for (int r = 0; r < nr; ++r)
          m[r] = w.m[base + r], l[r] = w.l[base + r], lim[r] = w.pos[base + r] - key0;
        const v16 corr = softmax_rows(buf.data() + hl * per + r0, rp, nk, lim, m, l);
        for (int r = 0; r < nr; ++r) {
          w.m[base + r] = m[r], w.l[base + r] = l[r];
          float* o = w.acc + (size_t)(base + r) * D;
          const v16 c = v16{} + corr[r];
          for (int v = 0; v < DV; ++v) store16(o + 16 * v, load16(o + 16 * v) * c);
        }
      }
  };
  const auto weigh = [&](int i, int keys, const kv_t* vb, const kv_t* vn) {
    for (int hl = 0; hl < w.heads; ++hl, vb += D)
      weighted_v<DV, RB_V<DV>>(buf.data() + hl * per + (size_t)i * BS * rp, ph, 1, rp, vb, ts,
                               keys, w.acc + (size_t)hl * ph * D, vn ? vn + hl * D : nullptr);
  };
  // No far prefetches: a tile's work per block hides the latency, and they cost a prefill
  // 512 tokens and the 63 chunks after a shared prefix 2-5 % (bench_cpu_attention.py --bf16).
  walk_chunks(a, w, scores, softmax, weigh, false);
}
