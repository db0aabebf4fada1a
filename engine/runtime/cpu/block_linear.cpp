// The block linears' entry points: a format code picks the kernel (block_tiles.cpp for blocks
// in GGUF's row order, fma_panels.cpp or amx_panels.cpp for panels), and each row's path (a
// prompt row's: kvshare_prompt_path; a generated row's: the FMAs) splits a call into
// runs of rows.

#include <cstdint>

#include "block_kernels.h"
#include "kvshare_native.h"

namespace kvshare {
namespace {

// One call's rows on one path (see kvshare_block_linear_rows).
int linear_on(int format, const float* x, const uint8_t* weight, float* out, int rows,
              int in_features, int64_t out_features, int num_threads,
              const Companion* companion, bool tiles) {
  if (format > kPanelCode) {
    if (in_features % 32 || out_features % kPanel) return 2;
#if defined(KVSHARE_AMX_BUILD)
    if (tiles && amx_supported() && amx_format(format))
      return amx_panels_linear(format, x, weight, out, rows, in_features, out_features,
                               num_threads, companion);
#else
    (void)tiles;
#endif
    return panels_linear(format, x, weight, out, rows, in_features, out_features, num_threads,
                         companion);
  }
  return blocks_linear(format, x, weight, out, rows, in_features, out_features, num_threads);
}

// A prompt row's path (kvshare_prompt_path): one per format, build and process.
int prompt_path(int format) {
  if (amx_format(format) && amx_supported()) return kPromptTiles;
#if defined(__AVX512F__)
  if (format > kPanelCode) return kPromptFmas;
#endif
  return kPromptGemm;
}

int prompt_linear(int format, const float* x, const uint8_t* weight, float* out, int rows,
                  int in_features, int64_t out_features, int num_threads,
                  const Companion* companion) {
  const int path = prompt_path(format);
  if (path == kPromptGemm)
    return prefill_gemm(format, x, weight, out, rows, in_features, out_features, num_threads,
                        companion);
  return linear_on(format, x, weight, out, rows, in_features, out_features, num_threads,
                   companion, path == kPromptTiles);
}

// The rows in runs of one path each: tile_rows[r] 1 puts row r on the prompt path
// (prompt_linear), 0 on the FMAs; nullptr: every row on the process's default path
// (kvshare_panel_amx). A row's output depends only on the row and its path, so a run computes
// its rows as the whole call would. The last run asks for the companion's ranges (in a step,
// the prompt rows after the decode rows: the long run).
int linear_by_rows(int format, const float* x, const uint8_t* weight, float* out, int rows,
                   int in_features, int64_t out_features, int num_threads,
                   const Companion* companion, const int32_t* tile_rows) {
  if (tile_rows == nullptr)
    return linear_on(format, x, weight, out, rows, in_features, out_features, num_threads,
                     companion, amx_active());
  for (int r0 = 0; r0 < rows;) {
    int r1 = r0 + 1;
    while (r1 < rows && (tile_rows[r1] != 0) == (tile_rows[r0] != 0)) ++r1;
    const float* xs = x + int64_t{r0} * in_features;
    float* ys = out + int64_t{r0} * out_features;
    const Companion* asking = r1 == rows ? companion : nullptr;
    const int status =
        tile_rows[r0] != 0
            ? prompt_linear(format, xs, weight, ys, r1 - r0, in_features, out_features,
                            num_threads, asking)
            : linear_on(format, xs, weight, ys, r1 - r0, in_features, out_features, num_threads,
                        asking, false);
    if (status) return status;
    r0 = r1;
  }
  return 0;
}

}  // namespace
}  // namespace kvshare

// The entry points (kvshare_native.h says what each takes and returns).
using namespace kvshare;

extern "C" {

int kvshare_prompt_path(int format) { return prompt_path(format); }

int kvshare_block_linear(int format, const float* x, const uint8_t* weight, float* out, int rows,
                         int in_features, int64_t out_features, int num_threads) {
  return linear_by_rows(format, x, weight, out, rows, in_features, out_features, num_threads,
                        nullptr, nullptr);
}

int kvshare_block_linear_rows(int format, const float* x, const uint8_t* weight, float* out,
                              int rows, int in_features, int64_t out_features, int num_threads,
                              const int32_t* tile_rows) {
  return linear_by_rows(format, x, weight, out, rows, in_features, out_features, num_threads,
                        nullptr, tile_rows);
}

int kvshare_block_linear_asking(int format, const float* x, const uint8_t* weight, float* out,
                                int rows, int in_features, int64_t out_features, int num_threads,
                                const int32_t* tile_rows, const char* const* starts,
                                int64_t count, int64_t bytes) {
  const Companion companion{starts, count, bytes};
  return linear_by_rows(format, x, weight, out, rows, in_features, out_features, num_threads,
                        &companion, tile_rows);
}

int kvshare_block_rows(int format, const uint8_t* table, const int64_t* ids, float* out, int rows,
                       int in_features) {
  if (format > kPanelCode) {
    if (in_features % 32) return 2;
    return panels_lookup(format, table, ids, out, rows, in_features);
  }
  return blocks_lookup(format, table, ids, out, rows, in_features);
}

}  // extern "C"
