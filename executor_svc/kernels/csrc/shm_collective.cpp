// Collectives between the tensor-parallel ranks of one host through one shared memory segment
// (executor_svc/parallel/shm.py maps it; every rank calls these with its own mapping's address).
// Part of the CPU kernel library (executor_svc/kernels/library.py builds csrc/*.cpp into one).
//
// Layout (offsets from the segment's base, all 64-byte aligned):
//   [0, kCtrl)                      control: one 128-byte line per rank, its sequence number
//                                   (u64 at +0) and its pid (i64 at +8), written only by that rank
//   [kCtrl, kCtrl + 2*world*cap)    data: two slots per rank of `cap` bytes, slot = seq % 2
//
// One round of any collective, on every rank: write this rank's part into its slot for the
// round, publish seq (release), wait until every rank has published seq (acquire), read.
// A rank publishes seq + 1 only after it has finished reading round seq, so when a rank reaches
// round seq + 2 (the same slot again) every other rank has published seq + 1 and is done with
// the slot: two slots per rank need no second flag. Every rank sums the ranks' parts itself in
// rank order (0 + 1 + ... + N-1, elementwise), so all ranks get the same bits whatever the
// timing, and a result never depends on how a tensor was cut into rounds.
//
// Waiting spins (2000 pause instructions: 5-100 us by CPU), then yields, then sleeps in steps
// that grow with the time waited (at most 200 us; 1 ms after a second), so an idle worker
// waiting for the next step costs little. While it sleeps it checks that every other rank's pid
// is alive; a dead rank, or no progress within `timeout_s` (<= 0: none), ends the call with an
// error code and the rank.

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include "simd.h"

using namespace llmserve;

namespace {

constexpr int64_t kLine = 128;      // one rank's control line (two cache lines: no false sharing)
constexpr int64_t kMaxRanks = 64;
constexpr int64_t kCtrl = kLine * kMaxRanks;

enum : int { kOk = 0, kTimeout = -1, kPeerDead = -2, kBadArgs = -3 };

inline std::atomic<uint64_t>* seq_of(char* base, int rank) {
  return reinterpret_cast<std::atomic<uint64_t>*>(base + rank * kLine);
}

inline int64_t* pid_of(char* base, int rank) {
  return reinterpret_cast<int64_t*>(base + rank * kLine + 8);
}

inline char* slot(char* base, int rank, int world, int64_t cap, uint64_t seq) {
  return base + kCtrl + ((int64_t)(seq & 1) * world + rank) * cap;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// A rank that has exited but not been reaped yet (a zombie) counts as dead.
bool pid_alive(int64_t pid) {
  if (pid <= 0) return true;
  if (kill((pid_t)pid, 0) != 0 && errno != EPERM) return false;
  char path[64], buf[256];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no procfs: kill() said it exists
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');  // "pid (comm) state ..."
  return paren == nullptr || paren[1] == 0 || paren[2] != 'Z';
}

// Waits until every rank has published at least `seq`. Returns kOk, or an error with *bad_rank.
int wait_all(char* base, int world, uint64_t seq, double timeout_s, int* bad_rank) {
  for (int r = 0; r < world; ++r) {
    std::atomic<uint64_t>* s = seq_of(base, r);
    if (s->load(std::memory_order_acquire) >= seq) continue;
    for (int i = 0; i < 2000; ++i) {
      cpu_relax();
      if (s->load(std::memory_order_acquire) >= seq) goto next;
    }
    {
      const double t0 = now_s();
      double last_check = t0;
      while (s->load(std::memory_order_acquire) < seq) {
        const double t = now_s();
        const double waited = t - t0;
        if (waited < 1e-3) {
          sched_yield();
          continue;
        }
        if (t - last_check > 0.05) {
          last_check = t;
          if (!pid_alive(*pid_of(base, r))) {
            *bad_rank = r;
            return kPeerDead;
          }
        }
        if (timeout_s > 0 && waited > timeout_s) {
          *bad_rank = r;
          return kTimeout;
        }
        // Idle for over a second (a worker between requests): 1 ms naps, ~1000 wake-ups a
        // second; the first step after it starts at most 1 ms late.
        const long cap_ns = waited < 1.0 ? 200000 : 1000000;
        const long ns = (long)(waited * 1e9 / 64);
        timespec ts{0, ns < cap_ns ? ns : cap_ns};
        nanosleep(&ts, nullptr);
      }
    }
  next:;
  }
  return kOk;
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// out[i] = ((p[0][i] + p[1][i]) + p[2][i]) + ... : rank order, elementwise.
void sum_f32(float* out, char* const* parts, int world, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16 acc = load16(reinterpret_cast<const float*>(parts[0]) + i);
    for (int r = 1; r < world; ++r) acc += load16(reinterpret_cast<const float*>(parts[r]) + i);
    store16(out + i, acc);
  }
  for (; i < n; ++i) {
    float acc = reinterpret_cast<const float*>(parts[0])[i];
    for (int r = 1; r < world; ++r) acc += reinterpret_cast<const float*>(parts[r])[i];
    out[i] = acc;
  }
}

// The same in fp32 over bf16 parts, rounded once at the end.
void sum_bf16(uint16_t* out, char* const* parts, int world, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = bf16_to_f32(reinterpret_cast<const uint16_t*>(parts[0])[i]);
    for (int r = 1; r < world; ++r) acc += bf16_to_f32(reinterpret_cast<const uint16_t*>(parts[r])[i]);
    out[i] = f32_to_bf16(acc);
  }
}

bool args_ok(char* base, int rank, int world, int64_t cap) {
  return base != nullptr && world >= 1 && world <= kMaxRanks && rank >= 0 && rank < world &&
         cap >= 64 && cap % 64 == 0;
}

}  // namespace

