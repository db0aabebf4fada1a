// Linear layers on GGUF block-quantized weights with fp32 activations: y [N, V] = x [N, K] W^T
// where each row of W [V, K] is stored as GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0: 32 weights a
// block; Q4_K, Q6_K: 256 weights a super-block of eight 32-weight groups).
//
// Each 32-weight group is expanded in registers to two vectors of 16 fp32 weights, exactly as
// GGUF dequantizes it (scale * code, plus the block minimum where the format has one), and
// multiplied into the fp32 activations of every row of the step. So the result is F.linear on
// the dequantized weights, with one fixed summation order per output element: 16 lane-wise
// partial sums over the K/32 groups in order, then the same tree of halves. That order does
// not depend on the number of rows, which rows share a tile, or the thread count: a row's
// output is bit-identical whatever else is in the batch (batch invariance by construction).
//
// Tiles: kCols output columns (weight rows) at a time, each group's weights expanded once per
// tile of up to kTileRows activation rows; the tile's blocks stay in L1 for the next row tile,
// so a step of any batch size reads each weight byte from memory once. Threads split output
// columns (tiles), never the K reduction.
//
// Built into the same library as paged_attention.cpp (engine/runtime/cpu/native.py), with the same
// ISA levels (vectors.h). The horizontal sum (vectors.h) is the one reduction order of every
// output element. The same blocks reordered into panels are fma_panels.cpp's and
// amx_panels.cpp's; block_linear.cpp picks the kernel.

#include <omp.h>

#include <cstdint>
#include <cstring>

#include "block_kernels.h"
#include "kvshare_native.h"
#include "vectors.h"

