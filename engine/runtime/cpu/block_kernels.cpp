// Linear layers on GGUF block-quantized weights with fp32 activations: y [N, V] = x [N, K] W^T
// where each row of W [V, K] is stored as GGUF blocks (Q4_0, Q4_1, Q8_0: 32 weights a block;
// Q4_K, Q6_K: 256 weights a super-block of eight 32-weight groups).
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
// Built into the same library as kernels.cpp (engine/runtime/cpu/native.py), with the same
// ISA levels (vectors.h). The horizontal sum (vectors.h) is the one reduction order of every
// output element.

#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#include "vectors.h"

typedef uint8_t vbyte __attribute__((vector_size(kLanes)));

inline vbyte load_bytes(const uint8_t* p) {
  vbyte v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Bytes to floats (vcvtdq2ps after the widening).
template <typename Byte>
inline vfloat widen(const Byte* bytes) {
  return to_float(widen_int(bytes));
}

inline vfloat to_float(vbyte v) {
  uint8_t bytes[kLanes];
  std::memcpy(bytes, &v, sizeof(bytes));
  return widen(bytes);
}

inline vfloat to_float_signed(const uint8_t* p) { return widen(reinterpret_cast<const int8_t*>(p)); }


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
// A thread reads its columns' blocks as one stream; the hardware prefetcher alone leaves it at
// 4-6 GB/s a core here, a software prefetch this far ahead at 7-9 (the 30 MB Q8_0 LM head and a
// 47 MB Q4_1 matrix, 1 thread, AMD EPYC Zen 4; 2048 beat 512 and 1024, noisy).
constexpr int64_t kPrefetchBytes = 2048;

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

// Panels: the same Q4_0, Q4_1 and Q8_0 blocks reordered at load so that one 32-weight group of
// kPanel consecutive output columns lies together (engine/runtime/cpu/block_linear.py, to_panels):
// the columns' fp16 scales (and Q4_1's minimums) as kPanel-wide arrays, then the code bytes
// transposed, so code byte j of all kPanel columns is one 16-byte row. The bytes are those of the
// GGUF blocks, moved: no size changes. A panel's codes expand to vectors whose lanes are output
// columns, so each activation is broadcast into one FMA per kPanel weights, with no horizontal
// sum, and the block scale and minimum leave the inner loop:
//   sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k   (per 32-weight group)
// where sum_k x_k is computed once per row and group for all columns. Per output element the
// order is fixed: two chains (the group's "lo" and "hi" codes) summed in code order, added, times
// d into the running sum, then m times the row's group sum; so the result does not depend on the
// number of rows, the tile shape or the thread count (batch invariance by construction).
constexpr int kPanel = kLanes;  // output columns per panel: one vector's lanes

struct Codes {
  vfloat lo, hi;
};

// A tile is one panel by up to kPanelTileRows rows, at every row count: its 3 x kRows chains (the
// group's two code chains and the running sum per row) and the expansion's temporaries fit the
// registers (32 with AVX-512, 16 half-width ones below it), and kRows x 2 independent FMA chains
// hide the FMA latency from 2 rows on. Two panels side by side (4 rows x 2 panels, as before)
// spilled a third of their accumulators to the stack (GCC 12); one panel at a time is 7-22%
// faster at 64-512 rows and 24-33% at 8 on an AMD EPYC Zen 4 (benchmarks/ab_block_linear.py;
// benchmarks/README.md, eleventh round). A lone row reads its panels as one stream, front to
// back: its two chains then wait on the FMA latency, but the stream matters more (the Q4_1
// layers 6.9-8.0 against 7.5-8.6 ms with 4 panels side by side on an AVX-512 Xeon, ninth round;
// the Q8_0 LM head 1.04 against 1.65 ms on the EPYC, eleventh). A row tile's pass over
// kWidePanels panels finds their blocks in cache from the pass before (each weight byte is read
// from memory once per step).
#if defined(__AVX512F__)
constexpr int kWidePanels = 4, kPanelTileRows = 4;
#else
constexpr int kWidePanels = 2, kPanelTileRows = 2;
#endif


// Other data to ask for while a linear layer computes: `count` ranges of `bytes` bytes each
// (decode_step.cpp: the next layer's K/V blocks, during this layer's MLP, whose arithmetic
// leaves the memory bus idle for much of the time). Each thread takes its share of the ranges
// and asks for a few of their lines at every weight group it computes, so the lines arrive
// spread over the layer rather than as one burst. Only a hint: nothing computed changes.
struct Companion {
  const char* const* starts;
  int64_t count, bytes;
};

class Asker {
 public:
  // Share t of n, asked over `steps` calls of ask().
  Asker(const Companion* c, int64_t t, int64_t n, int64_t steps) {
    if (c == nullptr || c->count == 0 || steps == 0) return;
    starts_ = c->starts;
    bytes_ = c->bytes;
    range_ = c->count * t / n;
    end_ = c->count * (t + 1) / n;
    const int64_t lines = (end_ - range_) * ((bytes_ + 63) / 64);
    per_step_ = (lines + steps - 1) / steps;
  }
  void ask() {
    for (int64_t i = 0; i < per_step_ && range_ < end_; ++i) {
      __builtin_prefetch(starts_[range_] + offset_, 0, 3);
      offset_ += 64;
      if (offset_ >= bytes_) offset_ = 0, ++range_;
    }
  }

 private:
  const char* const* starts_ = nullptr;
  int64_t bytes_ = 0, range_ = 0, end_ = 0, per_step_ = 0, offset_ = 0;
};

// 4-bit panels: code row j holds, per column, the low nibble (weight j of the group) and the
// high nibble (weight j + 16), as GGUF's byte j does.
struct NibblePanel {
  static constexpr int kSteps = 16;
  static int lo_k(int j) { return j; }
  static int hi_k(int j) { return j + 16; }
  static Codes codes(const uint8_t* rows, int j) {
    const vint v = widen_int(rows + kPanel * j);
#if defined(__AVX512F__)
    // A nibble's float by lane permutation of the table 0..15: vpermps reads only the low four
    // bits of each index, so the low nibble needs no mask and neither needs a conversion (the
    // floats are exactly to_float's). One uop fewer per 32 weights, and off the port that the
    // shifts and conversions share on Intel: 12-19% faster in cache, 1 and 2 threads, on an
    // AVX-512 Xeon (benchmarks/README.md, "Panel kernels on an AVX-512 Xeon").
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i lo = reinterpret_cast<__m512i>(v), hi = reinterpret_cast<__m512i>(v >> 4);
    return {reinterpret_cast<vfloat>(_mm512_permutexvar_ps(lo, table)),
            reinterpret_cast<vfloat>(_mm512_permutexvar_ps(hi, table))};
#else
    return {to_float(v & 15), to_float(v >> 4)};
#endif
  }
#if defined(__AVX512F__)
  // Code row j as AMX B pairs (lo, hi) of bf16, by table: bf16 of 0..15 in the low half of each
  // lane for the low nibble, in the high half for the high one (vpermd reads an index's low 4
  // bits, so the low nibble needs no mask).
  static __m512i pairs(const uint8_t* rows, int j) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + kPanel * j));
    const __m512i v = _mm512_cvtepu8_epi32(bytes);
    const __m512i lo = _mm512_setr_epi32(0, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0,
                                         0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150,
                                         0x4160, 0x4170);
    const __m512i hi = _mm512_slli_epi32(lo, 16);
    return _mm512_or_si512(_mm512_permutexvar_epi32(v, lo),
                           _mm512_permutexvar_epi32(_mm512_srli_epi32(v, 4), hi));
  }
