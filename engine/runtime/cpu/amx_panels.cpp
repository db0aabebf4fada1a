// Panels on AMX tiles.
//
// Where the CPU has AMX (amx_tile and amx_bf16, as Intel Xeons from Sapphire Rapids on do) and
// the OS lets this process use its tile registers, the panel formats multiply on the tiles
// instead of the FMAs, at every row count. A tile op takes bf16 values only, so each fp32
// activation is split into three bf16 parts whose sum is exactly x: the top 8 significant bits,
// the next 8 of what is left, then the rest (at most 8 bits; x has 24). The codes are small
// integers, exact in bf16, and each product of a part and a code is exact in fp32 (8 x 8 bits),
// so a group's sum_k x_k q_k is computed on the exact products; only the summation order and
// its roundings differ from the FMA chains, as F.linear's do from any other order. Per output
// element and 32-weight group: the three parts' tile products accumulated in one tile (zeroed,
// then parts 1, 2, 3), times d into the running sum, then m times the row's group sum, as the
// FMA path does. A tile's row of results depends only on that row's activations and the panel
// (checked at 1, 3 and 16 rows), so a row's output is bit-identical at every row count and
// every tile shape: batch invariance by construction, as before. AMX gives other bits than the
// FMA path, so which path a row takes must never depend on the batch it is in: the caller says
// per row (kvshare_block_linear_rows), and the engine decides by the token alone.
//
// On a 2-core AMX Xeon a 512-token prefill chunk ran 1.8-2x faster than on the FMAs, a batch-8
// decode step as fast, but a lone decode row 1.7x slower: one row uses a sixteenth of a tile op
// while its B tile must still be built in memory (a store per 32 weights) and read back, where
// the FMA path consumes the codes in registers (benchmarks/README.md, seventeenth round). So the
// engine puts a request's prompt tokens on the tiles and the tokens it generates on the FMAs
// (engine/runtime/model_runner.py, tile_rows; KVSHARE_CPU_AMX=0 keeps every row on the FMAs).
// Calls that do not say (kvshare_block_linear, the greedy head) take the process's default,
// the FMAs unless kvshare_panel_amx turned the tiles on (tests and benchmarks do).
//
// Layout: B, one panel's group, is 16 rows (code steps j) of 16 pairs (columns), pair c of row j
// being (lo code j, hi code j) of column c as bf16; A, one group of a row's part, holds at pair j
// the activations of those two codes, (x[lo_k(j)], x[hi_k(j)]). A tile op then sums, per row and
// column, the 32 products of the group.

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_kernels.h"
#include "kvshare_native.h"
#include "vectors.h"

#if defined(KVSHARE_AMX_BUILD)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvshare {

#if defined(KVSHARE_AMX_BUILD)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVSHARE_AMX_TARGET
#else
#define KVSHARE_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#endif

namespace {
std::atomic<bool> amx_enabled{false};  // the default path: FMAs unless asked (kvshare_panel_amx)
}  // namespace

// The CPU has AMX bf16 and Linux gives this process the tile data state (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, Linux 5.16 on): asked once.
bool amx_supported() {
  static const bool supported = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return supported;
}

bool amx_active() { return amx_enabled.load(std::memory_order_relaxed) && amx_supported(); }

namespace {

constexpr int kAmxRows = 16;  // a tile's rows (activation rows per tile op)
constexpr int kAmxParts = 3;  // bf16 parts of an fp32 activation
// Tiles (the intrinsics take their numbers as literals): 0, 1, 6 and 7 results (a chunk's four
// panels), 2-4 the three parts of A, 5 B.
constexpr int kAmxTiles = 8;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles for `rows` activation rows: results and parts `rows` x 64 bytes, B (tile 5) 16 x 64.
KVSHARE_AMX_TARGET inline void amx_configure(int rows) {
  TileConfig config;
  for (int t = 0; t < kAmxTiles; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = static_cast<uint8_t>(t == 5 ? 16 : rows);
  }
  _tile_loadconfig(&config);
}

// The split: x = a + b + c exactly, each of a, b, c a bf16 (an fp32 whose low 16 bits are 0).
inline void split_parts(__m512 x, __m512* part) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), top));
  const __m512 rest = _mm512_sub_ps(x, a);
  const __m512 b = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest), top));
  part[0] = a, part[1] = b, part[2] = _mm512_sub_ps(rest, b);
}

// 16 pairs (lo[i], hi[i]) of bf16 in 32-bit lanes, from fp32 values that are bf16 already.
inline __m512i pair_bf16(__m512 lo, __m512 hi) {
  return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                         _mm512_castps_si512(hi));
}

