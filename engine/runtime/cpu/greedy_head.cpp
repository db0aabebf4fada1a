// Greedy tokens under a Q8_0 panel head, without all of its logits.
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

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_kernels.h"
#include "kvshare_native.h"
#include "vectors.h"

namespace kvshare {
namespace {

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
#if defined(KVSHARE_AMX_BUILD)
  if (amx_active())
    return amx_q8_0_panel_row(x, weight, logits, p, in_features, out_features);
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

}  // namespace
}  // namespace kvshare

// The entry points (kvshare_native.h says what each takes and returns).
using namespace kvshare;

extern "C" {

int kvshare_greedy_head(int format, const float* x, const uint8_t* weight, const float* norms,
                        int64_t* ids, int rows, int in_features, int64_t out_features,
                        int num_threads, int64_t* computed) {
  if (format != kPanelCode + kQ8_0) return 1;
  if (in_features % 32 || out_features % kPanel || rows < 1) return 2;
  return greedy_head(x, weight, norms, ids, rows, in_features, out_features, num_threads,
                     computed);
}

int kvshare_greedy_head_fast() { return greedy_fast() ? 1 : 0; }

}  // extern "C"