#endif
};

// Q4_0 panel: d[16], codes[16][16]; w = d q - 8 d.
struct PanelQ4_0 : NibblePanel {
  static constexpr int kBytes = 18 * kPanel, kCodes = 2 * kPanel;
  static constexpr bool kHasMin = true;
  static vfloat scales(const uint8_t* b) { return halves(b); }
  static vfloat mins(const uint8_t* b) { return halves(b) * -8.f; }
};

// Q4_1 panel: d[16], m[16], codes[16][16]; w = d q + m.
struct PanelQ4_1 : NibblePanel {
  static constexpr int kBytes = 20 * kPanel, kCodes = 4 * kPanel;
  static constexpr bool kHasMin = true;
  static vfloat scales(const uint8_t* b) { return halves(b); }
  static vfloat mins(const uint8_t* b) { return halves(b + 2 * kPanel); }
};

// Q8_0 panel: d[16], codes[32][16] (row k: weight k of each column, int8); w = d q. The two
// chains are the even and odd weights.
struct PanelQ8_0 {
  static constexpr int kBytes = 34 * kPanel, kCodes = 2 * kPanel, kSteps = 16;
  static constexpr bool kHasMin = false;
  static int lo_k(int j) { return 2 * j; }
  static int hi_k(int j) { return 2 * j + 1; }
  static vfloat scales(const uint8_t* b) { return halves(b); }
  static vfloat mins(const uint8_t*) { return vfloat{}; }
  static Codes codes(const uint8_t* rows, int j) {
    const int8_t* p = reinterpret_cast<const int8_t*>(rows + 2 * kPanel * j);
    return {widen(p), widen(p + kPanel)};
  }
#if defined(__AVX512F__)
  // Code rows 2j and 2j + 1 as AMX B pairs of bf16 (an int8 is exact in bf16: its float's top
  // half).
  static __m512i pairs(const uint8_t* rows, int j) {
    const Codes w = codes(rows, j);
    return _mm512_or_si512(_mm512_srli_epi32(reinterpret_cast<__m512i>(w.lo), 16),
                           reinterpret_cast<__m512i>(w.hi));
  }
#endif
};

