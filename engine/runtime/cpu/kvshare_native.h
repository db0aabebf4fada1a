// The native CPU kernel library's interface: the codes its arguments take and every entry
// point's prototype. Every source of the library includes it and defines its entry points
// against it; engine/runtime/cpu/native.py reads it to declare the ctypes bindings and the
// codes, so each is written here and nowhere else.
//
// native.py parses this file, so it keeps to a few forms: a constant is
// `constexpr int kName = <integer>;` and the extern "C" block holds only prototypes, each
// returning int and naming its parameters, of type int, int64_t, float or a pointer (bound as
// an address: callers pass a tensor's data_ptr() or None). Other C++ declarations are not bound.
// tests/engine/runtime/test_native_header.py fails on a definition, a binding or a Python code
// that disagrees with this file.
//
// Every entry point returns 0 on success; the other statuses are said at each. Tensors are
// contiguous and row-major; shapes use the attention interface's axes (B sequences, T tokens,
// H heads, D head dim, E hidden, I intermediate).

#pragma once

#include <cstdint>

namespace kvshare {

// Dtype codes: `dtype` (the activations') and `cache_dtype` (a KV cache's) arguments.
constexpr int kFloat32 = 0;
constexpr int kBfloat16 = 1;
constexpr int kFloat16 = 2;  // a KV cache's only, under float32 activations

// Weight format codes: GGML's type numbers of the GGUF block formats (`format` arguments)...
constexpr int kQ4_0 = 2;
constexpr int kQ4_1 = 3;
constexpr int kQ5_0 = 6;
constexpr int kQ8_0 = 8;
constexpr int kQ4_K = 12;
constexpr int kQ6_K = 14;
// ... and kPanelCode plus any of them for its blocks as panels (engine/runtime/cpu/
// block_linear.py, to_panels: Q4_0, Q4_1, Q5_0 and Q8_0 reordered, Q4_K and Q6_K per group).
constexpr int kPanelCode = 100;

// A prompt row's paths (kvshare_prompt_path).
constexpr int kPromptFmas = 0;
constexpr int kPromptTiles = 1;
constexpr int kPromptGemm = 2;

// Floats in one of the kernels' vectors: row lengths are multiples of it, and a panel holds
// this many output columns.
constexpr int kLanes = 16;

// Shared by the sources, not bound (C++ linkage). Whether row `row` of a paged-attention call
// (block_tables [rows, max_blocks], seq_lens [rows]) is the next position of the row before in
// the same sequence: a prefill chunk's rows after its first, whose context the row before has
// just read into cache (paged_attention.cpp; decode_step.cpp asks it too).
bool continues_chunk(const int32_t* block_tables, const int32_t* seq_lens, int64_t row,
                     int64_t max_blocks);

}  // namespace kvshare

extern "C" {

// ---- Paged decode attention (paged_attention.cpp) and the Llama block's fused ops
// (fused_ops.cpp) ----
// dtype: kFloat32 or kBfloat16, else status 1. Paged decode and rope-store also take the KV
// cache's code: the activations' own, or kBfloat16 / kFloat16 under kFloat32; 1 for any other
// pair.

// 1 when paged decode covers head_dim and group = H / Hkv (else the caller's torch path runs).
int kvshare_supports_shape(int head_dim, int group);

// Decode attention, one query token per sequence, K/V read in place through each block table:
// query [B, H, D], out [B, H, D], k_cache / v_cache [num_blocks, block_size, Hkv, D],
// block_tables [B, max_blocks] int32, seq_lens [B] int32. window: a sliding window's width, so
// row b sees positions max(0, seq_lens[b] - window) .. seq_lens[b] - 1; 0: all of them (last, so
// benchmarks/ab.py's older trees, without it, take the same call). 2 for a shape
// kvshare_supports_shape refuses or a negative window.
int kvshare_paged_decode(int dtype, int cache_dtype, const void* query, const void* k_cache,
                         const void* v_cache, const int32_t* block_tables,
                         const int32_t* seq_lens, void* out, int num_seqs, int num_heads,
                         int num_kv_heads, int head_dim, int block_size, int max_blocks,
                         float scale, int num_threads, int window);

// kvshare_paged_decode; warm 1: the caller asked for the K/V ahead (decode_step.cpp), so every
// row scores in tiles as from cache.
int kvshare_paged_decode_warm(int dtype, int cache_dtype, const void* query, const void* k_cache,
                              const void* v_cache, const int32_t* block_tables,
                              const int32_t* seq_lens, void* out, int num_seqs, int num_heads,
                              int num_kv_heads, int head_dim, int block_size, int max_blocks,
                              float scale, int num_threads, int warm, int window);

// Each row's argmax (torch.argmax's answer): x float32 [rows, cols] -> out int64 [rows]. 2 when
// cols is not in 1 .. 2^24 (indices ride in float lanes).
int kvshare_argmax(const float* x, int64_t rows, int64_t cols, int64_t* out);

// out [rows, dim] = RMSNorm(x [rows, dim]) * weight [dim].
int kvshare_rms_norm(int dtype, const void* x, const void* weight, void* out, int64_t rows,
                     int dim, float eps, int num_threads);

// The residual add, then RMSNorm: x = x + delta in place, out = RMSNorm(x) * weight.
int kvshare_add_rms_norm(int dtype, void* x, const void* delta, const void* weight, void* out,
                         int64_t rows, int dim, float eps, int num_threads);

// gate_up [rows, 2 inter] -> out [rows, inter] = silu(gate) * up.
int kvshare_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int inter,
                     int num_threads);

