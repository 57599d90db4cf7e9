// Types shared by the paged-attention sources: paged_attention.cpp (the entry point and the
// generic path) and attention_vec.cpp (the vectorised path and shared-prefix groups).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <cstring>

#include "simd.h"
#include "simd8.h"

// The cache's element type: fp32, or bf16 when csrc/paged_attention_bf16kv.cpp compiles these
// sources a second time with LLMSERVE_KV_BF16 (everything then lands in namespace
// llmserve_kvbf16, which sees llmserve's vector helpers, and the entry point gets its own name).
// Scores, softmax and accumulators are fp32 either way; a bf16 key or value widens exactly.
#if defined(LLMSERVE_KV_BF16)
namespace llmserve_kvbf16 {
using namespace llmserve;
}
#define llmserve llmserve_kvbf16
#define LLMSERVE_PAGED_ATTENTION llmserve_paged_attention_bf16kv
#else
#define LLMSERVE_PAGED_ATTENTION llmserve_paged_attention_f32
#endif

namespace llmserve {

#if defined(LLMSERVE_KV_BF16)
typedef uint16_t kv_t;
typedef uint32_t kv_u32x16 __attribute__((vector_size(64)));
typedef uint16_t kv_u16x16 __attribute__((vector_size(32)));
inline v16 load_kv16(const kv_t* p) {
#if defined(__AVX512F__)
  // Explicit zero-extension and shift: GCC's lowering of the convertvector below was ~3x slower
  // than an fp32 load in the scores loop (docs/benchmarks.md, "AVX2 build of the CPU kernels").
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  kv_u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const kv_u32x16 bits = __builtin_convertvector(h, kv_u32x16) << 16;
  v16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}
inline float kv_get(kv_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline kv_t kv_from(float f) {  // round to nearest even (finite values)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return (kv_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
#else
typedef float kv_t;
inline v16 load_kv16(const kv_t* p) { return load16(p); }
inline float kv_get(kv_t v) { return v; }
inline kv_t kv_from(float f) { return f; }
#endif

#if defined(LLMSERVE_AVX2_PATHS)
inline v8 load_kv8(const kv_t* p) {
#if defined(LLMSERVE_KV_BF16)
  return load_bf16x8(p);
#else
  return load8(p);
#endif
}
#endif

constexpr int TILE = 16;          // query tokens per work item
// Keys per softmax chunk of the vectorised path. Chunks start at multiples of it, whatever the
// step looks like: the chunking (and so the rounding) of a row's softmax is fixed by its position.
constexpr int CHUNK_KEYS = 128;
// An item of a prefill tile takes one KV head when all heads would give it more rows than this
// (its score scratch is rows x CHUNK_KEYS floats).
constexpr int MAX_ITEM_ROWS = 128;

struct Item {
  int seq, t0, t1;  // query tokens [t0, t1) of the batch
  int g0, g1;       // KV heads [g0, g1)
};

struct Args {
  const float* q; int64_t q_stride_t, q_stride_h;  // query [num_tokens, H, D], any row strides
  const kv_t* k_cache; const kv_t* v_cache;
  const int32_t* block_tables; int64_t bt_stride;
  const int32_t* seq_lens; const int32_t* qsl;
  int H, KVH, D, BS;
  float scale;
  float* out;  // [num_tokens, H, D] contiguous
  // Rotary embedding (neox: halves rotated) of query token t: cos/sin [num_tokens, D / 2]
  // rows; null = the query arrives rotated.
  const float* cos; const float* sin;
};

// The online-softmax step of one row over n new scores in s: s becomes the weights
// exp(s - new max), m and l move on, and the factor that rescales the row's accumulator is
// returned (0 on the first block, where m = -1e30).
#if !defined(LLMSERVE_AVX2_PATHS)
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
  l = __builtin_fmaf(l, corr, hsum(vsum));  // attention_rows.h: the same FMA
  return corr;
}
#else
// The same step on 8-lane halves (simd8.h): lane u of the v16 code is lane u of the low half
// for u < 8 and lane u - 8 of the high one, so the max, the weights and the sum's order match.
inline float softmax_update(float* s, int n, float& m, float& l) {
  float mx = m;
  int j = 0;
  if (n >= 16) {
    v8 lo = load8(s), hi = load8(s + 8);
    for (j = 16; j + 16 <= n; j += 16) {
      const v8 x0 = load8(s + j), x1 = load8(s + j + 8);
      lo = x0 > lo ? x0 : lo;
      hi = x1 > hi ? x1 : hi;
    }
    for (int u = 0; u < 8; ++u) mx = std::max(mx, lo[u]);
    for (int u = 0; u < 8; ++u) mx = std::max(mx, hi[u]);
  }
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  v8 sum_lo = v8{}, sum_hi = v8{};
  for (j = 0; j + 16 <= n; j += 16) {
    const v8 e0 = exp8(load8(s + j) - mx), e1 = exp8(load8(s + j + 8) - mx);
    store8(s + j, e0);
    store8(s + j + 8, e1);
    sum_lo += e0;
    sum_hi += e1;
  }
  if (j < n) {  // the tail through a padded vector, as in the v16 code
    float t[16], e[16], vs[16];
    for (int u = 0; u < 16; ++u) t[u] = u < n - j ? s[j + u] : -1e30f;
    store8(e, exp8(load8(t) - mx));
    store8(e + 8, exp8(load8(t + 8) - mx));
    store8(vs, sum_lo);
    store8(vs + 8, sum_hi);
    for (int u = 0; u < n - j; ++u) {
      s[j + u] = e[u];
      vs[u] += e[u];
    }
    sum_lo = load8(vs);
    sum_hi = load8(vs + 8);
  }
  const float corr = exp8(v8{} + (m - mx))[0];
  m = mx;
  l = l * corr + hsum2(sum_lo, sum_hi);
  return corr;
}
#endif

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

// Query row (token tok, head h) of the batch into dst: rotated by the token's cos/sin rows when
// the call carries them, times the softmax scale.
inline void load_query(const Args& a, int64_t tok, int h, float* dst) {
  const int64_t half = a.D / 2;
  load_row(a.q + tok * a.q_stride_t + (int64_t)h * a.q_stride_h,
           a.cos ? a.cos + tok * half : nullptr, a.sin ? a.sin + tok * half : nullptr, a.D, a.scale,
           dst);
}

// The vectorised path for head_dim in {32, 48, 64, 80, 96, 128}; false for any other (then the
// caller takes the generic path).
bool run_all_vec(const Args& a, int num_seqs, int num_tokens, const std::vector<Item>& items,
                 int num_threads);

}  // namespace llmserve
