// The decoder's layers for fp32 activations on the CPU in one call (models/cpu_decoder.py): the
// same kernels, with the same arguments and in the same order, as models/llama.py's per-layer
// Python, so every output is bit for bit the Python path's (step invariance holds unchanged).
// What it saves is the Python between kernels: a layer makes seven kernel calls through ctypes
// plus the tensors and checks around them, measured at 5-13 ms a step on a 30-layer model
// whatever the batch (13.3 -> 8.3 ms at batch 1 for the SmolLM2 GGUF;
// benchmarks/bench_cpu_decoder.py, docs/benchmarks.md, issue 29's sixth pass).
//
// Per layer (l = 0 .. L-1), x the residual stream [T, hidden]:
//   normed = rms(x + down_{l-1}) (x += down_{l-1} stored; layer 0: rms(x))
//   qkv = normed @ Wqkv (+b); attention with rope and the K/V write (paged_attention.cpp)
//   o = attn @ Wo (+b); x += o, normed = rms(x)
//   gate_up = normed @ Wgu (+b); act = silu(gate) * up; down = act @ Wdown (+b)
// then out = rms(x + down_{L-1}) with the final norm's weight. Residual adds happen inside the
// add-RMSNorm kernel: the same single fp32 add as torch's x + y.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "decoder.h"

extern "C" {
int llmserve_gemm_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const float* w,
                      int64_t N, int64_t ldw, const float* bias, float* y, int64_t ldy,
                      int num_threads);
int llmserve_quant_gemm_f32(int type, const float* x, int64_t M, int64_t K, int64_t ldx,
                            const uint8_t* w, int64_t N, int64_t row_bytes, const float* bias,
                            float* y, int64_t ldy, int num_threads);
int llmserve_quant_gemm_split_f32(int type, const float* x, int64_t M, int64_t K, int64_t ldx,
                                  const uint8_t* w, int64_t N, int64_t row_bytes,
                                  const float* bias, float* y, int64_t ldy, int num_threads);
int llmserve_paged_attention_f32(const float* q, int64_t q_stride_t, int64_t q_stride_h,
                                 float* k_cache, float* v_cache, const int32_t* block_tables,
                                 int64_t bt_stride, const int32_t* seq_lens,
                                 const int32_t* query_start_loc, int num_seqs, int num_heads,
                                 int num_kv_heads, int head_dim, int block_size, float scale,
                                 float* out, int num_threads, const float* k_new,
                                 int64_t k_stride_t, const float* v_new, int64_t v_stride_t,
                                 const int64_t* slots, int num_new, const float* cos,
                                 const float* sin);
int llmserve_silu_mul_f32(const float* x, int64_t rows, int64_t n, int64_t x_stride, float* out,
                          int num_threads);
int llmserve_add_rms_norm_f32(const float* x, int64_t x_stride, const float* delta,
                              int64_t d_stride, const float* w, int64_t rows, int64_t dim,
                              float eps, float* sum_out, float* out, int num_threads);
}

namespace {

using namespace llmserve_decoder;

constexpr int64_t kKeepFloats = int64_t(16) << 20;  // 64 MB

int linear(const Linear& l, const float* x, int64_t m, int64_t k, float* y, int nt) {
  switch (l.kind) {
    case kPanels:
      return llmserve_gemm_f32(x, m, k, k, (const float*)l.w, l.n, 0, l.bias, y, l.n, nt);
    case kPlain:
      return llmserve_gemm_f32(x, m, k, k, (const float*)l.w, l.n, l.ld, l.bias, y, l.n, nt);
    case kQuantSplit:
      return llmserve_quant_gemm_split_f32(l.type, x, m, k, k, (const uint8_t*)l.w, l.n, l.ld,
                                           l.bias, y, l.n, nt);
    case kQuantBlocks:
      return llmserve_quant_gemm_f32(l.type, x, m, k, k, (const uint8_t*)l.w, l.n, l.ld, l.bias,
                                     y, l.n, nt);
    default:
      return 9;
  }
}

}  // namespace