// Many rows: a chunk's panels are expanded to fp32 once (expand_panels) and every row tile reads
// them back from that buffer, so the FMAs no longer share their ports with the expansion. The
// floats are the same, and so are the operations on them and their order: the rows come out
// bit-identical to the expanding path (tests/engine/runtime/test_block_linear.py).
constexpr int kExpandRows = 64;

// step(i, block) for the groups of panels [p, p + num) in memory order, i counting them from 0:
// how a chunk's panels are expanded, for the FMAs (expand_panels) or the tiles.
template <typename P, typename Step>
void each_group(const uint8_t* weight, int64_t p, int num, int groups, Step&& step) {
  const uint8_t* first = weight + p * int64_t{groups} * P::kBytes;
  for (int64_t i = 0; i < int64_t{num} * groups; ++i) step(i, first + i * P::kBytes);
}

// A chunk's panels [p, p + num), expanded: per panel, group and code step, the lo and hi vectors.
template <typename P>
void expand_panels(const uint8_t* weight, int64_t p, int num, int groups, vfloat* expanded) {
  each_group<P>(weight, p, num, groups, [&](int64_t i, const uint8_t* block) {
    vfloat* codes = expanded + i * 2 * P::kSteps;
    for (int j = 0; j < P::kSteps; ++j) {
      const Codes w = P::codes(block + P::kCodes, j);
      codes[2 * j] = w.lo;
      codes[2 * j + 1] = w.hi;
    }
  });
}

// out[r, 16 p + lane] for r < kRows. sums [rows, K / 32]: each row's group sums (read only with a
// minimum). With kExpanded the codes come from `expanded` (panel p's, as expand_panels lays them
// out) instead of the code bytes.
template <typename P, int kRows, bool kExpanded = false>
void panel_tile(const float* x, const float* sums, const uint8_t* weight, float* out, int64_t p,
                int in_features, int64_t out_features, Asker& asker,
                const vfloat* expanded = nullptr) {
  const int groups = in_features / 32;
  const int64_t panel_bytes = int64_t{groups} * P::kBytes;
  vfloat acc[kRows] = {};
  for (int g = 0; g < groups; ++g) {
    const uint8_t* block = weight + p * panel_bytes + int64_t{g} * P::kBytes;
    // Into every cache level (T0): the non-temporal hint the row kernel uses cost the panels
    // 15-25% on an AVX-512 Xeon, Q4_1 layers and the Q8_0 head alike (benchmarks/README.md).
    if constexpr (!kExpanded)
      for (int line = 0; line < P::kBytes; line += 64)
        __builtin_prefetch(block + kPrefetchBytes + line, 0, 3);
    asker.ask();
    const float* xg = x + 32 * g;
    vfloat lo[kRows] = {}, hi[kRows] = {};
    for (int j = 0; j < P::kSteps; ++j) {
      Codes w;
      if constexpr (kExpanded) {
        const vfloat* codes = expanded + int64_t{g} * 2 * P::kSteps + 2 * j;
        w = {codes[0], codes[1]};
      } else {
        w = P::codes(block + P::kCodes, j);
      }
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        lo[r] += w.lo * xg[r * int64_t{in_features} + P::lo_k(j)];
        hi[r] += w.hi * xg[r * int64_t{in_features} + P::hi_k(j)];
      }
    }
    const vfloat d = P::scales(block);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) acc[r] += d * (lo[r] + hi[r]);
    if constexpr (P::kHasMin) {
      const vfloat m = P::mins(block);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) acc[r] += m * sums[r * int64_t{groups} + g];
    }
  }
  for (int r = 0; r < kRows; ++r)
    std::memcpy(out + r * out_features + p * kPanel, &acc[r], sizeof(vfloat));
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

