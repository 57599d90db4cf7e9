// The AMX tile path of the step-invariant bf16 GEMM: part of gemm_bf16.cpp (included there, in
// its anonymous namespace, when the build has AMX-BF16: the library's "amx" variant).
//
// TDPBF16PS, per the Intel SDM's pseudo-code, updates each fp32 element of C for each pair k of a
// 64-byte row as acc += a[2k] * b[2k], then acc += a[2k + 1] * b[2k + 1]: the even element first,
// where VDPBF16PS takes the odd one first. So this build keeps each pair swapped, in the packed
// weights (Python packs them so: llmserve_gemm_bf16_swapped) and in the copy of the rows made for
// the A tiles: the tile instruction then runs the module's chain (odd element first). The k pairs
// go through the tiles in ascending order into one C tile per output block, zeroed once: no K
// split, no partial sums. Whether the hardware rounds as the pseudo-code says (each product added
// with its own rounding, denormals flushed) is what tests/unit/test_gemm_amx.py checks.
//
// K is padded to whole tiles (kTilePairs pairs). The padded pairs hold bf16 -0 in the weights
// and +0 in the rows: each such product is -0, and acc + (-0) is acc exactly, also when acc is a
// flushed -0 (a +0 product would turn that into +0).
//
// Tiles: 0-3 C (fp32, 16 columns), 4-5 A (up to 16 rows x 16 pairs), 6-7 B (16 pairs x 16
// columns x 2). A unit of work is one panel (kNR = 32 columns: two B tiles) and 32 rows (2 x 2 C
// tiles), or, for at most 16 rows, one or two panels (1 x 2 or 1 x 4 C tiles).

// (No includes of its own: it sits inside gemm_bf16.cpp's namespace, which includes for it.)

constexpr int kTilePairs = 16;  // pairs of k per tile step: 64 bytes of an A row, 16 B rows

// Rows from which a call takes the tiles (fewer: vdpbf16ps, as in the avx512bf16 variant), and
// how many tile steps ahead the weights are prefetched (0: none). Settable for tests and
// benchmarks (llmserve_gemm_bf16_amx_set).
std::atomic<int64_t> g_amx_min_rows{2};
std::atomic<int64_t> g_amx_prefetch{4};
std::atomic<bool> g_amx_ready{false};  // llmserve_amx_init succeeded in this process

struct TileConfig {  // the 64-byte operand of LDTILECFG, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// This thread's tile shapes: C and A tiles of `rows` rows, B tiles of kTilePairs pair rows.
inline void amx_configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = (uint8_t)(t >= 6 ? kTilePairs : rows);
  }
  _tile_loadconfig(&cfg);
}

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
  const uint32_t* a;  // [ceil(M / 16) * 16][K2s] the rows, pairs swapped, zero-padded
  int64_t M, K2s;
  const uint16_t* w;  // packed panels, [P][K2s][kNR][2], pairs swapped
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

  // Rows [m0, m0 + 16 * RA) x panels [p, p + PB): RA A tiles, PB panels of two B tiles.
  template <int RA, int PB>
  void unit(int64_t m0, int64_t p) const {
    static_assert(RA * PB <= 2, "4 C tiles at most");
    const uint32_t* a0 = a + m0 * K2s;
    const uint32_t* a1 = a0 + 16 * K2s;
    const int64_t lda = K2s * 4, ldb = kNR * 4;  // bytes
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (RA * PB == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kt = 0; kt < K2s; kt += kTilePairs) {
      prefetch(p, kt);
      _tile_loadd(4, a0 + kt, lda);
      if constexpr (RA == 2) _tile_loadd(5, a1 + kt, lda);
      _tile_loadd(6, b(p, kt), ldb);
      _tile_loadd(7, b(p, kt) + 32, ldb);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (RA == 2) {
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      if constexpr (PB == 2) {
        prefetch(p + 1, kt);
        _tile_loadd(6, b(p + 1, kt), ldb);
        _tile_loadd(7, b(p + 1, kt) + 32, ldb);
        _tile_dpbf16ps(2, 4, 6);
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
    const int64_t rows = std::min<int64_t>(M - m0, 16 * RA);
    const int64_t ncols = std::min<int64_t>(N - p * kNR, PB * kNR);
    for (int t = 0; t < 2 * RA * PB; ++t) {
      const int64_t r0 = 16 * (t / (2 * PB)), c0 = 16 * (t % (2 * PB));
      for (int64_t r = r0; r < std::min<int64_t>(rows, r0 + 16); ++r)
        if (c0 < ncols) put16(y, m0 + r, p * kNR + c0, ncols - c0, c[t] + (r - r0) * 16, bias);
    }
  }
};

// The whole product on the tiles. Threads split units (panel-major: a thread's consecutive
// units share a panel, which the first one streams from memory); each configures its own tiles.
inline void amx_gemm(const uint16_t* x, int64_t M, int64_t K2, int64_t ldx, const uint16_t* w,
                     int64_t N, const float* bias, const Out& y, int num_threads) {
  const int64_t K2s = pairs_stride(K2), Mp = (M + 15) / 16 * 16;
  std::vector<uint32_t> a((size_t)(Mp * K2s), 0u);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < K2; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * i, 4);
      a[(size_t)(m * K2s + i)] = pair << 16 | pair >> 16;  // swapped: odd element in the low half
    }
  const AmxGemm g{a.data(), M, K2s, w, N, (N + kNR - 1) / kNR, bias, y};
  const int64_t blocks = (M + 31) / 32;
  // One row tile: pairs of panels where a thread gets several; else single panels.
  const bool pairs = M <= 16 && g.P >= 4 * num_threads;
  const int64_t units = M <= 16 ? (pairs ? (g.P + 1) / 2 : g.P) : g.P * blocks;
  const bool parallel = num_threads > 1 && units > 1 && M * K2 * N >= (1 << 16);
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    BfMode mode;
    amx_configure(M < 16 ? (int)M : 16);
    int64_t u0, u1;
    share(units, omp_get_thread_num(), omp_get_num_threads(), &u0, &u1);
    for (int64_t u = u0; u < u1; ++u) {
      if (M <= 16 && pairs) {
        if (2 * u + 1 < g.P)
          g.unit<1, 2>(0, 2 * u);
        else
          g.unit<1, 1>(0, 2 * u);
      } else if (M <= 16) {
        g.unit<1, 1>(0, u);
      } else {
        const int64_t p = u / blocks, m0 = u % blocks * 32;
        if (M - m0 > 16)
          g.unit<2, 1>(m0, p);
        else
          g.unit<1, 1>(m0, p);
      }
    }
    _tile_release();
  }
}