// gate_up [rows, 2 inter] -> out [rows, inter] = gelu_tanh(gate) * up (Gemma's MLP).
int kvshare_gelu_tanh_mul(int dtype, const void* gate_up, void* out, int64_t rows, int inter,
                          int num_threads);

// q/k norms in place on the fused rows qkv [T, (H + 2 Hkv) D] (token stride row_stride): each
// query head's D values normed as kvshare_rms_norm does a row, times q_weight [D]; each key
// head's times k_weight [D]; V untouched.
int kvshare_qk_norm(int dtype, void* qkv, int64_t row_stride, const void* q_weight,
                    const void* k_weight, int64_t tokens, int heads, int kv_heads, int head_dim,
                    float eps, int num_threads);

// Rotate-half rope: x [T, heads, head_dim] (token stride row_stride), cos / sin [T, D / 2] ->
// out [T, heads, head_dim] contiguous.
int kvshare_rope(int dtype, const void* x, int64_t row_stride, const void* cos, const void* sin,
                 void* out, int64_t tokens, int heads, int head_dim, int num_threads);

// Rope of q and k and the KV store in one pass over the fused rows qkv [T, (H + 2 Hkv) D]
// (token stride row_stride): q_out [T, H, D]; rotated K and plain V written to slot slots[t]
// (int64 [T]) of k_cache / v_cache [num_slots, Hkv, D]. 3, with nothing written, for a slot out
// of range.
int kvshare_rope_store(int dtype, int cache_dtype, const void* qkv, int64_t row_stride,
                       const void* cos, const void* sin, const int64_t* slots, void* q_out,
                       void* k_cache, void* v_cache, int64_t tokens, int heads, int kv_heads,
                       int head_dim, int64_t num_slots, int num_threads);

// out [rows, out_features] = x [rows, in_features] weight^T, for a few rows (an LM head).
int kvshare_gemv(int dtype, const void* x, const void* weight, void* out, int rows,
                 int in_features, int64_t out_features, int num_threads);

// ---- Linears on GGUF blocks (block_linear.cpp) ----
// out [rows, out_features] = x [rows, in_features] W^T, fp32, W [out_features, in_features]
// held as blocks of `format`. 1 for an unknown format; 2 when in_features is not a whole number
// of blocks (or out_features of panels).

// Every row on the process's default path (kvshare_panel_amx).
int kvshare_block_linear(int format, const float* x, const uint8_t* weight, float* out, int rows,
                         int in_features, int64_t out_features, int num_threads);

// Each row's path given: tile_rows [rows] int32, 1 for a prompt row (the path
// kvshare_prompt_path names), 0 for the FMAs; null for the default path.
int kvshare_block_linear_rows(int format, const float* x, const uint8_t* weight, float* out,
                              int rows, int in_features, int64_t out_features, int num_threads,
                              const int32_t* tile_rows);

// kvshare_block_linear_rows, asking for `count` ranges of `bytes` bytes at `starts` while it
// computes (panel formats; a prefetch hint that changes nothing computed).
int kvshare_block_linear_asking(int format, const float* x, const uint8_t* weight, float* out,
                                int rows, int in_features, int64_t out_features, int num_threads,
                                const int32_t* tile_rows, const char* const* starts,
                                int64_t count, int64_t bytes);

// Rows ids [rows] of a block-held table (an embedding) as GGUF dequantizes them:
// out [rows, in_features] fp32.
int kvshare_block_rows(int format, const uint8_t* table, const int64_t* ids, float* out, int rows,
                       int in_features);