// Each row's sum over each 32-weight group, in one fixed order (two halves added lane-wise, then
// the tree of halves): sums [rows, K / 32].
void group_sums(const float* x, float* sums, int rows, int in_features) {
  const int groups = in_features / 32;
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) {
      const float* xg = x + r * int64_t{in_features} + 32 * g;
      sums[r * int64_t{groups} + g] = sum(load(xg) + load(xg + kLanes));
    }
}

// ---- Panels on AMX tiles ----
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
#if defined(__AVX512F__) && defined(__x86_64__)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVSHARE_AMX_TARGET
#else
#define KVSHARE_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#endif

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

std::atomic<bool> amx_enabled{false};  // the default path: FMAs unless asked (kvshare_panel_amx)

inline bool amx_active() { return amx_enabled.load(std::memory_order_relaxed) && amx_supported(); }

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
      _mm512_store_si512(tiles + i * 512 + 32 * j, P::pairs(block + P::kCodes, j));
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
#else
inline bool amx_active() { return false; }
inline bool amx_supported() { return false; }
#endif

// tiles: on AMX tiles where this process has them (amx_supported), else on the FMAs.
template <typename P>
void panel_linear(const float* x, const uint8_t* weight, float* out, int rows, int in_features,
                  int64_t out_features, int num_threads, const Companion* companion, bool tiles) {
#if defined(__AVX512F__) && defined(__x86_64__)
  if (tiles && amx_supported())
    return amx_linear<P>(x, weight, out, rows, in_features, out_features, num_threads, companion);
#else
  (void)tiles;
#endif
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
// exact in fp32 (a 4- or 8-bit code times an fp16 scale needs at most 19 bits).
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
      for (int j = 0; j < P::kSteps; ++j) {
        const Codes w = P::codes(block + P::kCodes, j);
        y[32 * g + P::lo_k(j)] = w.lo[lane] * d + m;
        y[32 * g + P::hi_k(j)] = w.hi[lane] * d + m;
      }
    }
  }
}

// ---- Greedy tokens under a Q8_0 panel head, without all of its logits ----
//
// A greedy row needs only the index of its largest logit. Each row's activations are quantized
// per 32-weight group to int8 codes (scale max|x| / 127) and every logit is first estimated in
// integers: the int8 codes of the head times the row's codes, with AVX-512 VNNI 4 products per
// lane and instruction against the exact kernel's one fp32 FMA. The estimate cannot be off by
// more than |w_v| * reach, where |w_v| is the head row's norm (given, rounded up) and
// reach = 1.001 |x - s x~| + 1e-3 |x|: by Cauchy-Schwarz the quantization moves a logit by at
// most |w_v| |x - s x~|, and the fp32 rounding stays far inside the 1e-3 |x| |w_v| added: the
// exact kernel's sums are at most G + 18 roundings deep for G = K / 32 groups (16 FMAs a chain,
// the chains added, times d, then one add a group), the estimate's G + 3, each costing at most
// u = 2^-24 of |w_v||x|, and the bound's own arithmetic a few u more (K = 576: 36 u). So a
// logit can only be the largest if its upper bound reaches every row's largest lower bound; the
// panels holding such logits (6 logits at the median, 18 on average, on SmolLM2's final hidden
// states) are computed exactly with the head's own tile, panel_tile<PanelQ8_0, 1> (the bits the
// full head gives a row at any row count), and scanned in index order, so a tie goes to the
// first index as torch.argmax's does. Exact wherever every logit is finite; a row whose
// activations or exact logits are not is left to the caller (status 3).

constexpr int kGreedyRows = 8;  // rows per pass over a panel's codes (their accumulators)

#if defined(__AVX512F__)
// The VNNI estimate. A -march=native build on a CPU with VNNI and VBMI has them throughout; the
// portable AVX-512 build (x86-64-v4, what the runtime image ships) compiles this function alone
// for them and runs it where the CPU says it has them (greedy_fast). Builds below AVX-512 never
// do: a forced lower level stays the lower path.
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define KVSHARE_VNNI_TARGET
inline bool greedy_fast() { return true; }
#else
#define KVSHARE_VNNI_TARGET __attribute__((target("avx512vnni,avx512vbmi")))
inline bool greedy_fast() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
}
#endif

