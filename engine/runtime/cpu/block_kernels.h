// What the block kernels' files share (block_linear.cpp, block_tiles.cpp, fma_panels.cpp,
// amx_panels.cpp, prefill_gemm.cpp, greedy_head.cpp): the panel formats, the tile of one panel
// (the FMA path's, and the greedy head's exact panels), the prefetch distance, and the functions
// each file offers the others. Internal to the library; its C interface is kvshare_native.h.

#pragma once

#include <cstdint>
#include <cstring>

#include "kvshare_native.h"
#include "vectors.h"

// This build has the AMX path (amx_panels.cpp); whether the CPU and the OS allow it is asked at
// run time (amx_supported).
#if defined(__AVX512F__) && defined(__x86_64__)
#define KVSHARE_AMX_BUILD
#endif

namespace kvshare {

// A thread reads its columns' blocks as one stream; the hardware prefetcher alone leaves it at
// 4-6 GB/s a core here, a software prefetch this far ahead at 7-9 (the 30 MB Q8_0 LM head and a
// 47 MB Q4_1 matrix, 1 thread, AMD EPYC Zen 4; 2048 beat 512 and 1024, noisy).
constexpr int64_t kPrefetchBytes = 2048;

// Panels: the same Q4_0, Q4_1, Q5_0 and Q8_0 blocks reordered at load so that one 32-weight
// group of kPanel consecutive output columns lies together (engine/runtime/cpu/block_linear.py,
// to_panels): the columns' fp16 scales (and Q4_1's minimums, Q5_0's fifth bits) as kPanel-wide
// arrays, then the code bytes transposed, so code byte j of all kPanel columns is one 16-byte
// row. The bytes are those of the GGUF blocks, moved: no size changes (the K-quants' panels,
// PanelQ4_K and PanelQ6_K below, are laid out per group instead). A panel's codes expand to
// vectors whose lanes are output columns, so each activation is broadcast into one FMA per
// kPanel weights, with no horizontal sum, and the block scale and minimum leave the inner loop:
//   sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k   (per 32-weight group)
// where sum_k x_k is computed once per row and group for all columns. Per output element the
// order is fixed: two chains (the group's "lo" and "hi" codes) summed in code order, added, times
// d into the running sum (Q6_K: each chain times its own scale, scaled()), then m times the
// row's group sum; so the result does not depend on the
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

// A panel format P: P::codes(block, j) is code step j of the group at `block` (kSteps of them),
// as vectors of the columns' codes for weights lo_k(j) and hi_k(j); scales and mins the
// columns' d and m. With AVX-512, P::pairs(block, j) is the same step as AMX B pairs of bf16.

#if defined(__AVX512F__)
// Two code vectors as AMX B pairs (lo, hi) of bf16: codes of at most 8 bits are exact in bf16,
// their float's top half.
inline __m512i bf16_pairs(Codes w) {
  return _mm512_or_si512(_mm512_srli_epi32(reinterpret_cast<__m512i>(w.lo), 16),
                         reinterpret_cast<__m512i>(w.hi));
}
#endif

// Panels of nibbles (Q4_0, Q4_1; Q5_0's low four bits): kHead bytes per column (the fp16 fields,
// Q5_0's fifth bits) before the codes; code row j holds, per column, the low nibble (weight j of
// the group) and the high nibble (weight j + 16), as GGUF's byte j does.
template <int kHead>
struct NibblePanel {
  static constexpr int kBytes = (kHead + 16) * kPanel, kCodes = kHead * kPanel, kSteps = 16;
  static constexpr bool kSplitScales = false;  // one scale a group (PanelQ6_K has two)
  static constexpr bool kUnrolledSteps = false;  // see each_step
  static constexpr bool kOnTiles = true;  // AMX tiles compute it (amx_format)
  static int lo_k(int j) { return j; }
  static int hi_k(int j) { return j + 16; }
  static vint nibbles(const uint8_t* block, int j) {
    return widen_int(block + kCodes + kPanel * j);
  }
  static Codes codes(const uint8_t* block, int j) {
    const vint v = nibbles(block, j);
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
  static __m512i pairs(const uint8_t* block, int j) {
    const __m128i bytes =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kCodes + kPanel * j));
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
struct PanelQ4_0 : NibblePanel<2> {
  static constexpr bool kHasMin = true;
  static vfloat scales(const uint8_t* b) { return halves(b); }
  static vfloat mins(const uint8_t* b) { return halves(b) * -8.f; }
};

// Q4_1 panel: d[16], m[16], codes[16][16]; w = d q + m.
struct PanelQ4_1 : NibblePanel<4> {
  static constexpr bool kHasMin = true;
  static vfloat scales(const uint8_t* b) { return halves(b); }
  static vfloat mins(const uint8_t* b) { return halves(b + 2 * kPanel); }
};

// Q5_0 panel: d[16], fifth[16] (a column's 32 fifth bits, uint32: bit k is weight k's),
// codes[16][16] as Q4_0's; q = nibble | fifth bit << 4, w = d q - 16 d.
struct PanelQ5_0 : NibblePanel<6> {
  static constexpr bool kHasMin = true, kUnrolledSteps = true;
  static vfloat scales(const uint8_t* b) { return halves(b); }
  static vfloat mins(const uint8_t* b) { return halves(b) * -16.f; }
  static Codes codes(const uint8_t* block, int j) {
    const vint v = nibbles(block, j);
    vuint fifth;
    std::memcpy(&fifth, block + 2 * kPanel, sizeof(fifth));
    // Bit j (the low nibble's weight) and bit j + 16 (the high nibble's) moved to bit 4.
    const vint lo = bitcast<vint>(((fifth << 4) >> j) & 16u);
    const vint hi = bitcast<vint>((fifth >> (j + 12)) & 16u);
    return {to_float((v & 15) | lo), to_float((v >> 4) | hi)};
  }
#if defined(__AVX512F__)
  static __m512i pairs(const uint8_t* block, int j) { return bf16_pairs(codes(block, j)); }
#endif
};

// Q8_0 panel: d[16], codes[32][16] (row k: weight k of each column, int8); w = d q. The two
// chains are the even and odd weights.
struct PanelQ8_0 {
  static constexpr int kBytes = 34 * kPanel, kCodes = 2 * kPanel, kSteps = 16;
  static constexpr bool kHasMin = false, kSplitScales = false, kUnrolledSteps = false;
  static constexpr bool kOnTiles = true;
  static int lo_k(int j) { return 2 * j; }
  static int hi_k(int j) { return 2 * j + 1; }
  static vfloat scales(const uint8_t* b) { return halves(b); }
  static vfloat mins(const uint8_t*) { return vfloat{}; }
  static Codes codes(const uint8_t* block, int j) {
    const int8_t* p = reinterpret_cast<const int8_t*>(block + kCodes + 2 * kPanel * j);
    return {widen(p), widen(p + kPanel)};
  }
#if defined(__AVX512F__)
  // Code rows 2j and 2j + 1 (an int8 is exact in bf16).
  static __m512i pairs(const uint8_t* block, int j) { return bf16_pairs(codes(block, j)); }
#endif
};

// The K-quants as panels. Unlike the formats above these are not GGUF's bytes moved: a Q4_K or
// Q6_K super-block packs eight 32-weight groups under one fp16 scale with 6- or 8-bit group
// scales, which no vector lane layout of its bytes lets the FMAs use. So each group is stored on
// its own (engine/runtime/cpu/block_linear.py, to_panels) with its scale already applied to the
// super-block's: D = d * scale and M = -(dmin * min) as fp32, each exactly the float GGUF's
// dequantization computes (an fp16 times a 6- or 8-bit integer needs at most 19 bits), so every
// weight D q + M is still GGUF's value. 24 bytes a column and group for Q4_K (18 in GGUF), 40
// for Q6_K (26.25), for kernels 2.3-3.5x faster than the row-order ones at 8 rows and 2.9-5.1x
// at 1 row (benchmarks/block_kernels.py --model gemma-3-270m, AMD EPYC Zen 4).

// Q4_K panel: D[16] fp32, M[16] fp32, codes[16][16] as Q4_0's (the group's weight j in code
// row j's low nibble, weight j + 16 in its high one); w = D q + M.
struct PanelQ4_K : NibblePanel<8> {
  static constexpr bool kHasMin = true, kOnTiles = false;
  static vfloat scales(const uint8_t* b) { return load(reinterpret_cast<const float*>(b)); }
  static vfloat mins(const uint8_t* b) {
    return load(reinterpret_cast<const float*>(b + 4 * kPanel));
  }
};

// Q6_K panel: Da[16], Db[16] fp32 (the scales of the group's two 16-weight halves), codes[32][16]
// (row k: weight k of each column, q - 32 as int8); w = Da (q - 32) for weights 0-15, Db (q - 32)
// for 16-31. The lo chain is the first half, the hi chain the second: each half's sum is scaled
// by its own D (kSplitScales).
struct PanelQ6_K {
  static constexpr int kBytes = 40 * kPanel, kCodes = 8 * kPanel, kSteps = 16;
  static constexpr bool kHasMin = false, kSplitScales = true, kUnrolledSteps = false;
  static constexpr bool kOnTiles = false;
  static int lo_k(int j) { return j; }
  static int hi_k(int j) { return j + 16; }
  static vfloat scales(const uint8_t* b) { return load(reinterpret_cast<const float*>(b)); }
  static vfloat scales_hi(const uint8_t* b) {
    return load(reinterpret_cast<const float*>(b + 4 * kPanel));
  }
  static vfloat mins(const uint8_t*) { return vfloat{}; }
  static Codes codes(const uint8_t* block, int j) {
    const int8_t* p = reinterpret_cast<const int8_t*>(block + kCodes);
    return {widen(p + kPanel * j), widen(p + kPanel * (j + 16))};
  }
};

// A group's two chains into its part of the output, per format: d (lo + hi), or with split
// scales d lo + d' hi.
template <typename P>
inline vfloat scaled(const uint8_t* block, vfloat lo, vfloat hi) {
  if constexpr (P::kSplitScales) return P::scales(block) * lo + P::scales_hi(block) * hi;
  return P::scales(block) * (lo + hi);
}

// Calls run(P{}) for a panel format code (kPanelCode plus GGML's type number); 1 for another.
template <typename Run>
int with_panel_format(int format, Run&& run) {
  switch (format) {
    case kPanelCode + kQ4_0: return run(PanelQ4_0{});
    case kPanelCode + kQ4_1: return run(PanelQ4_1{});
    case kPanelCode + kQ5_0: return run(PanelQ5_0{});
    case kPanelCode + kQ8_0: return run(PanelQ8_0{});
    case kPanelCode + kQ4_K: return run(PanelQ4_K{});
    case kPanelCode + kQ6_K: return run(PanelQ6_K{});
    default: return 1;
  }
}

// The panel formats AMX tiles compute (amx_panels.cpp; P::kOnTiles): GGUF's bytes moved. The
// K-quants' panels stay on the FMAs: Q6_K's two scales a group do not fit a tile's one sum, and
// Q4_K's would but has never run on an AMX machine.
inline bool amx_format(int format) {
  return format == kPanelCode + kQ4_0 || format == kPanelCode + kQ4_1 ||
         format == kPanelCode + kQ5_0 || format == kPanelCode + kQ8_0;
}

// step(i, block) for the groups of panels [p, p + num) in memory order, i counting them from 0:
// how a chunk's panels are expanded, for the FMAs (expand_panels) or the tiles.
template <typename P, typename Step>
void each_group(const uint8_t* weight, int64_t p, int num, int groups, Step&& step) {
  const uint8_t* first = weight + p * int64_t{groups} * P::kBytes;
  for (int64_t i = 0; i < int64_t{num} * groups; ++i) step(i, first + i * P::kBytes);
}

// step(j) for each code step of a group, in order: unrolled for formats whose codes shift by j
// (Q5_0's fifth bits: constant shifts then, 3.3-3.9x faster at 1 and 8 rows in the AVX2 build
// and 4% off Gemma 3's layer stack with AVX-512), a loop for the others (unrolled, SmolLM2's Q4_1
// layers ran 3-10% slower).
template <typename P, typename Step>
inline void each_step(Step&& step) {
  if constexpr (P::kUnrolledSteps) {
#pragma GCC unroll 16
    for (int j = 0; j < P::kSteps; ++j) step(j);
  } else {
    for (int j = 0; j < P::kSteps; ++j) step(j);
  }
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
    each_step<P>([&](int j) {
      Codes w;
      if constexpr (kExpanded) {
        const vfloat* codes = expanded + int64_t{g} * 2 * P::kSteps + 2 * j;
        w = {codes[0], codes[1]};
      } else {
        w = P::codes(block, j);
      }
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        lo[r] += w.lo * xg[r * int64_t{in_features} + P::lo_k(j)];
        hi[r] += w.hi * xg[r * int64_t{in_features} + P::hi_k(j)];
      }
    });
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) acc[r] += scaled<P>(block, lo[r], hi[r]);
    if constexpr (P::kHasMin) {
      const vfloat m = P::mins(block);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) acc[r] += m * sums[r * int64_t{groups} + g];
    }
  }
  for (int r = 0; r < kRows; ++r)
    std::memcpy(out + r * out_features + p * kPanel, &acc[r], sizeof(vfloat));
}