// The default path of calls that do not give each row's (kvshare_block_linear, the greedy
// head): `enable` 1 puts the panel formats on AMX tiles where the CPU and the OS allow, 0 on the
// FMAs, -1 leaves it; returns 1 when the tiles are the default (amx_panels.cpp). The two paths
// give different bits: switch only between calls, never while a model serves.
int kvshare_panel_amx(int enable);

// The path a prompt row (tile_rows 1) of `format` takes in this build and process, fixed for
// the process whatever the row count: kPromptTiles for a panel format where this process has
// AMX tiles; kPromptFmas for a panel format on an AVX-512 build without them (its FMAs run
// near the FMA peak already, and short runs would pay the GEMM's expansion); else
// kPromptGemm (kvshare_prefill_gemm).
int kvshare_prompt_path(int format);

// ---- A prompt chunk's linears on the FMAs (prefill_gemm.cpp) ----

// kvshare_block_linear's product (its formats, shapes and statuses) for many rows: each weight
// expanded to fp32 once per call, then register-blocked FMAs over every row, one summation
// order per output element whatever the row count (other bits than kvshare_block_linear's).
int kvshare_prefill_gemm(int format, const float* x, const uint8_t* weight, float* out, int rows,
                         int in_features, int64_t out_features, int num_threads);

// ---- Greedy tokens under a Q8_0 panel head (greedy_head.cpp) ----

// ids [rows] int64 = each row's argmax of x [rows, in_features] W^T, W a Q8_0 panel head with
// row norms `norms` [out_features] (each at least the row's true norm); *computed = the (row,
// panel) pairs it computed exactly. 1 for another format, 2 for shapes the panels do not cover,
// 3 when a row or a logit is not finite (the caller then computes the logits).
int kvshare_greedy_head(int format, const float* x, const uint8_t* weight, const float* norms,
                        int64_t* ids, int rows, int in_features, int64_t out_features,
                        int num_threads, int64_t* computed);

// 1 where the greedy head's estimate runs on AVX-512 VNNI (and VBMI's byte permutation), which
// is where it beats the full head; 0 where it runs the plain loops.
int kvshare_greedy_head_fast(void);

// ---- A step's layer stack (decode_step.cpp) ----

// Every Llama (or Gemma 3) layer and the final norm for T tokens, each a decode query at its
// own position. dims: 12 int64 (tokens, hidden, inter, heads, kv_heads, head_dim, layers,
// block_size, max_blocks, num_slots, kv_dtype, activation: 0 SiLU, 1 GELU-tanh); layers
// [layers, 14] int64 addresses (input_norm, post_norm: the norm before the MLP, qkv, o,
// gate_up, down, k_cache, v_cache, then q_norm, k_norm, attn_out_norm, mlp_out_norm: 0 where
// the layer has none, then qkv's second and third parts: 0 unless its rows come in runs of
// different formats); formats [layers, 10] int32 (qkv, o, gate_up, down format codes, the
// sliding window or 0, 1 for the local rope table, qkv's second and third parts' format codes,
// the rows of its first and second parts); buffers: 8 addresses of [T, *] fp32 scratch
// (normed, qkv, q, attn, delta, gate_up, act, part: as wide as qkv). hidden [T, E]: the embedded tokens in, the
// residual stream out; out [T, E]: the final-normed rows (the model's forward result). cos /
// sin [T, D / 2]: the rope of each token's position; cos_local / sin_local: the local rope's
// (null where no layer takes it). block_tables [T, max_blocks], seq_lens [T] and
// slots [T]: each token's; tile_rows: null, or [T] each row's projection path (see
// kvshare_block_linear_rows). keep: the rows whose final-normed row is wanted, strictly
// increasing (keep_rows of them), or keep_rows -1 for all: the last layer then stores every
// row's K/V but runs the rest on those rows only, and out [keep_rows, E] holds them in that
// order (each op computes a row alone, so a kept row has the bits it has in the whole step;
// hidden, block_tables, seq_lens and tile_rows are compacted in place). Else the failing op's
// status (block linear's 1-2, rope store's + 10, paged decode's + 20) plus 100 * (layer + 1);
// 3: keep not strictly increasing within [0, T); 4: a local-rope layer without its table.
int kvshare_decode_layers(const int64_t* dims, const int64_t* layers, const int32_t* formats,
                          const int64_t* buffers, float* hidden, float* out, const float* cos,
                          const float* sin, const float* cos_local, const float* sin_local,
                          const int64_t* slots, int32_t* block_tables,
                          int32_t* seq_lens, int32_t* tile_rows, const int64_t* keep,
                          int64_t keep_rows, const float* final_norm, float eps, float scale,
                          int threads);

}  // extern "C"