// The estimated logits of panel p for rows [r0, r0 + kRows): codes [rows, K] are the rows'
// int8 codes plus 128 (vpdpbusd multiplies unsigned by signed bytes; 128 times the column's
// code sum is taken back), scales [rows, K / 32].
template <int kRows>
KVSHARE_VNNI_TARGET void estimate_panel_vnni(const uint8_t* weight, int64_t p, int in_features,
                                             const uint8_t* codes, const float* scales, int r0,
                                             vfloat* est) {
  const int groups = in_features / 32;
  // A panel's 64-byte run holds 4 code rows (weights k..k+3) of 16 columns; vpdpbusd wants each
  // column's 4 codes in one 32-bit lane: byte 4c + i takes byte 16i + c.
  alignas(64) static constexpr uint8_t kTranspose[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51,
      4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54, 7, 23, 39, 55,
      8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
      12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i transpose = _mm512_load_si512(kTranspose);
  const __m512i ones = _mm512_set1_epi8(1);
  const uint8_t* panel = weight + p * int64_t{groups} * PanelQ8_0::kBytes;
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    const uint8_t* block = panel + int64_t{g} * PanelQ8_0::kBytes;
    __builtin_prefetch(block + kPrefetchBytes, 0, 3);
    __m512i w[8];
    __m512i code_sums = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i run = _mm512_loadu_si512(block + PanelQ8_0::kCodes + 64 * j);
      w[j] = _mm512_permutexvar_epi8(transpose, run);
      code_sums = _mm512_dpbusd_epi32(code_sums, ones, w[j]);
    }
    const __m512i offset = _mm512_slli_epi32(code_sums, 7);
    const __m512 d = reinterpret_cast<__m512>(halves(block));
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* xr = codes + (r0 + r) * int64_t{in_features} + 32 * g;
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        int32_t four;
        std::memcpy(&four, xr + 4 * j, sizeof(four));
        dot = _mm512_dpbusd_epi32(dot, _mm512_set1_epi32(four), w[j]);
      }
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(scales[(r0 + r) * int64_t{groups} + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot, offset)), scale, acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) est[r] = reinterpret_cast<vfloat>(acc[r]);
}
#else
inline bool greedy_fast() { return false; }
#endif

