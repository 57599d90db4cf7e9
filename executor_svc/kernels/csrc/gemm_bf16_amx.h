// The AMX tile path of the step-invariant bf16 GEMM: part of gemm_bf16.cpp (included there, in
// its anonymous namespace, when the build has AMX-BF16: the library's "amx" variant).
//
// Not the bits of vdpbf16ps. By the Intel SDM's pseudo-code, TDPBF16PS would add each pair's
// two products to the fp32 accumulator one after the other, each rounded (the even element
// first, where VDPBF16PS takes the odd one first: swapping both operands' pairs would have given
// the module's chain). Measured on an AMX Xeon (docs/benchmarks.md, "AMX";
// benchmarks/probe_amx_order.py) it rounds otherwise: with pairs swapped or not, its results
// equal that chain's on about a fifth of the elements. So the amx variant keeps step invariance
// its own way: every row count, one row (decode) included, runs on the tiles, in one order per
// output element whatever the rows: the k pairs through the tiles in ascending order, 16 per
// step, into one C tile zeroed once (no K split, no partial sums), each row of a tile computed
// on its own. Its results are within rounding of the other variants' (tested against them).
//
// K (in pairs) is padded to whole steps in the packed weights: by K alone, so the same for every
// step. The padded pairs hold bf16 -0 in the weights and +0 in the rows: each such product is
// -0, which IEEE addition adds to any accumulator, a flushed -0 too, without changing it. The rows
// are read in place when K / 2 is a multiple of the step, else from a zero-padded copy.
//
// Tiles: 0-3 C (fp32, 16 columns), 4-5 A (up to 16 rows x 16 pairs), 6-7 B (16 pairs x 16
// columns x 2). A unit of work is one panel (kNR = 32 columns: two B tiles) and 32 rows (2 x 2 C
// tiles), or, for at most 16 rows, one or two panels (1 x 2 or 1 x 4 C tiles).

// (No includes of its own: it sits inside gemm_bf16.cpp's namespace, which includes for it.)

constexpr int kTilePairs = 16;  // pairs of k per tile step: 64 bytes of an A row, 16 B rows

// Rows from which a call takes the tiles (fewer: the vdpbf16ps and FMA paths, whose bits differ:
// only tests and benchmarks change it) and how many tile steps ahead the weights are prefetched
// (0: none); llmserve_gemm_bf16_amx_set.
std::atomic<int64_t> g_amx_min_rows{1};
std::atomic<int64_t> g_amx_prefetch{4};
// 1: each tile load just before its first use (the next step's loads overlap this step's last
// products); 0: a step's four loads, then its products. The same products in the same order per
// C tile either way (the same bits); llmserve_gemm_bf16_amx_set(2, ...).
std::atomic<int64_t> g_amx_interleave{1};
std::atomic<bool> g_amx_ready{false};  // llmserve_amx_init succeeded in this process

struct TileConfig {  // the 64-byte operand of LDTILECFG, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// This thread's tile shapes: A tile 4 and C tiles 0, 1 of r0 rows; A tile 5 and C tiles 2, 3
// of r1 rows; B tiles of kTilePairs pair rows. LDTILECFG zeroes the tiles: a unit reconfigures
// (when its rows differ from the last unit's) before it zeroes its C tiles.
struct TileShape {
  int r0 = 0, r1 = 0;

  void set(int rows0, int rows1) {
    if (rows0 == r0 && rows1 == r1) return;
    r0 = rows0, r1 = rows1;
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = (uint8_t)(t >= 6 ? kTilePairs : (t == 2 || t == 3 || t == 5) ? r1 : r0);
    }
    _tile_loadconfig(&cfg);
  }
};

// Bias, then the store (fp32, or rounded to nearest even bf16 as to_bf16 does) of up to 16
// columns of one row; under the thread's FlushMode, as `finish`.
inline void put16(const Out& y, int64_t r, int64_t c, int64_t n, const float* v, const float* b) {
  const __mmask16 m = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
  __m512 s = _mm512_loadu_ps(v);
  if (b) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m, b + c));
  if (y.f32) {
    _mm512_mask_storeu_ps(y.f32 + r * y.ld + c, m, s);
    return;
  }
  const __m512i bits = _mm512_castps_si512(s);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  _mm256_mask_storeu_epi16(y.bf16 + r * y.ld + c, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
}

struct AmxGemm {
  const uint16_t* a;  // the rows, bf16 [M][lda], K / 2 pairs then (in a copy) zeros up to K2s
  int64_t lda, M, K2s;
  const uint16_t* w;  // packed panels, [P][K2s][kNR][2]
  int64_t N, P;
  const float* bias;
  Out y;

  // The weights of panel p from pair step kt on; row stride kNR pairs (128 bytes).
  const uint16_t* b(int64_t p, int64_t kt) const { return w + (p * K2s + kt) * kNR * 2; }

  // The weights `ahead` tile steps on, into L1: past the panel's end that is the next panel's
  // start (panels lie one after the other), which a thread's next unit takes.
  void prefetch(int64_t p, int64_t kt) const {
    const int64_t ahead = g_amx_prefetch.load(std::memory_order_relaxed);
    if (ahead <= 0 || p * K2s + kt + ahead * kTilePairs >= P * K2s) return;
    const char* line = (const char*)b(p, kt + ahead * kTilePairs);
    for (int i = 0; i < kTilePairs * kNR * 4; i += 64) _mm_prefetch(line + i, _MM_HINT_T0);
  }