extern "C" {

// Bytes of a segment for `world` ranks with `cap` bytes per slot.
int64_t llmserve_shm_size(int world, int64_t cap) { return kCtrl + 2 * world * cap; }

// Called once by each rank after mapping: records its pid for the others' liveness checks.
int llmserve_shm_register(char* base, int rank, int world, int64_t cap) {
  if (!args_ok(base, rank, world, cap)) return kBadArgs;
  *pid_of(base, rank) = (int64_t)getpid();
  return kOk;
}

// Sum of every rank's x (fp32, dtype 0; bf16, dtype 1), n elements, in place on every rank.
int llmserve_shm_all_reduce(char* base, int rank, int world, int64_t cap, void* x, int64_t n,
                            int dtype, double timeout_s, int* bad_rank) {
  if (!args_ok(base, rank, world, cap) || n < 0 || (dtype != 0 && dtype != 1)) return kBadArgs;
  FlushMode mode;  // every rank sums in the same mode, whichever thread calls (simd.h)
  const int64_t elem = dtype == 0 ? 4 : 2;
  const int64_t per_round = cap / elem;
  char* parts[kMaxRanks];
  std::atomic<uint64_t>* mine = seq_of(base, rank);
  for (int64_t first = 0; first < n; first += per_round) {
    const int64_t m = n - first < per_round ? n - first : per_round;
    char* xs = static_cast<char*>(x) + first * elem;
    const uint64_t seq = mine->load(std::memory_order_relaxed) + 1;
    std::memcpy(slot(base, rank, world, cap, seq), xs, m * elem);
    mine->store(seq, std::memory_order_release);
    const int rc = wait_all(base, world, seq, timeout_s, bad_rank);
    if (rc != kOk) return rc;
    for (int r = 0; r < world; ++r) parts[r] = slot(base, r, world, cap, seq);
    if (dtype == 0)
      sum_f32(reinterpret_cast<float*>(xs), parts, world, m);
    else
      sum_bf16(reinterpret_cast<uint16_t*>(xs), parts, world, m);
  }
  return kOk;
}

// Every rank's rows of `row_bytes` side by side: out[i] = x_0[i] | x_1[i] | ... (the
// concatenation along the last dimension of [rows, row_bytes] parts). `out` may be null on ranks
// that do not need the result (a gather to one rank); every rank must call. A row must fit a slot.
int llmserve_shm_all_gather(char* base, int rank, int world, int64_t cap, const void* x,
                            int64_t rows, int64_t row_bytes, void* out, double timeout_s,
                            int* bad_rank) {
  if (!args_ok(base, rank, world, cap) || rows < 0 || row_bytes <= 0 || row_bytes > cap)
    return kBadArgs;
  const int64_t per_round = cap / row_bytes;
  std::atomic<uint64_t>* mine = seq_of(base, rank);
  for (int64_t first = 0; first < rows; first += per_round) {
    const int64_t m = rows - first < per_round ? rows - first : per_round;
    const uint64_t seq = mine->load(std::memory_order_relaxed) + 1;
    std::memcpy(slot(base, rank, world, cap, seq),
                static_cast<const char*>(x) + first * row_bytes, m * row_bytes);
    mine->store(seq, std::memory_order_release);
    const int rc = wait_all(base, world, seq, timeout_s, bad_rank);
    if (rc != kOk) return rc;
    if (out == nullptr) continue;
    char* dst = static_cast<char*>(out) + first * world * row_bytes;
    for (int64_t i = 0; i < m; ++i)
      for (int r = 0; r < world; ++r)
        std::memcpy(dst + (i * world + r) * row_bytes,
                    slot(base, r, world, cap, seq) + i * row_bytes, row_bytes);
  }
  return kOk;
}

// Rank 0's `nbytes` at x into every other rank's x.
int llmserve_shm_broadcast(char* base, int rank, int world, int64_t cap, void* x, int64_t nbytes,
                           double timeout_s, int* bad_rank) {
  if (!args_ok(base, rank, world, cap) || nbytes < 0) return kBadArgs;
  std::atomic<uint64_t>* mine = seq_of(base, rank);
  for (int64_t first = 0; first == 0 || first < nbytes; first += cap) {
    const int64_t m = nbytes - first < cap ? nbytes - first : cap;
    const uint64_t seq = mine->load(std::memory_order_relaxed) + 1;
    char* xs = static_cast<char*>(x) + first;
    if (rank == 0 && m > 0) std::memcpy(slot(base, 0, world, cap, seq), xs, m);
    mine->store(seq, std::memory_order_release);
    const int rc = wait_all(base, world, seq, timeout_s, bad_rank);
    if (rc != kOk) return rc;
    if (rank != 0 && m > 0) std::memcpy(xs, slot(base, 0, world, cap, seq), m);
    if (nbytes == 0) break;
  }
  return kOk;
}

}  // extern "C"