// The same estimate in plain integer loops: where the CPU or the build lacks VNNI and VBMI the
// product keeps the full head, and this path is for the tests.
template <int kRows>
void estimate_panel_loops(const uint8_t* weight, int64_t p, int in_features, const uint8_t* codes,
                          const float* scales, int r0, vfloat* est) {
  const int groups = in_features / 32;
  const uint8_t* panel = weight + p * int64_t{groups} * PanelQ8_0::kBytes;
  float acc[kRows][kPanel] = {};
  for (int g = 0; g < groups; ++g) {
    const uint8_t* block = panel + int64_t{g} * PanelQ8_0::kBytes;
    const int8_t* q = reinterpret_cast<const int8_t*>(block + PanelQ8_0::kCodes);
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* xr = codes + (r0 + r) * int64_t{in_features} + 32 * g;
      const float s = scales[(r0 + r) * int64_t{groups} + g];
      for (int c = 0; c < kPanel; ++c) {
        int32_t dot = 0;
        for (int k = 0; k < 32; ++k) dot += (int32_t{xr[k]} - 128) * q[kPanel * k + c];
        acc[r][c] += static_cast<float>(dot) * (half(block + 2 * c) * s);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) est[r] = load(acc[r]);
}

template <int kRows>
void estimate_panel(bool fast, const uint8_t* weight, int64_t p, int in_features,
                    const uint8_t* codes, const float* scales, int r0, vfloat* est) {
#if defined(__AVX512F__)
  if (fast) return estimate_panel_vnni<kRows>(weight, p, in_features, codes, scales, r0, est);
#endif
  estimate_panel_loops<kRows>(weight, p, in_features, codes, scales, r0, est);
}

inline float max_lane(vfloat v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

inline vfloat max_lanes(vfloat a, vfloat b) { return select(a > b, a, b); }

// Row r's codes (plus 128), group scales and reach (see above); false if x is not finite.
bool quantize_row(const float* x, int in_features, uint8_t* codes, float* scales, float* reach) {
  double error2 = 0, norm2 = 0;
  for (int g = 0; g < in_features / 32; ++g) {
    const float* xg = x + 32 * g;
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::fabs(xg[i]) > amax ? std::fabs(xg[i]) : amax;
    const float s = amax / 127.f;
    scales[g] = s;
    for (int i = 0; i < 32; ++i) {
      long q = s > 0 ? std::lrint(xg[i] / s) : 0;
      q = q > 127 ? 127 : (q < -127 ? -127 : q);
      codes[32 * g + i] = static_cast<uint8_t>(q + 128);
      const double e = double{xg[i]} - double{s} * static_cast<double>(q);
      error2 += e * e;
      norm2 += double{xg[i]} * xg[i];
    }
  }
  const double r = 1.001 * std::sqrt(error2) + 1e-3 * std::sqrt(norm2);
  *reach = static_cast<float>(r * (1 + 1e-6));
  return std::isfinite(norm2) && std::isfinite(*reach);
}

// Panel p of a Q8_0 head for one row, the bits the full head gives that row.
void exact_panel_row(const float* x, const uint8_t* weight, float* logits, int64_t p,
                     int in_features, int64_t out_features, Asker& none) {
#if defined(__AVX512F__) && defined(__x86_64__)
  if (amx_active())
    return amx_panel_row<PanelQ8_0>(x, weight, logits, p, in_features, out_features);
#endif
  panel_tile<PanelQ8_0, 1>(x, nullptr, weight, logits, p, in_features, out_features, none);
}

// ids[r] = argmax over v of (x W^T)[r, v] for a Q8_0 panel head W [V, K] with row norms
// `norms` [V] (each at least the row's true norm); *computed = the (row, panel) pairs computed
// exactly. 0 on success; 3 when a row or a logit is not finite (the caller then computes the
// logits).
int greedy_head(const float* x, const uint8_t* weight, const float* norms, int64_t* ids, int rows,
                int in_features, int64_t out_features, int num_threads, int64_t* computed_out) {
  const int groups = in_features / 32;
  const int64_t num_panels = out_features / kPanel;
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<float> scales, reach, upper, lows;
  codes.resize(static_cast<size_t>(rows) * in_features);
  scales.resize(static_cast<size_t>(rows) * groups);
  reach.resize(rows);
  upper.resize(static_cast<size_t>(rows) * num_panels);
  lows.resize(static_cast<size_t>(rows) * num_threads);
  for (int r = 0; r < rows; ++r)
    if (!quantize_row(x + r * int64_t{in_features}, in_features,
                      codes.data() + r * int64_t{in_features}, scales.data() + r * int64_t{groups},
                      &reach[r]))
      return 3;
  const bool fast = greedy_fast();
  // Raw pointers: inside the parallel region a thread_local name is each thread's own.
  const uint8_t* c = codes.data();
  const float* s = scales.data();
  const float* reaches = reach.data();
  float* uppers = upper.data();
  float* row_lows = lows.data();
  int failed = 0;
  int64_t computed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed) reduction(+ : computed)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = num_panels * t / n, last = num_panels * (t + 1) / n;
    // Pass 1: each panel's largest upper bound per row, and each row's largest lower bound.
    for (int r0 = 0; r0 < rows; r0 += kGreedyRows) {
      const int tile = rows - r0 < kGreedyRows ? rows - r0 : kGreedyRows;
      vfloat low[kGreedyRows];
      for (int r = 0; r < tile; ++r) low[r] = splat(-INFINITY);
      for (int64_t p = first; p < last; ++p) {
        vfloat est[kGreedyRows];
        switch (tile) {
          case 1: estimate_panel<1>(fast, weight, p, in_features, c, s, r0, est); break;
          case 2: estimate_panel<2>(fast, weight, p, in_features, c, s, r0, est); break;
          case 3: estimate_panel<3>(fast, weight, p, in_features, c, s, r0, est); break;
          case 4: estimate_panel<4>(fast, weight, p, in_features, c, s, r0, est); break;
          case 5: estimate_panel<5>(fast, weight, p, in_features, c, s, r0, est); break;
          case 6: estimate_panel<6>(fast, weight, p, in_features, c, s, r0, est); break;
          case 7: estimate_panel<7>(fast, weight, p, in_features, c, s, r0, est); break;
          default: estimate_panel<8>(fast, weight, p, in_features, c, s, r0, est);
        }
        const vfloat norm = load(norms + p * kPanel);
        for (int r = 0; r < tile; ++r) {
          const vfloat spread = norm * reaches[r0 + r];
          uppers[(r0 + r) * num_panels + p] = max_lane(est[r] + spread);
          low[r] = max_lanes(low[r], est[r] - spread);
        }
      }
      for (int r = 0; r < tile; ++r) row_lows[(r0 + r) * n + t] = max_lane(low[r]);
    }
#pragma omp barrier
    // Pass 2, a row per thread in turn: the panels that can hold the argmax, exactly.
    thread_local std::vector<float> logits;
    logits.resize(out_features);
    Asker none(nullptr, 0, 1, 0);
#pragma omp for schedule(static, 1)
    for (int r = 0; r < rows; ++r) {
      float floor = -INFINITY;
      for (int64_t u = 0; u < n; ++u) floor = row_lows[r * n + u] > floor ? row_lows[r * n + u] : floor;
      float best = -INFINITY;
      int64_t best_id = -1;
      for (int64_t p = 0; p < num_panels && std::isfinite(floor); ++p) {
        if (uppers[r * num_panels + p] < floor) continue;  // a NaN bound is computed
        ++computed;
        exact_panel_row(x + r * int64_t{in_features}, weight, logits.data(), p, in_features,
                        out_features, none);
        for (int lane = 0; lane < kPanel; ++lane) {
          const float v = logits[p * kPanel + lane];
          if (!std::isfinite(v)) failed = 1;
          if (best_id < 0 || v > best) best = v, best_id = p * kPanel + lane;
        }
      }
      ids[r] = best_id;
      if (best_id < 0 || !std::isfinite(best)) failed = 1;
    }
  }
  *computed_out = computed;
  return failed ? 3 : 0;
}