// x [T, hidden] (the embeddings; used as the residual stream and overwritten), cos/sin
// [T, head_dim / 2], the batch's attention metadata as paged_attention.cpp takes it, out
// [T, hidden] = the final norm of the last residual. Returns 0, or the first failing kernel's
// code plus 100 * (its layer + 1) (the Python caller raises with it).
extern "C" int llmserve_decoder_f32(const Model* m, const Layer* layers, float* x, int64_t T,
                                    const float* cos, const float* sin,
                                    const int32_t* block_tables, int64_t bt_stride,
                                    const int32_t* seq_lens, const int32_t* query_start_loc,
                                    int num_seqs, const int64_t* slots, float* out,
                                    int num_threads) {
  if (T <= 0) return T == 0 ? 0 : 1;
  const int64_t H = m->hidden, I = m->intermediate, D = m->head_dim;
  const int64_t q_size = m->num_heads * D, kv_size = m->num_kv_heads * D;
  const int64_t qkv_n = q_size + 2 * kv_size;
  if (layers[0].qkv.n != qkv_n || layers[0].gate_up.n != 2 * I) return 2;
  // Scratch: the normed rows, the MLP's output (read by the next layer's norm), and one work
  // area that holds qkv | attention | o in the attention half and gate_up | act in the MLP's.
  // Kept per calling thread between calls while small (decode steps); a large prefill's is
  // freed when it returns.
  const int64_t work = std::max(qkv_n + q_size + H, 3 * I);
  const int64_t need = T * (2 * H + work);
  thread_local std::vector<float> kept;
  std::vector<float> once;
  std::vector<float>& buf = need <= kKeepFloats ? kept : once;
  if ((int64_t)buf.size() < need) buf.resize(need);
  float* normed = buf.data();
  float* down = normed + T * H;
  float* qkv = down + T * H;
  float* attn = qkv + T * qkv_n;
  float* o = attn + T * q_size;
  float* gate_up = qkv;
  float* act = gate_up + T * 2 * I;
  const int nt = num_threads;
  for (int64_t l = 0; l < m->num_layers; ++l) {
    const Layer& L = layers[l];
    const int64_t tag = 100 * (l + 1);
    const float* ln_in = (const float*)L.ln_in;
    int rc = l == 0 ? llmserve_add_rms_norm_f32(x, H, nullptr, 0, ln_in, T, H, m->eps, nullptr,
                                                normed, nt)
                    : llmserve_add_rms_norm_f32(x, H, down, H, ln_in, T, H, m->eps, x, normed, nt);
    if (rc || (rc = linear(L.qkv, normed, T, H, qkv, nt))) return (int)(tag + rc);
    rc = llmserve_paged_attention_f32(
        qkv, qkv_n, D, (float*)L.k_cache, (float*)L.v_cache, block_tables, bt_stride, seq_lens,
        query_start_loc, num_seqs, (int)m->num_heads, (int)m->num_kv_heads, (int)D,
        (int)m->block_size, m->scale, attn, nt, qkv + q_size, qkv_n, qkv + q_size + kv_size, qkv_n,
        slots, (int)T, cos, sin);
    if (rc || (rc = linear(L.o, attn, T, q_size, o, nt))) return (int)(tag + rc);
    rc = llmserve_add_rms_norm_f32(x, H, o, H, (const float*)L.ln_post, T, H, m->eps, x, normed,
                                   nt);
    if (rc || (rc = linear(L.gate_up, normed, T, H, gate_up, nt))) return (int)(tag + rc);
    rc = llmserve_silu_mul_f32(gate_up, T, I, 2 * I, act, nt);
    if (rc || (rc = linear(L.down, act, T, I, down, nt))) return (int)(tag + rc);
  }
  return llmserve_add_rms_norm_f32(x, H, down, H, (const float*)m->final_norm, T, H, m->eps, x,
                                   out, nt);
}
