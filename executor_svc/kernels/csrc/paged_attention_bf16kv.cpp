// The paged-attention kernel over a bf16 KV cache: paged_attention.cpp and attention_vec.cpp
// compiled a second time with kv_t = bf16 (attention.h), as llmserve_paged_attention_bf16kv.
// Keys and values widen exactly to fp32 where they are read; new keys (rotated in fp32) and
// values are rounded to bf16 once where they are stored. Everything else, and so the order of
// every sum (step invariance), is the fp32 kernel's.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define LLMSERVE_KV_BF16 1
#include "paged_attention.cpp"
#include "attention_vec.cpp"