// ---- Each file's part (the formats and shapes checked by the caller, block_linear.cpp) ----

// block_tiles.cpp: blocks in GGUF's row order. 1 for an unknown format, 2 when in_features is
// not a whole number of blocks.
int blocks_linear(int format, const float* x, const uint8_t* weight, float* out, int rows,
                  int in_features, int64_t out_features, int num_threads);
int blocks_lookup(int format, const uint8_t* table, const int64_t* ids, float* out, int rows,
                  int in_features);

// fma_panels.cpp: panels on the FMAs. 1 for a format without panels.
int panels_linear(int format, const float* x, const uint8_t* weight, float* out, int rows,
                  int in_features, int64_t out_features, int num_threads,
                  const Companion* companion);
int panels_lookup(int format, const uint8_t* table, const int64_t* ids, float* out, int rows,
                  int in_features);

// prefill_gemm.cpp: a prompt chunk's rows, each weight expanded to fp32 once per call, then
// register-blocked FMAs (every format; 1 and 2 as the linears).
int prefill_gemm(int format, const float* x, const uint8_t* weight, float* out, int rows,
                 int in_features, int64_t out_features, int num_threads,
                 const Companion* companion);

// Each row's sum over each 32-weight group, in one fixed order (two halves added lane-wise, then
// the tree of halves): sums [rows, K / 32].
void group_sums(const float* x, float* sums, int rows, int in_features);

// amx_panels.cpp: panels on AMX tiles, where the CPU and the OS allow (amx_supported). amx_active:
// the tiles are also the default path (kvshare_panel_amx).
#if defined(KVSHARE_AMX_BUILD)
bool amx_supported();
bool amx_active();
int amx_panels_linear(int format, const float* x, const uint8_t* weight, float* out, int rows,
                      int in_features, int64_t out_features, int num_threads,
                      const Companion* companion);
// Panel p of a Q8_0 panel head for one row x [K] into out[16 p, 16 p + 16): what
// amx_panels_linear gives that row at any row count.
void amx_q8_0_panel_row(const float* x, const uint8_t* weight, float* out, int64_t p,
                        int in_features, int64_t out_features);
#else
inline bool amx_supported() { return false; }
inline bool amx_active() { return false; }
#endif

}  // namespace kvshare
