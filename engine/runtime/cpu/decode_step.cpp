// One step's layer stack in native code: for T tokens, each attending as a decode query at its
// own position (block_tables [T, *] and seq_lens [T] per token, so decode rows and prefill
// chunks alike), every Llama layer (RMSNorm with the residual add, the fused q/k/v projection,
// rope with the KV store, paged attention, the output projection, RMSNorm, gate/up,
// SiLU-and-multiply, down) and the final norm, with no interpreter between the ops. Gemma 3's
// layer is the same with its additions (engine/runtime/models/gemma3.py): q/k norms before rope,
// the attention and MLP outputs normed before their residual adds, GELU-tanh for SiLU, and per
// layer a sliding window and the local or global rope table. Each op is the library's own entry
// point (kvshare_native.h), the same the torch model calls one by one, in the same order on the
// same buffers: so the step computes exactly what the module-by-module forward computes
// (engine/runtime/models/llama.py), which stays the reference.
//
// fp32 activations, KV caches in fp32, fp16 or bf16 (dims' kv_dtype, a cache dtype code),
// projections held as GGUF blocks, no biases:
// engine/runtime/cpu/decode_step.py checks those before it calls here, and keeps the buffers
// (preallocated per batch-size bucket) and the per-layer pointer table.

#include <cstdint>
#include <cstring>
#include <vector>

#include "kvshare_native.h"

