// The prefill GEMM: out [rows, N] = x [rows, K] W^T for a prompt chunk's many rows on the FMAs,
// W [N, K] held as GGUF blocks (every format of block_tiles.cpp, and the panels of
// fma_panels.cpp). The block kernels multiply the codes and apply each group's scale to every
// row's sums (and below 64 rows expand the codes again for every few rows); here each weight is
// expanded once per call, exactly as GGUF dequantizes it, into a cache-resident fp32 buffer, and
// the rows then run plain register-blocked FMAs over it.
//
// A thread owns a run of column blocks (kBlockVectors vectors of 16 output columns; threads
// split columns, never K). Per block and K chunk (chunk_size: at most kMaxChunk weights): the
// chunk's weights are expanded to b [chunk][block columns] fp32, then every tile of up to
// kTileRows rows sums x[r, k] b[k, c] over the chunk as one FMA chain per output element from 0,
// and adds that to out (the first chunk stores it). So each output element's sum is the same
// chain of the same operations whatever the row count, the tile the row lands in (a last tile
// of fewer rows runs the same per-element chain) or the thread count: a row's output is
// bit-identical alone and in any batch (batch invariance by construction).
//
// Its bits differ from the block kernels' (another summation order) and from the AMX tiles';
// block_linear.cpp runs here the rows kvshare_block_linear_rows marks as prompt rows where the
// tiles are not taken.

#include <omp.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "block_kernels.h"
#include "kvshare_native.h"
#include "vectors.h"

namespace kvshare {
namespace {

// A tile: kTileRows rows x kBlockVectors vectors of accumulators, with room left for the block's
// weight vectors of one k and a broadcast activation: 24 + 2 + 1 of AVX-512's 32 registers,
// 12 + 2 + 1 of AVX2's 16 (a vector is two), 8 + 4 + 1 of SSE's 16 (a vector is four). 12 x 2
// ran as fast as 8 x 3 and 6 x 4 and faster than 24 x 1 (a GPR per row) on an AMD EPYC Zen 4.
#if defined(__AVX512F__)
constexpr int kTileRows = 12, kBlockVectors = 2;
#elif defined(__AVX2__)
constexpr int kTileRows = 6, kBlockVectors = 1;
#else
constexpr int kTileRows = 2, kBlockVectors = 1;
#endif
constexpr int kBlockColumns = kBlockVectors * kLanes;
// Weights per K chunk at most: a block's expanded chunk (64 KB at 32 columns) stays in L2 while
// every row tile reads it (two vector loads per 24 FMAs: L1 need not hold it), long enough that a
// tile's start and end cost little (128 ran 3-20% slower on an AMD EPYC Zen 4), and a chain sums
// at most this many products. The same at every level, so the FMA levels sum alike.
constexpr int kMaxChunk = 512;

// K's chunks: as even as whole 32-weight groups allow, none over kMaxChunk (576: 288 and 288).
// A function of K alone, as the summation order must be.
int chunk_size(int in_features) {
  const int chunks = (in_features + kMaxChunk - 1) / kMaxChunk;
  return (in_features / 32 + chunks - 1) / chunks * 32;
}

// out[r, 0 .. kBlockColumns) for r < kRows (rows out_stride apart): the chunk's sum over k <
// depth of x[r, k] b[k] (x rows x_stride apart), one chain per element, stored (first) or added.
template <int kRows>
void gemm_tile(const float* x, int64_t x_stride, const vfloat* b, int depth, float* out,
               int64_t out_stride, bool first) {
  vfloat acc[kRows][kBlockVectors] = {};
  for (int k = 0; k < depth; ++k) {
    vfloat w[kBlockVectors];
    for (int v = 0; v < kBlockVectors; ++v) w[v] = b[k * kBlockVectors + v];
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const float a = x[r * x_stride + k];
#pragma GCC unroll 4
      for (int v = 0; v < kBlockVectors; ++v) acc[r][v] += w[v] * a;
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kBlockVectors; ++v) {
      float* y = out + r * out_stride + v * kLanes;
      store(first ? acc[r][v] : load(y) + acc[r][v], y);
    }
}

using Tile = void (*)(const float*, int64_t, const vfloat*, int, float*, int64_t, bool);

template <int... kRows>
constexpr std::array<Tile, sizeof...(kRows)> tiles_of(std::integer_sequence<int, kRows...>) {
  return {&gemm_tile<kRows + 1>...};
}
// kTiles[n - 1]: the tile of n rows.
constexpr auto kTiles = tiles_of(std::make_integer_sequence<int, kTileRows>{});

// Panels (block_kernels.h): a block is kBlockVectors consecutive panels, whose lanes are
// already its columns. A panel past the last (an odd count) expands to zeros.
template <typename P>
struct PanelWeights {
  const uint8_t* weight;
  int in_features;
  int64_t num_panels;

