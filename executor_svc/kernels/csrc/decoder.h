// The descriptors models/cpu_decoder.py fills for csrc/decoder.cpp (fp32) and
// csrc/decoder_bf16.cpp (bf16): the model's sizes, and per layer its norms, projections and KV
// cache. The layout is the ctypes structures' (_Linear, _Layer, _Model) field for field.
#pragma once

#include <cstdint>

namespace llmserve_decoder {

// How a matrix is held (kernels/gemm.py, kernels/quant.py, kernels/gemm_bf16.py), and so which
// kernel runs it.
enum Kind : int32_t { kPanels = 0, kPlain = 1, kQuantSplit = 2, kQuantBlocks = 3, kBf16Panels = 4 };

struct Linear {
  int32_t kind;
  int32_t type;    // ggml type id (quantized kinds)
  const void* w;   // panels (fp32 or bf16), plain [K, N] fp32, or [N, row_bytes] blocks
  int64_t n;       // output features
  int64_t ld;      // plain: the row stride; quantized: bytes per row; panels: 0
  const float* bias;  // fp32 whatever the activations
};

struct Layer {
  const void* ln_in;  // [hidden], the activations' dtype
  const void* ln_post;
  Linear qkv, o, gate_up, down;
  void* k_cache;  // [num_blocks, block_size, num_kv_heads, head_dim], the activations' dtype
  void* v_cache;
};

struct Model {
  int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size, num_layers;
  float eps, scale;
  const void* final_norm;
};

}  // namespace llmserve_decoder