namespace kvshare {
namespace {

// The model's shape and the step's, as decode_step.py packs them (int64 each, in this order).
struct Dims {
  int64_t tokens, hidden, inter, heads, kv_heads, head_dim, layers, block_size, max_blocks,
      num_slots, kv_dtype, activation;
};
constexpr int64_t kGeluTanh = 1;  // Dims::activation: 0 SiLU, 1 GELU (tanh)

// One layer's tensors, as decode_step.py packs them: 14 addresses (norms null where the layer
// has none; qkv1 and qkv2 null unless q/k/v come in parts of different formats); then per layer
// 10 int32 (kLayerInts).
struct Layer {
  const float* input_norm;
  const float* post_norm;  // the norm before the MLP (Gemma's pre_feedforward_layernorm)
  const uint8_t* qkv;
  const uint8_t* o;
  const uint8_t* gate_up;
  const uint8_t* down;
  void* k_cache;  // of the cache's type (Dims::kv_dtype)
  void* v_cache;
  const float* q_norm;         // per head, before rope
  const float* k_norm;
  const float* attn_out_norm;  // the attention's output, before its residual add
  const float* mlp_out_norm;   // the MLP's output, before its residual add
  const uint8_t* qkv1;         // the fused q/k/v rows' second and third runs of one format
  const uint8_t* qkv2;
};
constexpr int kLayerFields = 14;
// qkv (its first part), o, gate_up, down formats; the window (0: none); 1 for the local rope;
// the formats of qkv's second and third parts; the rows of its first and second parts.
constexpr int kLayerInts = 10;
constexpr int kWindow = 4, kLocalRope = 5, kQkvFormats = 6, kQkvRows = 8;

// The step's activations: every buffer [tokens, *] fp32, owned by the caller; tile_rows
// [tokens]: each row's projection path (kvshare_block_linear_rows), or null.
struct Buffers {
  float *normed, *qkv, *q, *attn, *delta, *gate_up, *act;
  float* part;  // [tokens, qkv width]: a part of q/k/v (BlockLinearParts) before it is placed
  int32_t* tile_rows;
};

Layer layer_at(const int64_t* table, int i) {
  const int64_t* p = table + int64_t{i} * kLayerFields;
  return {reinterpret_cast<const float*>(p[0]),   reinterpret_cast<const float*>(p[1]),
          reinterpret_cast<const uint8_t*>(p[2]), reinterpret_cast<const uint8_t*>(p[3]),
          reinterpret_cast<const uint8_t*>(p[4]), reinterpret_cast<const uint8_t*>(p[5]),
          reinterpret_cast<void*>(p[6]),          reinterpret_cast<void*>(p[7]),
          reinterpret_cast<const float*>(p[8]),   reinterpret_cast<const float*>(p[9]),
          reinterpret_cast<const float*>(p[10]),  reinterpret_cast<const float*>(p[11]),
          reinterpret_cast<const uint8_t*>(p[12]), reinterpret_cast<const uint8_t*>(p[13])};
}

// The fused q/k/v projection of normed, q and k normed per head where the layer has q/k
// norms, then rope on q (-> b.q) and K/V stored, for all rows.
int project_and_store(const Dims& d, const Layer& w, const int32_t* formats, const Buffers& b,
                      const float* cos, const float* sin, const int64_t* slots, float eps,
                      int threads) {
  const int T = static_cast<int>(d.tokens), E = static_cast<int>(d.hidden);
  const int64_t qkv_width = (d.heads + 2 * d.kv_heads) * d.head_dim;
  int status = 0;
  if (w.qkv1 == nullptr) {
    status = kvshare_block_linear_rows(formats[0], b.normed, w.qkv, b.qkv, T, E, qkv_width,
                                       threads, b.tile_rows);
  } else {
    // Each part into b.part, then into its columns of qkv: the columns the module path's
    // BlockLinearParts concatenates.
    const uint8_t* parts[3] = {w.qkv, w.qkv1, w.qkv2};
    const int64_t first = formats[kQkvRows], second = formats[kQkvRows + 1];
    const int64_t widths[3] = {first, second, qkv_width - first - second};
    const int codes[3] = {formats[0], formats[kQkvFormats], formats[kQkvFormats + 1]};
    for (int p = 0, column = 0; p < 3 && status == 0; column += widths[p], ++p) {
      if (parts[p] == nullptr) continue;
      status = kvshare_block_linear_rows(codes[p], b.normed, parts[p], b.part, T, E, widths[p],
                                         threads, b.tile_rows);
      for (int t = 0; status == 0 && t < T; ++t)
        std::memcpy(b.qkv + t * qkv_width + column, b.part + t * widths[p],
                    widths[p] * sizeof(float));
    }
  }
  if (status) return status;
  if (w.q_norm != nullptr)
    kvshare_qk_norm(kFloat32, b.qkv, qkv_width, w.q_norm, w.k_norm, T, d.heads, d.kv_heads,
                    d.head_dim, eps, threads);
  status = kvshare_rope_store(kFloat32, static_cast<int>(d.kv_dtype), b.qkv, qkv_width, cos, sin,
                              slots, b.q, w.k_cache, w.v_cache, T, d.heads, d.kv_heads,
                              d.head_dim, d.num_slots, threads);
  return status ? 10 + status : 0;
}

// The attention of `rows` query rows b.q (row r a decode query over block_tables[r] and
// seq_lens[r]), then the output projection: -> b.delta. warm: the layer before asked for this
// layer's K/V during its MLP (see NextBlocks).
int attend_and_project(const Dims& d, const Layer& w, const int32_t* formats, const Buffers& b,
                       int rows, const int32_t* block_tables, const int32_t* seq_lens,
                       float scale, bool warm, int threads) {
  const int window = formats[kWindow];
  const int E = static_cast<int>(d.hidden);
  const int64_t q_width = d.heads * d.head_dim;
  const int status = kvshare_paged_decode_warm(
      kFloat32, static_cast<int>(d.kv_dtype), b.q, w.k_cache, w.v_cache, block_tables, seq_lens,
      b.attn, rows, d.heads, d.kv_heads, d.head_dim, d.block_size, d.max_blocks, scale, threads,
      warm, window);
  if (status) return 20 + status;
  return kvshare_block_linear_rows(formats[1], b.attn, w.o, b.delta, rows, q_width, E, threads,
                                   b.tile_rows);
}

// The K and V blocks the next layer's attention will read (`next`'s caches): each sequence's
// once (a prefill chunk's rows after its first share its blocks), K and V of a block in turn.
// The MLP asks for them as it computes (block_kernels.h's Companion): a decode row's context
// otherwise comes from memory in the attention, one sequence's blocks at a time, at a fraction
// of the bandwidth, while the MLP's arithmetic leaves the bus mostly idle. The next layer's
// attention then finds them in cache and scores every row in tiles (paged_attention.cpp, Shape::warm).
// At batch 8 the layer stack took 13.6% less at 300 positions, 8% at 600, the same at 1000,
// where the blocks no longer fit the caches (benchmarks/ab_native_step.py, AMD EPYC Zen 4).
struct NextBlocks {
  std::vector<const char*> starts;
  int64_t bytes = 0;
};

// A sliding-window layer's rows read their last `window` positions only: its blocks from the
// one holding a row's first visible position.
void find_next_blocks(const Dims& d, const Layer& next, int window, const int32_t* block_tables,
                      const int32_t* seq_lens, NextBlocks& out) {
  out.starts.clear();
  out.bytes = d.block_size * d.kv_heads * d.head_dim * (d.kv_dtype == kFloat32 ? 4 : 2);
  const char* k_cache = static_cast<const char*>(next.k_cache);
  const char* v_cache = static_cast<const char*>(next.v_cache);
  for (int64_t r = 0; r < d.tokens; ++r) {
    // A chunk's later rows read the blocks its first row listed.
    if (continues_chunk(block_tables, seq_lens, r, d.max_blocks)) continue;
    const int32_t* table = block_tables + r * d.max_blocks;
    const int64_t blocks = (seq_lens[r] + d.block_size - 1) / d.block_size;
    const int64_t first = window > 0 && seq_lens[r] > window ? (seq_lens[r] - window) : 0;
    for (int64_t b = first / d.block_size; b < blocks; ++b) {
      out.starts.push_back(k_cache + table[b] * out.bytes);
      out.starts.push_back(v_cache + table[b] * out.bytes);
    }
  }
}

// MLP: normed -> delta, asking for `next`'s blocks meanwhile (gate/up the first two thirds, as
// it has twice down's arithmetic; down the rest).
int mlp(const Dims& d, const Layer& w, const int32_t* formats, const Buffers& b, int T,
        const NextBlocks& next, int threads) {
  const int E = static_cast<int>(d.hidden);
  const int I = static_cast<int>(d.inter);
  const int64_t count = static_cast<int64_t>(next.starts.size()), split = count * 2 / 3;
  int status = kvshare_block_linear_asking(formats[2], b.normed, w.gate_up, b.gate_up, T, E,
                                           2 * d.inter, threads, b.tile_rows,
                                           next.starts.data(), split, next.bytes);
  if (status) return status;
  if (d.activation == kGeluTanh)
    kvshare_gelu_tanh_mul(kFloat32, b.gate_up, b.act, T, I, threads);
  else
    kvshare_silu_mul(kFloat32, b.gate_up, b.act, T, I, threads);
  return kvshare_block_linear_asking(formats[3], b.act, w.down, b.delta, T, I, E, threads,
                                     b.tile_rows, next.starts.data() + split, count - split,
                                     next.bytes);
}

// Moves rows keep[0] < keep[1] < ... of a [*, width] buffer to rows 0, 1, ... (in place: each
// row moves up or stays).
template <typename T>
void compact_rows(T* rows, int64_t width, const int64_t* keep, int64_t count) {
  for (int64_t j = 0; j < count; ++j)
    if (keep[j] != j) std::memmove(rows + j * width, rows + keep[j] * width, width * sizeof(T));
}

}  // namespace
}  // namespace kvshare