  void begin_block(int64_t, std::vector<float>&) {}

  // b [depth][kBlockVectors] = block n0's weights k0 .. k0 + depth.
  void expand(int64_t n0, int k0, int depth, vfloat* b) const {
    const int64_t panel_bytes = int64_t{in_features / 32} * P::kBytes;
    for (int v = 0; v < kBlockVectors; ++v) {
      const int64_t p = n0 / kPanel + v;
      for (int g = k0 / 32; g < (k0 + depth) / 32; ++g) {
        vfloat* at = b + (32 * g - k0) * kBlockVectors + v;
        if (p >= num_panels) {
          for (int k = 0; k < 32; ++k) at[k * kBlockVectors] = vfloat{};
          continue;
        }
        const uint8_t* block = weight + p * panel_bytes + int64_t{g} * P::kBytes;
        const vfloat d = P::scales(block), m = P::mins(block);
        vfloat d_hi = d;
        if constexpr (P::kSplitScales) d_hi = P::scales_hi(block);
        for (int j = 0; j < P::kSteps; ++j) {
          const Codes q = P::codes(block, j);
          at[P::lo_k(j) * kBlockVectors] = dequantized(q.lo, d, m);
          at[P::hi_k(j) * kBlockVectors] = dequantized(q.hi, d_hi, m);
        }
      }
    }
  }

  // GGUF's value: d q + m, one rounding (d q, at most 23 bits, is exact); Q4_0's m = -8 d and
  // Q5_0's -16 d make it exactly (q - 8) d and (q - 16) d.
  static vfloat dequantized(vfloat q, vfloat d, vfloat m) {
    if constexpr (P::kHasMin) return q * d + m;
    return q * d;
  }
};

// Blocks in GGUF's row order: a block's rows dequantized once into the thread's scratch
// (blocks_lookup: GGUF's values), then each chunk transposed into columns. Columns past the last
// repeat it (never stored).
struct RowWeights {
  int format;
  const uint8_t* weight;
  int in_features;
  int64_t out_features;
  const float* rows = nullptr;  // [kBlockColumns, K]: the block's, once begin_block ran

  void begin_block(int64_t n0, std::vector<float>& scratch) {
    int64_t ids[kBlockColumns];
    for (int c = 0; c < kBlockColumns; ++c)
      ids[c] = n0 + c < out_features ? n0 + c : out_features - 1;
    scratch.resize(static_cast<size_t>(kBlockColumns) * in_features);
    blocks_lookup(format, weight, ids, scratch.data(), kBlockColumns, in_features);
    rows = scratch.data();
  }