// Calls run(P{}) for a panel format code: kPanelCode plus GGML's type number.
constexpr int kPanelCode = 100;

template <typename Run>
int with_panel_format(int format, Run&& run) {
  switch (format) {
    case kPanelCode + 2: return run(PanelQ4_0{});
    case kPanelCode + 3: return run(PanelQ4_1{});
    case kPanelCode + 8: return run(PanelQ8_0{});
    default: return 1;
  }
}

// Calls run(F{}) for a format code (GGML's type numbers: 2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K,
// 14 Q6_K); 1 for a format this library has no kernel for.
template <typename Run>
int with_format(int format, Run&& run) {
  switch (format) {
    case 2: return run(Q4_0{});
    case 3: return run(Q4_1{});
    case 8: return run(Q8_0{});
    case 12: return run(Q4_K{});
    case 14: return run(Q6_K{});
    default: return 1;
  }
}

// One call's rows on one path (see kvshare_block_linear_rows).
int linear_on(int format, const float* x, const uint8_t* weight, float* out, int rows,
              int in_features, int64_t out_features, int num_threads,
              const Companion* companion, bool tiles) {
  if (format > kPanelCode) {
    if (in_features % 32 || out_features % kPanel) return 2;
    return with_panel_format(format, [&](auto tag) {
      panel_linear<decltype(tag)>(x, weight, out, rows, in_features, out_features, num_threads,
                                  companion, tiles);
      return 0;
    });
  }
  return with_format(format, [&](auto tag) {
    using F = decltype(tag);
    if (in_features % (32 * F::kGroups)) return 2;
    block_linear<F>(x, weight, out, rows, in_features, out_features, num_threads);
    return 0;
  });
}

// The rows in runs of one path each: tile_rows[r] 1 puts row r's panels on AMX tiles (where this
// process has them), 0 on the FMAs; nullptr: every row on the process's default path
// (kvshare_panel_amx). A row's output depends only on the row and its path, so a run computes
// its rows as the whole call would. The last run asks for the companion's ranges (in a step,
// the prompt rows after the decode rows: the long run). One call where the rows cannot differ:
// a format without tiles (K-quants), or no tiles in this build, CPU or process (the FMAs then).
int linear_by_rows(int format, const float* x, const uint8_t* weight, float* out, int rows,
                   int in_features, int64_t out_features, int num_threads,
                   const Companion* companion, const int32_t* tile_rows) {
  if (tile_rows == nullptr || format <= kPanelCode || !amx_supported())
    return linear_on(format, x, weight, out, rows, in_features, out_features, num_threads,
                     companion, tile_rows == nullptr && amx_active());
  for (int r0 = 0; r0 < rows;) {
    int r1 = r0 + 1;
    while (r1 < rows && (tile_rows[r1] != 0) == (tile_rows[r0] != 0)) ++r1;
    const int status =
        linear_on(format, x + int64_t{r0} * in_features, weight, out + int64_t{r0} * out_features,
                  r1 - r0, in_features, out_features, num_threads,
                  r1 == rows ? companion : nullptr, tile_rows[r0] != 0);
    if (status) return status;
    r0 = r1;
  }
  return 0;
}

}  // namespace