// The entry point (kvshare_native.h says what it takes and returns).
using namespace kvshare;

extern "C" {

int kvshare_decode_layers(const int64_t* dims, const int64_t* layers, const int32_t* formats,
                          const int64_t* buffers, float* hidden, float* out, const float* cos,
                          const float* sin, const float* cos_local, const float* sin_local,
                          const int64_t* slots, int32_t* block_tables,
                          int32_t* seq_lens, int32_t* tile_rows, const int64_t* keep,
                          int64_t keep_rows,
                          const float* final_norm, float eps, float scale, int threads) {
  const Dims d{dims[0], dims[1], dims[2], dims[3], dims[4],  dims[5],
               dims[6], dims[7], dims[8], dims[9], dims[10], dims[11]};
  const Buffers b{reinterpret_cast<float*>(buffers[0]), reinterpret_cast<float*>(buffers[1]),
                  reinterpret_cast<float*>(buffers[2]), reinterpret_cast<float*>(buffers[3]),
                  reinterpret_cast<float*>(buffers[4]), reinterpret_cast<float*>(buffers[5]),
                  reinterpret_cast<float*>(buffers[6]), reinterpret_cast<float*>(buffers[7]),
                  tile_rows};
  const int E = static_cast<int>(d.hidden);
  const bool trim = keep_rows >= 0;
  for (int64_t j = 0; trim && j < keep_rows; ++j)
    if (keep[j] < (j ? keep[j - 1] + 1 : 0) || keep[j] >= d.tokens) return 3;
  int rows = static_cast<int>(d.tokens);
  for (int i = 0; i < d.layers; ++i) {
    const Layer w = layer_at(layers, i);
    const int32_t* f = formats + int64_t{i} * kLayerInts;
    if (i == 0)
      kvshare_rms_norm(kFloat32, hidden, w.input_norm, b.normed, d.tokens, E, eps, threads);
    else
      kvshare_add_rms_norm(kFloat32, hidden, b.delta, w.input_norm, b.normed, d.tokens, E, eps,
                           threads);
    const bool local = f[kLocalRope] != 0;
    if (local && cos_local == nullptr) return 4;
    int status = project_and_store(d, w, f, b, local ? cos_local : cos, local ? sin_local : sin,
                                   slots, eps, threads);
    if (status) return 100 * (i + 1) + status;
    if (trim && i + 1 == d.layers) {  // past the K/V store only the kept rows matter
      compact_rows(b.q, d.heads * d.head_dim, keep, keep_rows);
      compact_rows(hidden, d.hidden, keep, keep_rows);
      compact_rows(block_tables, d.max_blocks, keep, keep_rows);
      compact_rows(seq_lens, 1, keep, keep_rows);
      if (tile_rows != nullptr) compact_rows(tile_rows, 1, keep, keep_rows);
      rows = static_cast<int>(keep_rows);
      if (rows == 0) return 0;
    }
    // Warm after an MLP that asked: the layer before's gate/up and down are panels (Companion
    // is the panel kernels').
    const bool warm =
        i > 0 && f[2 - kLayerInts] > kPanelCode && f[3 - kLayerInts] > kPanelCode;
    status = attend_and_project(d, w, f, b, rows, block_tables, seq_lens, scale, warm, threads);
    if (status) return 100 * (i + 1) + status;
    if (w.attn_out_norm != nullptr)
      kvshare_rms_norm(kFloat32, b.delta, w.attn_out_norm, b.delta, rows, E, eps, threads);
    kvshare_add_rms_norm(kFloat32, hidden, b.delta, w.post_norm, b.normed, rows, E, eps,
                         threads);
    thread_local NextBlocks next;  // reused: no allocation once grown
    next.starts.clear();
    if (i + 1 < d.layers) {
      const int next_window = f[kLayerInts + kWindow];
      find_next_blocks(d, layer_at(layers, i + 1), next_window, block_tables, seq_lens, next);
    }
    status = mlp(d, w, f, b, rows, next, threads);
    if (status) return 100 * (i + 1) + status;
    if (w.mlp_out_norm != nullptr)
      kvshare_rms_norm(kFloat32, b.delta, w.mlp_out_norm, b.delta, rows, E, eps, threads);
  }
  kvshare_add_rms_norm(kFloat32, hidden, b.delta, final_norm, out, rows, E, eps, threads);
  return 0;
}

}  // extern "C"