  void expand(int64_t, int k0, int depth, vfloat* b) const {
    const float* from = rows + k0;
    float* to = reinterpret_cast<float*>(b);
    for (int k = 0; k < depth; ++k)
      for (int c = 0; c < kBlockColumns; ++c)
        to[k * kBlockColumns + c] = from[c * int64_t{in_features} + k];
  }
};

// Block n0 for every row, chunk by chunk, into out (or, for a last block wider than the
// columns left, into `partial` [rows, kBlockColumns], copied out after).
template <typename Weights>
void gemm_block(Weights& weights, const float* x, float* out, int64_t n0, int rows,
                int in_features, int64_t out_features, vfloat* b, std::vector<float>& scratch,
                std::vector<float>& partial, Asker& asker) {
  const bool whole = n0 + kBlockColumns <= out_features;
  if (!whole) partial.resize(static_cast<size_t>(rows) * kBlockColumns);
  float* y = whole ? out + n0 : partial.data();
  const int64_t y_stride = whole ? out_features : kBlockColumns;
  weights.begin_block(n0, scratch);
  const int chunk = chunk_size(in_features);  // the same for every block
  for (int k0 = 0; k0 < in_features; k0 += chunk) {
    const int depth = in_features - k0 < chunk ? in_features - k0 : chunk;
    weights.expand(n0, k0, depth, b);
    for (int r0 = 0; r0 < rows; r0 += kTileRows) {
      asker.ask();
      const int tile_rows = rows - r0 < kTileRows ? rows - r0 : kTileRows;
      kTiles[tile_rows - 1](x + r0 * int64_t{in_features} + k0, in_features, b, depth,
                            y + r0 * y_stride, y_stride, k0 == 0);
    }
  }
  if (whole) return;
  for (int r = 0; r < rows; ++r)
    std::memcpy(out + r * out_features + n0, y + r * y_stride,
                sizeof(float) * static_cast<size_t>(out_features - n0));
}

// The call: each thread a contiguous run of column blocks, as even as whole blocks allow.
template <typename Weights>
void gemm(Weights weights, const float* x, float* out, int rows, int in_features,
          int64_t out_features, int num_threads, const Companion* companion) {
  if (rows == 0) return;
  const int64_t num_blocks = (out_features + kBlockColumns - 1) / kBlockColumns;
  const int64_t chunks = (in_features + chunk_size(in_features) - 1) / chunk_size(in_features);
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = num_blocks * t / n, last = num_blocks * (t + 1) / n;
    Asker asker(companion, t, n, (last - first) * chunks * row_tiles);
    // Per thread, reused across calls (no allocation per step); vfloat's aligned allocation.
    thread_local std::vector<vfloat> expanded;
    thread_local std::vector<float> scratch, partial;
    expanded.resize(static_cast<size_t>(kMaxChunk) * kBlockVectors);
    Weights own = weights;  // the thread's copy: RowWeights points at the thread's scratch
    for (int64_t block = first; block < last; ++block)
      gemm_block(own, x, out, block * kBlockColumns, rows, in_features, out_features,
                 expanded.data(), scratch, partial, asker);
  }
}

}  // namespace

int prefill_gemm(int format, const float* x, const uint8_t* weight, float* out, int rows,
                 int in_features, int64_t out_features, int num_threads,
                 const Companion* companion) {
  if (format > kPanelCode) {
    if (in_features % 32 || out_features % kPanel) return 2;
    return with_panel_format(format, [&](auto tag) {
      using P = decltype(tag);
      const PanelWeights<P> weights{weight, in_features, out_features / kPanel};
      gemm(weights, x, out, rows, in_features, out_features, num_threads, companion);
      return 0;
    });
  }
  // No rows looked up: only the format and the row length checked (1 or 2, as the linears).
  const int status = blocks_lookup(format, weight, nullptr, nullptr, 0, in_features);
  if (status != 0) return status;
  const RowWeights weights{format, weight, in_features, out_features};
  gemm(weights, x, out, rows, in_features, out_features, num_threads, companion);
  return 0;
}

}  // namespace kvshare

// The entry point (kvshare_native.h says what it takes and returns).
using namespace kvshare;

extern "C" {

int kvshare_prefill_gemm(int format, const float* x, const uint8_t* weight, float* out, int rows,
                         int in_features, int64_t out_features, int num_threads) {
  return prefill_gemm(format, x, weight, out, rows, in_features, out_features, num_threads,
                      nullptr);
}

}  // extern "C"
