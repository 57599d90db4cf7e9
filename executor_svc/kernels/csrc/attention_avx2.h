// The AVX2 build's scores_dot and weighted_v for attention_vec.cpp (included there, inside its
// namespace, when simd8.h's LLMSERVE_AVX2_PATHS is on). The v16 versions keep 16 key
// accumulators or RB x DV row accumulators of 16 lanes: twice the 16 ymm registers, so they
// spilled on every key. These keep at most 8 (scores) or 12 (weighted sums) ymm accumulators
// and give the same bits: each score is the v16 chain (the low and high halves of each 16-lane
// partial summed over v ascending, first a product then multiply-adds) reduced in reduce16's
// order (simd8.h reduce8 / hsum2); each output element of the weighted sum takes its keys in
// ascending order, one multiply-add each, as before.
#pragma once

inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }

// The first two terms of a score's lane chain, as GCC contracts the v16 code's
// `acc = q0 * k0; acc += q1 * k1` (measured on the AVX-512 build): fma(q0, k0, q1 * k1). Later
// terms are fma(qv, kv, acc). Written with explicit FMAs so no contraction choice remains here.
inline v8 first2(const float* q, const kv_t* k) {
  return fma8(load8(q), load_kv8(k), load8(q + 16) * load_kv8(k + 16));
}

// Scores of n <= 16 keys: 4 keys at a time share each query load (8 chains in flight), 8 keys
// reduced together.
template <int DV>
void scores_dot(const float* q, int rows, const kv_t* kb, int64_t ts, int n, float* s, int ss,
                const kv_t* next) {
  for (int i = 0; i < rows; ++i, q += 16 * DV, s += ss) {
    int u = 0;
    for (; u + 8 <= n; u += 8) {
      v8 sum[8];
      for (int k0 = 0; k0 < 8; k0 += 4) {
        const kv_t* k = kb + (u + k0) * ts;
        v8 lo[4], hi[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          if (next && i == 0)
            for (int v = 0; v < DV; ++v) __builtin_prefetch(next + (u + k0 + c) * ts + 16 * v);
          lo[c] = first2(q, k + c * ts);
          hi[c] = first2(q + 8, k + c * ts + 8);
        }
#pragma GCC unroll 8
        for (int v = 2; v < DV; ++v) {
          const v8 q0 = load8(q + 16 * v), q1 = load8(q + 16 * v + 8);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
            lo[c] = fma8(q0, load_kv8(k + c * ts + 16 * v), lo[c]);
            hi[c] = fma8(q1, load_kv8(k + c * ts + 16 * v + 8), hi[c]);
          }
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) sum[k0 + c] = lo[c] + hi[c];
      }
      store8(s + u, reduce8(sum));
    }
    for (; u < n; ++u) {
      const kv_t* k = kb + u * ts;
      v8 lo = first2(q, k), hi = first2(q + 8, k + 8);
      for (int v = 2; v < DV; ++v) {
        lo = fma8(load8(q + 16 * v), load_kv8(k + 16 * v), lo);
        hi = fma8(load8(q + 16 * v + 8), load_kv8(k + 16 * v + 8), hi);
      }
      s[u] = hsum2(lo, hi);
    }
  }
}

// acc[r] += sum over keys j < n of s[r * ss + j * ks] * V[j]: RB rows x 16 columns (2 ymm
// each) at a time, the V vectors loaded once for the RB rows.
template <int DV, int RB>
void weighted_v(const float* s, int rows, int ss, int ks, const kv_t* vb, int64_t ts, int n,
                float* acc, const kv_t* next) {
  static_assert(RB <= 6, "2 * RB accumulators must leave room in the 16 ymm registers");
  int i = 0;
  for (; i + RB <= rows; i += RB, next = nullptr) {
    float* ai = acc + (size_t)i * 16 * DV;
    const float* si = s + (size_t)i * ss;
    for (int v = 0; v < DV; ++v) {
      v8 o[RB][2];
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        o[r][0] = load8(ai + (r * DV + v) * 16);
        o[r][1] = load8(ai + (r * DV + v) * 16 + 8);
      }
      for (int j = 0; j < n; ++j) {
        const kv_t* vj = vb + j * ts + 16 * v;
        const v8 v0 = load_kv8(vj), v1 = load_kv8(vj + 8);
        if (next && v == 0)
          for (int w = 0; w < DV; ++w) __builtin_prefetch(next + j * ts + 16 * w);
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          const float p = si[(size_t)r * ss + (size_t)j * ks];
          o[r][0] += p * v0;
          o[r][1] += p * v1;
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        store8(ai + (r * DV + v) * 16, o[r][0]);
        store8(ai + (r * DV + v) * 16 + 8, o[r][1]);
      }
    }
  }
  if constexpr (RB > 1)
    if (i < rows)
      weighted_v<DV, RB - 1>(s + (size_t)i * ss, rows - i, ss, ks, vb, ts, n,
                             acc + (size_t)i * 16 * DV, next);
}
