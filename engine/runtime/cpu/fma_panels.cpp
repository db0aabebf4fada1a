// Linear layers on panels (block_kernels.h: the GGUF blocks laid out so that a vector's lanes
// are 16 output columns) computed on the FMAs: each thread a contiguous run of panels, every
// row tile over a chunk of kWidePanels of them in turn. amx_panels.cpp computes the same panels
// (those amx_format names) on AMX tiles; block_linear.cpp picks which.

#include <omp.h>

#include <cstdint>
#include <vector>

#include "block_kernels.h"
#include "kvshare_native.h"
#include "vectors.h"

namespace kvshare {
namespace {

// Many rows: a chunk's panels are expanded to fp32 once (expand_panels) and every row tile reads
// them back from that buffer, so the FMAs no longer share their ports with the expansion. The
// floats are the same, and so are the operations on them and their order: the rows come out
// bit-identical to the expanding path (tests/engine/runtime/test_block_linear.py).
constexpr int kExpandRows = 64;

// A chunk's panels [p, p + num), expanded: per panel, group and code step, the lo and hi vectors.
template <typename P>
void expand_panels(const uint8_t* weight, int64_t p, int num, int groups, vfloat* expanded) {
  each_group<P>(weight, p, num, groups, [&](int64_t i, const uint8_t* block) {
    vfloat* codes = expanded + i * 2 * P::kSteps;
    for (int j = 0; j < P::kSteps; ++j) {
      const Codes w = P::codes(block, j);
      codes[2 * j] = w.lo;
      codes[2 * j + 1] = w.hi;
    }
  });
}

// Panels [p, p + num) for every row tile, one panel at a time (see kWidePanels).
template <typename P>
void panel_chunk(const float* x, const float* sums, const uint8_t* weight, float* out, int64_t p,
                 int num, int rows, int in_features, int64_t out_features,
                 const vfloat* expanded, Asker& asker) {
  const int groups = in_features / 32;
  const int64_t panel_codes = int64_t{groups} * 2 * P::kSteps;  // one expanded panel's vectors
  for (int r0 = 0; r0 < rows; r0 += kPanelTileRows) {
    const float* xs = x + r0 * int64_t{in_features};
    const float* ss = sums + r0 * int64_t{groups};
    float* ys = out + r0 * out_features;
    const int K = in_features;
    const int64_t V = out_features;
    const int tile_rows = rows - r0 < kPanelTileRows ? rows - r0 : kPanelTileRows;
    for (int64_t q = p; q < p + num; ++q) {
      if (expanded != nullptr && tile_rows == kPanelTileRows) {
        // Full row tiles read the expanded panels; the last few rows expand as they go (the
        // same floats either way).
        const vfloat* e = expanded + (q - p) * panel_codes;
        panel_tile<P, kPanelTileRows, true>(xs, ss, weight, ys, q, K, V, asker, e);
        continue;
      }
      switch (tile_rows) {
        case 1: panel_tile<P, 1>(xs, ss, weight, ys, q, K, V, asker); break;
#if defined(__AVX512F__)
        case 2: panel_tile<P, 2>(xs, ss, weight, ys, q, K, V, asker); break;
        case 3: panel_tile<P, 3>(xs, ss, weight, ys, q, K, V, asker); break;
        default: panel_tile<P, 4>(xs, ss, weight, ys, q, K, V, asker);
#else
        default: panel_tile<P, 2>(xs, ss, weight, ys, q, K, V, asker);
#endif
      }
    }
  }
}

// On the FMAs (amx_panels.cpp has the tiles' path).
template <typename P>
void panel_linear(const float* x, const uint8_t* weight, float* out, int rows, int in_features,
                  int64_t out_features, int num_threads, const Companion* companion) {
  // The group sums live as long as the call; reused across calls (no allocation per step).
  thread_local std::vector<float> sums;
  if constexpr (P::kHasMin) {
    sums.resize(static_cast<size_t>(rows) * (in_features / 32));
    group_sums(x, sums.data(), rows, in_features);
  }
  const float* s = sums.data();
  const int64_t num_panels = out_features / kPanel;
#pragma omp parallel num_threads(num_threads)
  {
    // Each thread a contiguous run of panels, as even as whole panels allow.
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = num_panels * t / n, last = num_panels * (t + 1) / n;
    const int64_t row_tiles = (rows + kPanelTileRows - 1) / kPanelTileRows;
    Asker asker(companion, t, n, (last - first) * row_tiles * (in_features / 32));
    // Per thread, reused across calls: a chunk's expanded panels (144-384 KB on SmolLM2's shapes,
    // in L2). An aligned vector type: std::vector gets it the aligned allocation it needs.
    thread_local std::vector<vfloat> expanded;
    const bool expand = rows >= kExpandRows;
    if (expand)
      expanded.resize(static_cast<size_t>(kWidePanels) * (in_features / 32) * 2 * P::kSteps);
    for (int64_t p = first; p < last; p += kWidePanels) {
      const int num = static_cast<int>(last - p < kWidePanels ? last - p : kWidePanels);
      if (expand) expand_panels<P>(weight, p, num, in_features / 32, expanded.data());
      panel_chunk<P>(x, s, weight, out, p, num, rows, in_features, out_features,
                     expand ? expanded.data() : nullptr, asker);
    }
  }
}

// Rows `ids` of a panel table (a tied embedding) as GGUF dequantizes them: d q (+ m) per weight,
// one rounding at most (a 4- to 8-bit code times an fp16 scale needs at most 19 bits, times a
// K-quant panel's fp32 D at most 23: both exact).
template <typename P>
void panel_rows(const uint8_t* table, const int64_t* ids, float* out, int rows, int in_features) {
  const int groups = in_features / 32;
  const int64_t panel_bytes = int64_t{groups} * P::kBytes;
  for (int r = 0; r < rows; ++r) {
    const int64_t panel = ids[r] / kPanel;
    const int lane = static_cast<int>(ids[r] % kPanel);
    float* y = out + r * int64_t{in_features};
    for (int g = 0; g < groups; ++g) {
      const uint8_t* block = table + panel * panel_bytes + int64_t{g} * P::kBytes;
      const float d = P::scales(block)[lane], m = P::mins(block)[lane];
      float d_hi = d;
      if constexpr (P::kSplitScales) d_hi = P::scales_hi(block)[lane];
      for (int j = 0; j < P::kSteps; ++j) {
        const Codes w = P::codes(block, j);
        y[32 * g + P::lo_k(j)] = w.lo[lane] * d + m;
        y[32 * g + P::hi_k(j)] = w.hi[lane] * d_hi + m;
      }
    }
  }
}

}  // namespace

void group_sums(const float* x, float* sums, int rows, int in_features) {
  const int groups = in_features / 32;
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) {
      const float* xg = x + r * int64_t{in_features} + 32 * g;
      sums[r * int64_t{groups} + g] = sum(load(xg) + load(xg + kLanes));
    }
}

int panels_linear(int format, const float* x, const uint8_t* weight, float* out, int rows,
                  int in_features, int64_t out_features, int num_threads,
                  const Companion* companion) {
  return with_panel_format(format, [&](auto tag) {
    panel_linear<decltype(tag)>(x, weight, out, rows, in_features, out_features, num_threads,
                                companion);
    return 0;
  });
}

int panels_lookup(int format, const uint8_t* table, const int64_t* ids, float* out, int rows,
                  int in_features) {
  return with_panel_format(format, [&](auto tag) {
    panel_rows<decltype(tag)>(table, ids, out, rows, in_features);
    return 0;
  });
}

}  // namespace kvshare
