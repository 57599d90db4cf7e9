// The decoder's layers for bf16 activations on the CPU in one call (models/cpu_decoder.py): the
// kernels models/llama.py's per-layer Python runs for a bf16 model, with the same arguments and
// in the same order, and the torch ops between them done here with torch's rounding, so every
// output is bit for bit the Python path's (step invariance holds unchanged). It saves the
// Python between the kernels (issue 44: 4.6 ms of a 24.9 ms decode step at batch 1 here).
//
// Per layer (l = 0 .. L-1), x the bf16 residual stream [T, hidden], each value below bf16:
//   x = bf16(x + down_{l-1}) (torch's x + mlp(normed); layer 0: none); normed = rms(x)
//   qkv = normed @ Wqkv (+b) (gemm_bf16.cpp, rounded once); q/k/v widened to fp32 (exact),
//   attention with rope (the bf16 tables widened) and the K/V write into the bf16 caches
//   (paged_attention_bf16kv.cpp); attn = bf16(its fp32 output) (torch's .to(bf16))
//   o = attn @ Wo (+b); x = bf16(x + o), normed = rms(x) (one add-RMSNorm call)
//   gate_up = normed @ Wgu (+b); act = silu(gate) * up; down = act @ Wdown (+b)
// then out = rms(bf16(x + down_{L-1})) with the final norm's weight.
//
// The roundings of torch's ops (the residual add, the attention output) are round to nearest
// even of the fp32 value, as torch's for finite values; a NaN stays a NaN but its bits may not be
// torch's (whose vector and scalar conversions disagree on them anyway).
//
// That glue runs on the kernels' threads too (issue 44: done by the calling thread alone, it was
// ~1 ms of serial time a batch-64 step, docs/benchmarks.md), each worker in the calling
// thread's floating-point mode for it: torch's add runs without flush-to-zero, the kernels'
// workers with it (simd.h), and a residual sum that cancels to a denormal must stay one.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decoder.h"
#include "simd.h"

extern "C" {
int llmserve_gemm_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w,
                       int64_t N, const float* bias, float* y_f32, uint16_t* y_bf16, int64_t ldy,
                       int num_threads);
int llmserve_paged_attention_bf16kv(const float* q, int64_t q_stride_t, int64_t q_stride_h,
                                    uint16_t* k_cache, uint16_t* v_cache,
                                    const int32_t* block_tables, int64_t bt_stride,
                                    const int32_t* seq_lens, const int32_t* query_start_loc,
                                    int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                    int block_size, float scale, float* out, int num_threads,
                                    const float* k_new, int64_t k_stride_t, const float* v_new,
                                    int64_t v_stride_t, const int64_t* slots, int num_new,
                                    const float* cos, const float* sin);
int llmserve_silu_mul_bf16(const uint16_t* x, int64_t rows, int64_t n, int64_t x_stride,
                           uint16_t* out, int num_threads);
int llmserve_add_rms_norm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* delta,
                               int64_t d_stride, const uint16_t* w, int64_t rows, int64_t dim,
                               float eps, uint16_t* sum_out, uint16_t* out, int num_threads);
}

namespace {

using namespace llmserve_decoder;
using llmserve::CsrAs;
using llmserve::kParallelMin;

constexpr int64_t kKeepBytes = int64_t(64) << 20;

inline float widen(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t narrow(float f) {  // round to nearest even, as torch's bf16 conversion
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN (bit test: fast-math)
  return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// body(i0, i1) over [0, n) in blocks of kGlueBlock elements, shared out over nt threads from
// kParallelMin elements on, each thread in the calling thread's MXCSR (`csr`) for its share.
// Every element is its own: the bits do not depend on who computes which.
constexpr int64_t kGlueBlock = 4096;

template <class Body>
void glue_for(int64_t n, int nt, unsigned csr, Body&& body) {
  if (nt <= 1 || n < kParallelMin) return body(int64_t(0), n);
  const int64_t blocks = (n + kGlueBlock - 1) / kGlueBlock;
#pragma omp parallel num_threads(nt)
  {
    CsrAs mode(csr);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) body(b * kGlueBlock, std::min(n, (b + 1) * kGlueBlock));
  }
}

// Exact (bits only): no floating-point mode applies.
void widen_rows(const uint16_t* src, int64_t n, float* dst, int nt, unsigned csr) {
  glue_for(n, nt, csr, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dst[i] = widen(src[i]);
  });
}

void narrow_rows(const float* src, int64_t n, uint16_t* dst, int nt, unsigned csr) {
  glue_for(n, nt, csr, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dst[i] = narrow(src[i]);
  });
}

// x = bf16(x + d): torch's bf16 add (fp32 sum, one rounding), in the calling thread's float
// environment as torch's is (no flush-to-zero: the add-RMSNorm kernel flushes denormals).
void add_rows(uint16_t* x, const uint16_t* d, int64_t n, int nt, unsigned csr) {
  glue_for(n, nt, csr, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) x[i] = narrow(widen(x[i]) + widen(d[i]));
  });
}