namespace kvshare {
namespace {

// One 32-weight group as two vectors: weights 0-15 and 16-31 of the group.
struct Group {
  vfloat lo, hi;
};

// Formats: kBlockBytes bytes hold kGroups 32-weight groups; expand(block, g) gives group g.

// Q4_0: fp16 d, 16 bytes of nibbles (low nibbles are weights 0-15); w = (q - 8) * d.
struct Q4_0 {
  static constexpr int kBlockBytes = 18, kGroups = 1;
  static Group expand(const uint8_t* block, int) {
    const vfloat d = splat(half(block));
    const vbyte q = load_bytes(block + 2);
    return {(to_float(q & 15) - 8.f) * d, (to_float(q >> 4) - 8.f) * d};
  }
};

// Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; w = q * d + m.
struct Q4_1 {
  static constexpr int kBlockBytes = 20, kGroups = 1;
  static Group expand(const uint8_t* block, int) {
    const vfloat d = splat(half(block)), m = splat(half(block + 2));
    const vbyte q = load_bytes(block + 4);
    return {to_float(q & 15) * d + m, to_float(q >> 4) * d + m};
  }
};

// Lane numbers 0..15.
inline vuint lane_numbers() {
  uint32_t numbers[kLanes];
  for (int i = 0; i < kLanes; ++i) numbers[i] = static_cast<uint32_t>(i);
  vuint v;
  std::memcpy(&v, numbers, sizeof(v));
  return v;
}

// Q5_0: fp16 d, 4 bytes of fifth bits (a little-endian uint32: bit k is weight k's), 16 bytes of
// nibbles as Q4_0's; q = nibble | fifth bit << 4, w = (q - 16) * d.
struct Q5_0 {
  static constexpr int kBlockBytes = 22, kGroups = 1;
  static Group expand(const uint8_t* block, int) {
    const vfloat d = splat(half(block));
    uint32_t bits;
    std::memcpy(&bits, block + 2, sizeof(bits));
    const vuint fifth = (vuint{} + bits) >> lane_numbers();  // lane k: bits >> k
    const vint q = widen_int(block + 6);
    const vint lo = (q & 15) | bitcast<vint>((fifth << 4) & 16u);
    const vint hi = (q >> 4) | bitcast<vint>((fifth >> 12) & 16u);
    return {(to_float(lo) - 16.f) * d, (to_float(hi) - 16.f) * d};
  }
};

// Q8_0: fp16 d, 32 int8 codes; w = q * d.
struct Q8_0 {
  static constexpr int kBlockBytes = 34, kGroups = 1;
  static Group expand(const uint8_t* block, int) {
    const vfloat d = splat(half(block));
    return {to_float_signed(block + 2) * d, to_float_signed(block + 18) * d};
  }
};

// Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs for the 8 groups, 128 bytes of
// nibbles: groups 2c and 2c+1 are the low and high nibbles of bytes 32c..32c+31.
// w = (d * scale) * q - dmin * min.
struct Q4_K {
  static constexpr int kBlockBytes = 144, kGroups = 8;
  static Group expand(const uint8_t* block, int g) {
    const uint8_t* s = block + 4;
    int scale, min;
    if (g < 4) {
      scale = s[g] & 63;
      min = s[g + 4] & 63;
    } else {
      scale = (s[g + 4] & 15) | ((s[g - 4] >> 6) << 4);
      min = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
    }
    const vfloat d = splat(half(block) * static_cast<float>(scale));
    const vfloat m = splat(half(block + 2) * static_cast<float>(min));
    const uint8_t* q = block + 16 + 32 * (g / 2);
    const int shift = (g % 2) * 4;
    const vbyte lo = (load_bytes(q) >> shift) & 15, hi = (load_bytes(q + 16) >> shift) & 15;
    return {to_float(lo) * d - m, to_float(hi) * d - m};
  }
};

// Q6_K: 128 bytes of low nibbles (ql), 64 bytes of 2-bit high parts (qh), 16 int8 scales (one
// per 16 weights), fp16 d. Group g of half n = g / 4, quarter j = g % 4: weight l (0-31) is
// ((ql[64n + 32(j % 2) + l] >> 4(j / 2)) & 15) | ((qh[32n + l] >> 2j) & 3) << 4, minus 32;
// w = (d * scales[8n + 2j + l / 16]) * q.
struct Q6_K {
  static constexpr int kBlockBytes = 210, kGroups = 8;
  static Group expand(const uint8_t* block, int g) {
    const int n = g / 4, j = g % 4;
    const uint8_t* ql = block + 64 * n + 32 * (j % 2);
    const uint8_t* qh = block + 128 + 32 * n;
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192) + 8 * n + 2 * j;
    const float d = half(block + 208);
    const int low_shift = 4 * (j / 2), high_shift = 2 * j;
    auto codes = [&](int l) {
      const vbyte low = (load_bytes(ql + l) >> low_shift) & 15;
      const vbyte high = ((load_bytes(qh + l) >> high_shift) & 3) << 4;
      return to_float(low | high) - 32.f;
    };
    return {codes(0) * splat(d * scales[0]), codes(16) * splat(d * scales[1])};
  }
};

// Output columns per tile and activation rows per pass over a tile's expanded groups: every
// accumulator and the rows' activations fit in registers with the expansion's temporaries.
// Measured on SmolLM2's tensors (1 thread, AVX-512): 2 x 4 beat 4 x 4, 4 x 2 and 4 x 1 at 1
// and 8 rows (benchmarks/README.md, "GGUF blocks as stored").
constexpr int kCols = 2;
#if defined(__AVX512F__)
constexpr int kTileRows = 4;  // activation rows per pass over a tile's expanded groups
#else
constexpr int kTileRows = 2;  // 16 half-width registers: 4 rows' accumulators would spill
#endif

// out[r, v0 + c] for r < kRows, c < kTileCols: the core of the kernel. Sizes known at compile
// time keep every accumulator in a register. `row_bytes` is one weight row's size; x rows are
// K fp32 apart, out rows V apart. Each accumulator sees the same operations in the same order
// whatever kRows and kTileCols are: the batch-invariant order the file header describes.
template <typename F, int kRows, int kTileCols>
void tile(const float* x, const uint8_t* weight, float* out, int64_t v0, int in_features,
          int64_t out_features, int64_t row_bytes) {
  vfloat acc[kTileCols][kRows] = {};
  const uint8_t* rows[kTileCols];
  for (int c = 0; c < kTileCols; ++c) rows[c] = weight + (v0 + c) * row_bytes;
  const int groups = in_features / 32;
  for (int g = 0; g < groups; ++g) {
    const int64_t offset = (g / F::kGroups) * int64_t{F::kBlockBytes};
    __builtin_prefetch(rows[kTileCols - 1] + offset + kPrefetchBytes, 0, 0);
    vfloat xlo[kRows], xhi[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      xlo[r] = load(x + r * int64_t{in_features} + 32 * g);
      xhi[r] = load(x + r * int64_t{in_features} + 32 * g + kLanes);
    }
    // Unrolled: accumulators indexed by constants stay in registers.
#pragma GCC unroll 4
    for (int c = 0; c < kTileCols; ++c) {
      const Group w = F::expand(rows[c] + offset, g % F::kGroups);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        acc[c][r] += w.lo * xlo[r];
        acc[c][r] += w.hi * xhi[r];
      }
    }
  }
  for (int c = 0; c < kTileCols; ++c)
    for (int r = 0; r < kRows; ++r) out[r * out_features + v0 + c] = sum(acc[c][r]);
}

