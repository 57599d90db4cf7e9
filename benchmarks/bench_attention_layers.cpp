// The CPU attention kernel over 30 layers' bf16 caches, as one decode step of the SmolLM-135M
// shape reads them (9 query heads, 3 KV heads, head_dim 64, block size 16): B sequences of CTX
// keys, one query token each, every layer its own cache, so nothing stays in L3 from one layer
// to the next (what the weights' streaming does in a real step). One thread. Prints the best
// and mean step of REPS (the first left out) and a hash of the first step's output bits, so
// two builds of the kernel can be compared for speed and for equal bits.
//
//   F="-O3 -ffast-math -fno-associative-math -fopenmp -shared -fPIC -std=c++17"  (the library's)
//   g++ $F -march=x86-64-v4 -mavx512bf16 -mavx512vnni
//       executor_svc/kernels/csrc/paged_attention_bf16kv.cpp -o /tmp/attn.so
//   g++ -O2 benchmarks/bench_attention_layers.cpp /tmp/attn.so -Wl,-rpath,/tmp -o /tmp/attn
//   taskset -c 1 /tmp/attn [B=64] [CTX=193] [RANDOM_TABLES=0] [REPS=10] [LAYERS=30]
// HUGE=1 in the environment: the caches on transparent huge pages (madvise).
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

extern "C" int llmserve_paged_attention_bf16kv(
    const float* q, int64_t q_stride_t, int64_t q_stride_h, uint16_t* k_cache, uint16_t* v_cache,
    const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens,
    const int32_t* query_start_loc, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
    int block_size, float scale, float* out, int num_threads, const float* k_new,
    int64_t k_stride_t, const float* v_new, int64_t v_stride_t, const int64_t* slots,
    int num_new, const float* cos, const float* sin);

static uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

int main(int argc, char** argv) {
  const int B = argc > 1 ? atoi(argv[1]) : 64, ctx = argc > 2 ? atoi(argv[2]) : 193;
  const int random_tables = argc > 3 ? atoi(argv[3]) : 0, reps = argc > 4 ? atoi(argv[4]) : 10;
  const int L = argc > 5 ? atoi(argv[5]) : 30;
  const bool huge = getenv("HUGE") && atoi(getenv("HUGE"));
  const int H = 9, KVH = 3, D = 64, BS = 16;
  const int per = (ctx + BS - 1) / BS, nb = B * per + 8;
  const size_t n = (size_t)nb * BS * KVH * D, bytes = (n * 2 + (2 << 20) - 1) >> 21 << 21;
  std::mt19937 g(1);
  std::normal_distribution<float> nd;
  std::vector<uint16_t*> K(L), V(L);
  for (int l = 0; l < L; ++l) {
    K[l] = (uint16_t*)aligned_alloc(2 << 20, bytes);
    V[l] = (uint16_t*)aligned_alloc(2 << 20, bytes);
    if (huge) madvise(K[l], bytes, MADV_HUGEPAGE), madvise(V[l], bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < n; ++i) K[l][i] = to_bf16(nd(g)), V[l][i] = to_bf16(nd(g));
  }
  std::vector<int32_t> ids(nb), bt(B * per), sl(B, ctx), qsl(B + 1);
  for (int i = 0; i < nb; ++i) ids[i] = i;
  if (random_tables) std::shuffle(ids.begin(), ids.end(), g);
  for (int i = 0; i < B * per; ++i) bt[i] = ids[i];
  for (int i = 0; i <= B; ++i) qsl[i] = i;
  std::vector<float> q((size_t)B * H * D), out(q.size());
  for (float& x : q) x = nd(g);
  uint64_t hash = 1469598103934665603ull;
  double best = 1e30, total = 0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < L; ++l) {
      llmserve_paged_attention_bf16kv(q.data(), H * D, D, K[l], V[l], bt.data(), per, sl.data(),
                                      qsl.data(), B, H, KVH, D, BS, 0.125f, out.data(), 1,
                                      nullptr, 0, nullptr, 0, nullptr, 0, nullptr, nullptr);
      if (r == 0) {
        const uint8_t* p = (const uint8_t*)out.data();
        for (size_t i = 0; i < out.size() * 4; ++i) hash = (hash ^ p[i]) * 1099511628211ull;
      }
    }
    const double ms =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
    if (r) best = std::min(best, ms), total += ms;
  }
  const double gb = (double)B * ctx * KVH * D * 2 * 2 * L / 1e9;
  printf("B=%d ctx=%d layers=%d random_tables=%d: best %.3f ms, mean %.3f ms (%.1f GB/s of K/V)"
         ", output hash %016llx\n",
         B, ctx, L, random_tables, best, total / (reps - 1), gb / best * 1e3,
         (unsigned long long)hash);
}