int linear(const Linear& l, const uint16_t* x, int64_t m, int64_t k, uint16_t* y, int nt) {
  if (l.kind != kBf16Panels) return 9;
  return llmserve_gemm_bf16(x, m, k, k, (const uint16_t*)l.w, l.n, l.bias, nullptr, y, l.n, nt);
}

}  // namespace

// x [T, hidden] bf16 (the embeddings; used as the residual stream and overwritten), cos/sin
// [T, head_dim / 2] bf16 (the model's tables as the Python path casts them), the batch's
// attention metadata as paged_attention.cpp takes it, out [T, hidden] bf16 = the final norm of
// the last residual. Returns 0, or the first failing kernel's code plus 100 * (its layer + 1).
extern "C" int llmserve_decoder_bf16(const Model* m, const Layer* layers, uint16_t* x, int64_t T,
                                     const uint16_t* cos, const uint16_t* sin,
                                     const int32_t* block_tables, int64_t bt_stride,
                                     const int32_t* seq_lens, const int32_t* query_start_loc,
                                     int num_seqs, const int64_t* slots, uint16_t* out,
                                     int num_threads) {
  if (T <= 0) return T == 0 ? 0 : 1;
  const int64_t H = m->hidden, I = m->intermediate, D = m->head_dim;
  const int64_t q_size = m->num_heads * D, kv_size = m->num_kv_heads * D;
  const int64_t qkv_n = q_size + 2 * kv_size;
  // The gemm takes an even K only (gemm_bf16.py pads an odd one; the plan declines those).
  if (layers[0].qkv.n != qkv_n || layers[0].gate_up.n != 2 * I || H % 2 || I % 2 || q_size % 2)
    return 2;
  // Scratch, bf16: normed, down (read by the next layer's add), and one area holding
  // qkv | attn | o in the attention half and gate_up | act in the MLP's; fp32: the widened
  // q/k/v, the attention output, the rope tables.
  const int64_t work16 = std::max(qkv_n + q_size + H, 3 * I);
  const int64_t need16 = T * (2 * H + work16);
  const int64_t need32 = T * (qkv_n + q_size + D);
  const int64_t floats = (need16 + 1) / 2 + need32;
  thread_local std::vector<float> kept;
  std::vector<float> once;
  std::vector<float>& buf = floats * 4 <= kKeepBytes ? kept : once;
  if ((int64_t)buf.size() < floats) buf.resize(floats);
  float* qkv_f = buf.data();
  float* attn_f = qkv_f + T * qkv_n;
  float* cos_f = attn_f + T * q_size;
  float* sin_f = cos_f + T * (D / 2);
  uint16_t* normed = (uint16_t*)(sin_f + T * (D / 2));
  uint16_t* down = normed + T * H;
  uint16_t* qkv = down + T * H;
  uint16_t* attn = qkv + T * qkv_n;
  uint16_t* o = attn + T * q_size;
  uint16_t* gate_up = qkv;
  uint16_t* act = gate_up + T * 2 * I;
  const int nt = num_threads;
  const unsigned csr = llmserve::current_csr();  // the caller's: the glue's workers take it
  widen_rows(cos, T * (D / 2), cos_f, nt, csr);
  widen_rows(sin, T * (D / 2), sin_f, nt, csr);
  for (int64_t l = 0; l < m->num_layers; ++l) {
    const Layer& L = layers[l];
    const int64_t tag = 100 * (l + 1);
    if (l > 0) add_rows(x, down, T * H, nt, csr);
    int rc = llmserve_add_rms_norm_bf16(x, H, nullptr, 0, (const uint16_t*)L.ln_in, T, H, m->eps,
                                        nullptr, normed, nt);
    if (rc || (rc = linear(L.qkv, normed, T, H, qkv, nt))) return (int)(tag + rc);
    widen_rows(qkv, T * qkv_n, qkv_f, nt, csr);
    rc = llmserve_paged_attention_bf16kv(
        qkv_f, qkv_n, D, (uint16_t*)L.k_cache, (uint16_t*)L.v_cache, block_tables, bt_stride,
        seq_lens, query_start_loc, num_seqs, (int)m->num_heads, (int)m->num_kv_heads, (int)D,
        (int)m->block_size, m->scale, attn_f, nt, qkv_f + q_size, qkv_n,
        qkv_f + q_size + kv_size, qkv_n, slots, (int)T, cos_f, sin_f);
    if (rc) return (int)(tag + rc);
    narrow_rows(attn_f, T * q_size, attn, nt, csr);
    if ((rc = linear(L.o, attn, T, q_size, o, nt))) return (int)(tag + rc);
    rc = llmserve_add_rms_norm_bf16(x, H, o, H, (const uint16_t*)L.ln_post, T, H, m->eps, x,
                                    normed, nt);
    if (rc || (rc = linear(L.gate_up, normed, T, H, gate_up, nt))) return (int)(tag + rc);
    rc = llmserve_silu_mul_bf16(gate_up, T, I, 2 * I, act, nt);
    if (rc || (rc = linear(L.down, act, T, I, down, nt))) return (int)(tag + rc);
  }
  add_rows(x, down, T * H, nt, csr);
  return llmserve_add_rms_norm_bf16(x, H, nullptr, 0, (const uint16_t*)m->final_norm, T, H,
                                    m->eps, nullptr, out, nt);
}