  // Rows [m0, m0 + 16 * RA) (fewer at the end) x panels [p, p + PB): RA A tiles, PB panels of
  // two B tiles.
  template <int RA, int PB, bool IL>
  void unit(int64_t m0, int64_t p, TileShape* shape) const {
    static_assert(RA * PB <= 2, "4 C tiles at most");
    const int64_t rows = std::min<int64_t>(M - m0, 16 * RA);
    const int r0 = (int)std::min<int64_t>(rows, 16);
    shape->set(r0, RA == 2 ? (int)(rows - 16) : r0);
    const uint16_t* a0 = a + m0 * lda;
    const uint16_t* a1 = a0 + 16 * lda;
    const int64_t sa = lda * 2, sb = kNR * 4;  // row strides, bytes
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (RA * PB == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kt = 0; kt < K2s; kt += kTilePairs) {
      prefetch(p, kt);
      if constexpr (IL) {
        _tile_loadd(4, a0 + 2 * kt, sa);
        _tile_loadd(6, b(p, kt), sb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b(p, kt) + 32, sb);
        _tile_dpbf16ps(1, 4, 7);
        if constexpr (RA == 2) {
          _tile_loadd(5, a1 + 2 * kt, sa);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      } else {
        _tile_loadd(4, a0 + 2 * kt, sa);
        if constexpr (RA == 2) _tile_loadd(5, a1 + 2 * kt, sa);
        _tile_loadd(6, b(p, kt), sb);
        _tile_loadd(7, b(p, kt) + 32, sb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if constexpr (RA == 2) {
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      if constexpr (PB == 2) {
        prefetch(p + 1, kt);
        _tile_loadd(6, b(p + 1, kt), sb);
        if constexpr (IL) _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, b(p + 1, kt) + 32, sb);
        if constexpr (!IL) _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
      }
    }
    alignas(64) float c[4][16 * 16];
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    if constexpr (RA * PB == 2) {
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
    }
    // C tile t: rows 16 * (t / (2 * PB)) on, columns 16 * (t % (2 * PB)) from panel p's first.
    const int64_t ncols = std::min<int64_t>(N - p * kNR, PB * kNR);
    for (int t = 0; t < 2 * RA * PB; ++t) {
      const int64_t r0 = 16 * (t / (2 * PB)), c0 = 16 * (t % (2 * PB));
      for (int64_t r = r0; r < std::min<int64_t>(rows, r0 + 16); ++r)
        if (c0 < ncols) put16(y, m0 + r, p * kNR + c0, ncols - c0, c[t] + (r - r0) * 16, bias);
    }
  }
};

template <bool IL>
void run_units(const AmxGemm& g, int64_t units, bool pairs, int64_t blocks, bool parallel,
               int num_threads) {
  const int64_t M = g.M;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    BfMode mode;
    TileShape shape;
    int64_t u0, u1;
    share(units, omp_get_thread_num(), omp_get_num_threads(), &u0, &u1);
    for (int64_t u = u0; u < u1; ++u) {
      if (M <= 16 && pairs) {
        if (2 * u + 1 < g.P)
          g.unit<1, 2, IL>(0, 2 * u, &shape);
        else
          g.unit<1, 1, IL>(0, 2 * u, &shape);
      } else if (M <= 16) {
        g.unit<1, 1, IL>(0, u, &shape);
      } else {
        const int64_t p = u / blocks, m0 = u % blocks * 32;
        if (M - m0 > 16)
          g.unit<2, 1, IL>(m0, p, &shape);
        else
          g.unit<1, 1, IL>(m0, p, &shape);
      }
    }
    _tile_release();
  }
}

// The whole product on the tiles. Threads split units (panel-major: a thread's consecutive
// units share a panel, which the first one streams from memory); each configures its own tiles.
inline void amx_gemm(const uint16_t* x, int64_t M, int64_t K2, int64_t ldx, const uint16_t* w,
                     int64_t N, const float* bias, const Out& y, int num_threads) {
  const int64_t K2s = pairs_stride(K2);
  std::vector<uint16_t> copy;
  if (K2s != K2) {  // the last step would read past a row: a copy, zeros after each row's K
    copy.assign((size_t)(M * K2s * 2), 0);
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(copy.data() + m * K2s * 2, x + m * ldx, (size_t)K2 * 4);
  }
  const AmxGemm g{copy.empty() ? x : copy.data(), copy.empty() ? ldx : K2s * 2, M, K2s, w, N,
                  (N + kNR - 1) / kNR, bias, y};
  const int64_t blocks = (M + 31) / 32;
  // One row tile: pairs of panels where a thread gets several; else single panels.
  const bool pairs = M <= 16 && g.P >= 4 * num_threads;
  const int64_t units = M <= 16 ? (pairs ? (g.P + 1) / 2 : g.P) : g.P * blocks;
  const bool parallel = num_threads > 1 && units > 1 && M * K2 * N >= (1 << 16);
  if (g_amx_interleave.load(std::memory_order_relaxed))
    run_units<true>(g, units, pairs, blocks, parallel, num_threads);
  else
    run_units<false>(g, units, pairs, blocks, parallel, num_threads);
}