template <typename F, int kTileCols>
void tile_rows(const float* x, const uint8_t* weight, float* out, int64_t v0, int rows,
               int in_features, int64_t out_features, int64_t row_bytes) {
  for (int r0 = 0; r0 < rows; r0 += kTileRows) {
    const float* xs = x + r0 * int64_t{in_features};
    float* ys = out + r0 * out_features;
    const int K = in_features;
    const int64_t V = out_features;
    switch (rows - r0 < kTileRows ? rows - r0 : kTileRows) {
      case 1: tile<F, 1, kTileCols>(xs, weight, ys, v0, K, V, row_bytes); break;
      case 2: tile<F, 2, kTileCols>(xs, weight, ys, v0, K, V, row_bytes); break;
      case 3: tile<F, 3, kTileCols>(xs, weight, ys, v0, K, V, row_bytes); break;
      default: tile<F, 4, kTileCols>(xs, weight, ys, v0, K, V, row_bytes);
    }
  }
}

template <typename F>
void block_linear(const float* x, const uint8_t* weight, float* out, int rows, int in_features,
                  int64_t out_features, int num_threads) {
  const int64_t row_bytes = int64_t{in_features} / (32 * F::kGroups) * F::kBlockBytes;
  const int64_t num_tiles = out_features / kCols;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < num_tiles; ++t)
      tile_rows<F, kCols>(x, weight, out, t * kCols, rows, in_features, out_features, row_bytes);
    // The last out_features % kCols columns one at a time.
#pragma omp for schedule(static)
    for (int64_t v = num_tiles * kCols; v < out_features; ++v)
      tile_rows<F, 1>(x, weight, out, v, rows, in_features, out_features, row_bytes);
  }
}

// Rows `ids` of a block-quantized table (an embedding) dequantized into out [N, K].
template <typename F>
void block_rows(const uint8_t* table, const int64_t* ids, float* out, int rows, int in_features) {
  const int64_t row_bytes = int64_t{in_features} / (32 * F::kGroups) * F::kBlockBytes;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = table + ids[r] * row_bytes;
    float* y = out + r * int64_t{in_features};
    for (int g = 0; g < in_features / 32; ++g) {
      const Group w = F::expand(row + (g / F::kGroups) * int64_t{F::kBlockBytes}, g % F::kGroups);
      std::memcpy(y + 32 * g, &w.lo, sizeof(w.lo));
      std::memcpy(y + 32 * g + kLanes, &w.hi, sizeof(w.hi));
    }
  }
}

// Calls run(F{}) for a format code (GGML's type number); 1 for a format this library has no
// kernel for.
template <typename Run>
int with_format(int format, Run&& run) {
  switch (format) {
    case kQ4_0: return run(Q4_0{});
    case kQ4_1: return run(Q4_1{});
    case kQ5_0: return run(Q5_0{});
    case kQ8_0: return run(Q8_0{});
    case kQ4_K: return run(Q4_K{});
    case kQ6_K: return run(Q6_K{});
    default: return 1;
  }
}

}  // namespace

int blocks_linear(int format, const float* x, const uint8_t* weight, float* out, int rows,
                  int in_features, int64_t out_features, int num_threads) {
  return with_format(format, [&](auto tag) {
    using F = decltype(tag);
    if (in_features % (32 * F::kGroups)) return 2;
    block_linear<F>(x, weight, out, rows, in_features, out_features, num_threads);
    return 0;
  });
}

int blocks_lookup(int format, const uint8_t* table, const int64_t* ids, float* out, int rows,
                  int in_features) {
  return with_format(format, [&](auto tag) {
    using F = decltype(tag);
    if (in_features % (32 * F::kGroups)) return 2;
    block_rows<F>(table, ids, out, rows, in_features);
    return 0;
  });
}

}  // namespace kvshare