extern "C" {

// 0 on success; 1 for an unknown format; 2 when in_features is not a whole number of blocks.
// Every row on the process's default path (kvshare_panel_amx).
int kvshare_block_linear(int format, const float* x, const uint8_t* weight, float* out, int rows,
                         int in_features, int64_t out_features, int num_threads) {
  return linear_by_rows(format, x, weight, out, rows, in_features, out_features, num_threads,
                        nullptr, nullptr);
}

// kvshare_block_linear with each row's path given: tile_rows [rows], 1 for AMX tiles (where
// this process has them; the panel formats), 0 for the FMAs; nullptr for the default path.
int kvshare_block_linear_rows(int format, const float* x, const uint8_t* weight, float* out,
                              int rows, int in_features, int64_t out_features, int num_threads,
                              const int32_t* tile_rows) {
  return linear_by_rows(format, x, weight, out, rows, in_features, out_features, num_threads,
                        nullptr, tile_rows);
}

// kvshare_block_linear_rows, asking for `count` ranges of `bytes` bytes at `starts` while it
// computes (panel formats; see Companion).
int kvshare_block_linear_asking(int format, const float* x, const uint8_t* weight, float* out,
                                int rows, int in_features, int64_t out_features, int num_threads,
                                const int32_t* tile_rows, const char* const* starts,
                                int64_t count, int64_t bytes) {
  const Companion companion{starts, count, bytes};
  return linear_by_rows(format, x, weight, out, rows, in_features, out_features, num_threads,
                        &companion, tile_rows);
}

// ids [rows] = each row's greedy token under a Q8_0 panel head (see greedy_head), *computed the
// panels it computed exactly: 0 on success, 1 for another format, 2 for shapes the panels do
// not cover, 3 when a row or a logit is not finite.
int kvshare_greedy_head(int format, const float* x, const uint8_t* weight, const float* norms,
                        int64_t* ids, int rows, int in_features, int64_t out_features,
                        int num_threads, int64_t* computed) {
  if (format != kPanelCode + 8) return 1;
  if (in_features % 32 || out_features % kPanel || rows < 1) return 2;
  return greedy_head(x, weight, norms, ids, rows, in_features, out_features, num_threads,
                     computed);
}

// 1 where the estimate runs on AVX-512 VNNI (and VBMI's byte permutation), which is where it
// beats the full head; 0 where it runs the plain loops.
int kvshare_greedy_head_fast() { return greedy_fast() ? 1 : 0; }

// The default path of calls that do not give each row's (kvshare_block_linear, the greedy
// head): `enable` 1 puts the panel formats on AMX tiles where the CPU and the OS allow, 0 on the
// FMAs, -1 leaves it; returns 1 when the tiles are the default. The FMAs unless asked (tests and
// benchmarks ask; the engine gives each row's path instead). The two paths give different bits:
// switch only between calls, never while a model serves.
int kvshare_panel_amx(int enable) {
#if defined(__AVX512F__) && defined(__x86_64__)
  if (enable >= 0) amx_enabled.store(enable != 0);
#endif
  return amx_active() ? 1 : 0;
}

int kvshare_block_rows(int format, const uint8_t* table, const int64_t* ids, float* out, int rows,
                       int in_features) {
  if (format > kPanelCode) {
    if (in_features % 32) return 2;
    return with_panel_format(format, [&](auto tag) {
      panel_rows<decltype(tag)>(table, ids, out, rows, in_features);
      return 0;
    });
  }
  return with_format(format, [&](auto tag) {
    using F = decltype(tag);
    if (in_features % (32 * F::kGroups)) return 2;
    block_rows<F>(table, ids, out, rows, in_features);
    return 0;
  });
}

}  // extern "C"