// x [rows, K] as A: parts [3][rows][K] bf16, group g's pair j at 32 g + 2 j.
template <typename P>
void split_rows(const float* x, uint16_t* parts, int rows, int in_features) {
  alignas(64) int32_t lo_index[16], hi_index[16];
  for (int j = 0; j < 16; ++j) lo_index[j] = P::lo_k(j), hi_index[j] = P::hi_k(j);
  const __m512i lo_k = _mm512_load_si512(lo_index), hi_k = _mm512_load_si512(hi_index);
  const int64_t plane = int64_t{rows} * in_features;
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < in_features; k += 32) {
      const float* xg = x + r * int64_t{in_features} + k;
      const __m512 first = _mm512_loadu_ps(xg), second = _mm512_loadu_ps(xg + 16);
      __m512 lo[kAmxParts], hi[kAmxParts];
      split_parts(_mm512_permutex2var_ps(first, lo_k, second), lo);
      split_parts(_mm512_permutex2var_ps(first, hi_k, second), hi);
      for (int q = 0; q < kAmxParts; ++q)
        _mm512_storeu_si512(parts + q * plane + r * int64_t{in_features} + k,
                            pair_bf16(lo[q], hi[q]));
    }
}

// Panels [p, p + num) as B tiles: per panel and group, 16 rows of 16 pairs (1 KB).
template <typename P>
void expand_panels_bf16(const uint8_t* weight, int64_t p, int num, int groups, uint16_t* tiles) {
  each_group<P>(weight, p, num, groups, [&](int64_t i, const uint8_t* block) {
    for (int line = 0; line < P::kBytes; line += 64)
      __builtin_prefetch(block + kPrefetchBytes + line, 0, 3);
    for (int j = 0; j < P::kSteps; ++j)
      _mm512_store_si512(tiles + i * 512 + 32 * j, P::pairs(block, j));
  });
}

// Panel c of a chunk (c < num) in result tile C: zeroed, then B (that panel's group, into tile
// 5) times the three parts already in tiles 2-4.
#define KVSHARE_AMX_PANEL(c, C)                      \
  if (num > c) {                                     \
    _tile_zero(C);                                   \
    _tile_loadd(5, tiles + (c * groups + g) * 512, 64); \
    _tile_dpbf16ps(C, 2, 5);                         \
    _tile_dpbf16ps(C, 3, 5);                         \
    _tile_dpbf16ps(C, 4, 5);                         \
    _tile_stored(C, products[c], 64);                \
  }

// out[r0 + r, 16 (p + c) + lane] for r < M (M <= 16, the tiles configured for M rows) and the
// chunk's num <= 4 panels: per group, the three parts are loaded once and serve every panel;
// the running sums live in a local block (16 KB, in L1), not in `out`, whose rows lie a
// multiple of 4 KB apart on most shapes and evict each other from L1 (a third of the time went
// to reading them back). A group's products are read back one group later, after their store.
template <typename P>
KVSHARE_AMX_TARGET void amx_tiles(const uint16_t* parts, int64_t plane, const float* sums,
                                  const uint16_t* tiles, const uint8_t* weight, float* out,
                                  int64_t p, int num, int r0, int M, int in_features,
                                  int64_t out_features, Asker& asker) {
  const int groups = in_features / 32;
  const int64_t panel_bytes = int64_t{groups} * P::kBytes;
  const int stride = 2 * in_features;
  alignas(64) float stored[2][kWidePanels][kAmxRows][kPanel];
  alignas(64) float sums_of_rows[kWidePanels][kAmxRows][kPanel];
  // sums += d * group g's products, then + m * the row's group sum (from 0 at the first group).
  auto add = [&](int64_t g) {
    for (int c = 0; c < num; ++c) {
      const uint8_t* block = weight + (p + c) * panel_bytes + g * P::kBytes;
      const __m512 d = reinterpret_cast<__m512>(P::scales(block));
      const __m512 m = reinterpret_cast<__m512>(P::mins(block));
      for (int r = 0; r < M; ++r) {
        float* y = sums_of_rows[c][r];
        const __m512 before = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(y);
        __m512 acc = _mm512_fmadd_ps(d, _mm512_load_ps(stored[g & 1][c][r]), before);
        if constexpr (P::kHasMin)
          acc = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[(r0 + r) * int64_t{groups} + g]), acc);
        _mm512_store_ps(y, acc);
      }
    }
  };
  const uint16_t* a = parts + r0 * int64_t{in_features};
  for (int64_t g = 0; g < groups; ++g) {
    asker.ask();
    _tile_loadd(2, a + 32 * g, stride);
    _tile_loadd(3, a + plane + 32 * g, stride);
    _tile_loadd(4, a + 2 * plane + 32 * g, stride);
    float (*products)[kAmxRows][kPanel] = stored[g & 1];
    KVSHARE_AMX_PANEL(0, 0)
    KVSHARE_AMX_PANEL(1, 1)
    KVSHARE_AMX_PANEL(2, 6)
    KVSHARE_AMX_PANEL(3, 7)
    if (g > 0) add(g - 1);
  }
  add(groups - 1);
  for (int c = 0; c < num; ++c)
    for (int r = 0; r < M; ++r)
      std::memcpy(out + (r0 + r) * out_features + (p + c) * kPanel, sums_of_rows[c][r],
                  sizeof(float) * kPanel);
}
#undef KVSHARE_AMX_PANEL

template <typename P>
KVSHARE_AMX_TARGET void amx_linear(const float* x, const uint8_t* weight, float* out, int rows,
                                   int in_features, int64_t out_features, int num_threads,
                                   const Companion* companion) {
  const int groups = in_features / 32;
  const int64_t plane = int64_t{rows} * in_features;
  thread_local std::vector<uint16_t> part_buffer;
  thread_local std::vector<float> sum_buffer;
  part_buffer.resize(static_cast<size_t>(kAmxParts * plane));
  if constexpr (P::kHasMin) sum_buffer.resize(static_cast<size_t>(rows) * groups);
  uint16_t* parts = part_buffer.data();
  float* sums = sum_buffer.data();
  const int64_t num_panels = out_features / kPanel;
  // On the calling thread: a barrier inside the parallel region costs a time slice whenever
  // the host deschedules one of the threads, and the split is a small part of the call.
  split_rows<P>(x, parts, rows, in_features);
  if constexpr (P::kHasMin) group_sums(x, sums, rows, in_features);
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = num_panels * t / n, last = num_panels * (t + 1) / n;
    const int row_tiles = (rows + kAmxRows - 1) / kAmxRows;
    const int64_t chunks = (last - first + kWidePanels - 1) / kWidePanels;
    Asker asker(companion, t, n, chunks * row_tiles * groups);
    thread_local std::vector<vfloat> tile_buffer;  // aligned: its stores are whole lines
    tile_buffer.resize(static_cast<size_t>(kWidePanels) * groups * 16);
    uint16_t* tiles = reinterpret_cast<uint16_t*>(tile_buffer.data());
    int configured = -1;
    for (int64_t p = first; p < last; p += kWidePanels) {
      const int num = static_cast<int>(last - p < kWidePanels ? last - p : kWidePanels);
      expand_panels_bf16<P>(weight, p, num, groups, tiles);
      for (int r0 = 0; r0 < rows; r0 += kAmxRows) {
        const int M = rows - r0 < kAmxRows ? rows - r0 : kAmxRows;
        if (M != configured) amx_configure(M), configured = M;
        amx_tiles<P>(parts, plane, sums, tiles, weight, out, p, num, r0, M, in_features,
                     out_features, asker);
      }
    }
    if (configured >= 0) _tile_release();
  }
}

// Panel p's outputs for one row x [K] into out[16 p, 16 p + 16): what amx_linear gives that row
// at any row count (the greedy head's exact panels).
template <typename P>
KVSHARE_AMX_TARGET void amx_panel_row(const float* x, const uint8_t* weight, float* out,
                                      int64_t p, int in_features, int64_t out_features) {
  const int groups = in_features / 32;
  thread_local std::vector<uint16_t> part_buffer;
  thread_local std::vector<vfloat> tile_buffer;
  thread_local std::vector<float> sum_buffer;
  part_buffer.resize(static_cast<size_t>(kAmxParts) * in_features);
  tile_buffer.resize(static_cast<size_t>(groups) * 16);
  uint16_t* tiles = reinterpret_cast<uint16_t*>(tile_buffer.data());
  split_rows<P>(x, part_buffer.data(), 1, in_features);
  if constexpr (P::kHasMin) {
    sum_buffer.resize(groups);
    group_sums(x, sum_buffer.data(), 1, in_features);
  }
  expand_panels_bf16<P>(weight, p, 1, groups, tiles);
  Asker none(nullptr, 0, 1, 0);
  amx_configure(1);
  amx_tiles<P>(part_buffer.data(), in_features, sum_buffer.data(), tiles, weight, out, p, 1, 0,
               1, in_features, out_features, none);
  _tile_release();
}

}  // namespace

int amx_panels_linear(int format, const float* x, const uint8_t* weight, float* out, int rows,
                      int in_features, int64_t out_features, int num_threads,
                      const Companion* companion) {
  if (!amx_format(format)) return 1;
  return with_panel_format(format, [&](auto tag) {
    using P = decltype(tag);
    if constexpr (!P::kOnTiles) {
      return 1;  // never asked (amx_format)
    } else {
      amx_linear<P>(x, weight, out, rows, in_features, out_features, num_threads, companion);
      return 0;
    }
  });
}

void amx_q8_0_panel_row(const float* x, const uint8_t* weight, float* out, int64_t p,
                        int in_features, int64_t out_features) {
  amx_panel_row<PanelQ8_0>(x, weight, out, p, in_features, out_features);
}
#endif

}  // namespace kvshare

// The entry point (kvshare_native.h says what it takes and returns).
using namespace kvshare;

extern "C" {

int kvshare_panel_amx(int enable) {
#if defined(KVSHARE_AMX_BUILD)
  if (enable >= 0) amx_enabled.store(enable != 0);
#endif
  return amx_active() ? 1 : 0;
}

}  // extern "C"
