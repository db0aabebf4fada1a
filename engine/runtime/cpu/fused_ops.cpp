// The Llama block's fused ops: RMSNorm alone or after the residual add, q/k norms per head,
// SiLU-and-mul (GELU-tanh-and-mul for Gemma), rope alone or with the KV store, a few-row
// matrix-vector product for the LM head, and each row's argmax. Built and called as paged_attention.cpp is (engine/runtime/cpu/native.py).

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dtype_dispatch.h"
#include "kvshare_native.h"
#include "vectors.h"

namespace kvshare {
namespace {

// ---- Fused elementwise ops of a Llama block -------------------------------------------------
// Each rounds to the storage type wherever the torch code it replaces (engine/runtime/models/llama.py)
// does, so bf16 results match torch's up to the last bit of an fp32 intermediate. Rows are
// contiguous and their lengths multiples of 16 (engine/runtime/cpu/fused.py checks first).

constexpr int64_t kParallelMin = 1 << 16;  // elements below which threads cost more than they save

template <typename T>
inline vfloat round_as(vfloat v);

template <>
inline vfloat round_as<float>(vfloat v) {
  return v;
}

template <>
inline vfloat round_as<bf16>(vfloat v) {
  vuint bits = bitcast<vuint>(v);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bitcast<vfloat>(bits & 0xffff0000u);
}

// out = weight * to_T(x * rsqrt(mean(x^2) + eps)) for one row of dim, statistics in fp32
// (LlamaRMSNorm); out may be x.
template <typename T>
inline void norm_row(const T* row, const T* weight, T* out, int dim, float eps) {
  vfloat squares = splat(0.f);
  for (int i = 0; i < dim; i += kLanes) {
    const vfloat v = load(row + i);
    squares += v * v;
  }
  const float inv_rms = 1.f / std::sqrt(sum(squares) / dim + eps);
  for (int i = 0; i < dim; i += kLanes) {
    const vfloat normed = round_as<T>(load(row + i) * inv_rms);
    store(load(weight + i) * normed, out + i);
  }
}

template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int dim, float eps,
              int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * dim, weight, out + r * dim, dim, eps);
}

// q/k norms (Qwen3, Gemma 3), in place on the fused rows qkv [T, (H + 2 Hkv) D] (token stride
// row_stride): each of the H query heads normed by q_weight [D], each of the Hkv key heads by
// k_weight [D], every head a row of rms_norm(); V untouched.
template <typename T>
void qk_norm(T* qkv, int64_t row_stride, const T* q_weight, const T* k_weight, int64_t tokens,
             int heads, int kv_heads, int head_dim, float eps, int num_threads) {
  const int per_token = heads + kv_heads;
#pragma omp parallel for num_threads(num_threads) if (tokens * per_token * head_dim >= kParallelMin)
  for (int64_t i = 0; i < tokens * per_token; ++i) {
    const int64_t t = i / per_token;
    const int h = static_cast<int>(i % per_token);
    T* row = qkv + t * row_stride + int64_t{h} * head_dim;
    norm_row(row, h < heads ? q_weight : k_weight, row, head_dim, eps);
  }
}

// sigmoid(z) = e / (1 + e) below 0 and 1 / (1 + e) above, e = e^-|z|: never overflows, and
// nothing cancels in either tail.
inline vfloat sigmoid(vfloat z) {
  const vint negative = z < 0.f;
  const vfloat e = exp_nonpositive(select(negative, z, -z));
  return select(negative, e / (1.f + e), 1.f / (1.f + e));
}

// gate_up [rows, 2I] -> out [rows, I] = to_T(g sigmoid(slope(g))) * up for each gate g: SiLU
// (slope(g) = g) or GELU-tanh.
template <typename T, typename Slope>
void gated_mul(const T* gate_up, T* out, int64_t rows, int inter, int num_threads, Slope slope) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
    for (int i = 0; i < inter; i += kLanes) {
      const vfloat g = load(gate + i);
      store(round_as<T>(g * sigmoid(slope(g))) * load(up + i), out + r * inter + i);
    }
  }
}

// to_T(silu(gate)) * up.
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int inter, int num_threads) {
  gated_mul(gate_up, out, rows, inter, num_threads, [](vfloat g) { return g; });
}

// to_T(gelu_tanh(gate)) * up, gelu_tanh(g) = g / 2 (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715
// g^3) (F.gelu(approximate="tanh"), Gemma's MLP), taken as g sigmoid(2y), the same function:
// no 1 + tanh cancels (torch's fp32 tail loses most of its bits below g = -3; this stays within
// a few ulp of the float64 value).
template <typename T>
void gelu_tanh_mul(const T* gate_up, T* out, int64_t rows, int inter, int num_threads) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  gated_mul(gate_up, out, rows, inter, num_threads,
            [k](vfloat g) { return (g + g * g * g * 0.044715f) * k * 2.f; });
}

// Rotate-half rope of `heads` heads of one token: in [heads, D] -> out [heads, D];
// out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin, each product rounded first (cos/sin [D/2]);
// stored as O (a KV cache's type may differ from T's), rounded once more there.
template <typename T, typename O>
inline void rope_heads(const T* in, const T* cos, const T* sin, O* out, int heads, int head_dim) {
  const int half = head_dim / 2;
  for (int h = 0; h < heads; ++h, in += head_dim, out += head_dim) {
    for (int i = 0; i < half; i += kLanes) {
      const vfloat x1 = load(in + i), x2 = load(in + half + i);
      const vfloat c = load(cos + i), s = load(sin + i);
      store(round_as<T>(x1 * c) - round_as<T>(x2 * s), out + i);
      store(round_as<T>(x2 * c) + round_as<T>(x1 * s), out + half + i);
    }
  }
}

// Rope: x [T, H, D] (token stride row_stride), cos/sin [T, D/2] -> out [T, H, D] contiguous.
template <typename T>
void rope(const T* x, int64_t row_stride, const T* cos, const T* sin, T* out, int64_t tokens,
          int heads, int head_dim, int num_threads) {
  const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= kParallelMin)
  for (int64_t t = 0; t < tokens; ++t) {
    rope_heads(x + t * row_stride, cos + t * half, sin + t * half,
               out + t * heads * head_dim, heads, head_dim);
  }
}

// The attention block's rope(q), rope(k) and KV store in one pass over the fused qkv rows:
// qkv [T, (H + 2 Hkv) D] (token stride row_stride), cos/sin [T, D/2], slots [T] int64 ->
// q_out [T, H, D]; rotated K and plain V written to slot slots[t] of k_cache / v_cache
// ([num_slots, Hkv, D]). Returns 3, with nothing written, if a slot is out of range.
template <typename T, typename C>
int rope_store(const T* qkv, int64_t row_stride, const T* cos, const T* sin,
               const int64_t* slots, T* q_out, C* k_cache, C* v_cache, int64_t tokens,
               int heads, int kv_heads, int head_dim, int64_t num_slots, int num_threads) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0 || slots[t] >= num_slots) return 3;
  }
  const int half = head_dim / 2;
  const int64_t q_size = static_cast<int64_t>(heads) * head_dim;
  const int64_t kv_size = static_cast<int64_t>(kv_heads) * head_dim;
#pragma omp parallel for num_threads(num_threads) if (tokens * (q_size + kv_size) >= kParallelMin)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* row = qkv + t * row_stride;
    const T* c = cos + t * half;
    const T* s = sin + t * half;
    rope_heads(row, c, s, q_out + t * q_size, heads, head_dim);
    rope_heads(row + q_size, c, s, k_cache + slots[t] * kv_size, kv_heads, head_dim);
    const T* v = row + q_size + kv_size;
    C* v_slot = v_cache + slots[t] * kv_size;
    if constexpr (std::is_same_v<T, C>) {
      std::memcpy(v_slot, v, kv_size * sizeof(T));
    } else {
      for (int64_t i = 0; i < kv_size; i += kLanes) store(load(v + i), v_slot + i);
    }
  }
  return 0;
}

// The residual add and the next RMSNorm in one pass: x = to_T(x + delta) in place (the
// residual stream), out = rms_norm(x) as rms_norm() computes it.
template <typename T>
void add_rms_norm(T* x, const T* delta, const T* weight, T* out, int64_t rows, int dim,
                  float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    T* row = x + r * dim;
    const T* add = delta + r * dim;
    vfloat squares = splat(0.f);
    for (int i = 0; i < dim; i += kLanes) {
      const vfloat v = round_as<T>(load(row + i) + load(add + i));
      store(v, row + i);
      squares += v * v;
    }
    const float inv_rms = 1.f / std::sqrt(sum(squares) / dim + eps);
    for (int i = 0; i < dim; i += kLanes) {
      const vfloat normed = round_as<T>(load(row + i) * inv_rms);
      store(load(weight + i) * normed, out + r * dim + i);
    }
  }
}

// y [N, V] = x [N, K] W^T for a few rows (the LM head of a small decode batch): W [V, K] is
// streamed once, each output a K-long dot product of fp32 vectors held in registers (kRows
// known at compile time keeps the accumulators out of memory). Threads split V in chunks.
template <typename T, int kRows>
void gemv_rows(const T* x, const T* weight, T* out, int in_features, int64_t out_features,
               int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static, 64)
  for (int64_t v = 0; v < out_features; ++v) {
    const T* w = weight + v * in_features;
    vfloat acc[kRows] = {};
    for (int i = 0; i < in_features; i += kLanes) {
      const vfloat wv = load(w + i);
      for (int r = 0; r < kRows; ++r) acc[r] += load(x + r * int64_t{in_features} + i) * wv;
    }
    for (int r = 0; r < kRows; ++r) store_one(sum(acc[r]), out + r * out_features + v);
  }
}

// Rows in one pass over W; more rows read W again per group of kGemvMaxRows.
constexpr int kGemvMaxRows = 4;

template <typename T>
void gemv(const T* x, const T* weight, T* out, int rows, int in_features, int64_t out_features,
          int num_threads) {
  for (int r0 = 0; r0 < rows; r0 += kGemvMaxRows) {
    const T* xs = x + r0 * int64_t{in_features};
    T* ys = out + r0 * out_features;
    switch (rows - r0 < kGemvMaxRows ? rows - r0 : kGemvMaxRows) {
      case 1: gemv_rows<T, 1>(xs, weight, ys, in_features, out_features, num_threads); break;
      case 2: gemv_rows<T, 2>(xs, weight, ys, in_features, out_features, num_threads); break;
      case 3: gemv_rows<T, 3>(xs, weight, ys, in_features, out_features, num_threads); break;
      default: gemv_rows<T, 4>(xs, weight, ys, in_features, out_features, num_threads); break;
    }
  }
}

// Each row's argmax as torch.argmax gives it: the first index of the largest value, a NaN
// counting as larger than any number (the first NaN wins). One pass keeps, per lane, the
// largest value seen and its first index (a strict > keeps the earlier of equal values); then
// the lanes meet, the smaller index winning a tie, and the tail goes by scalars. A NaN never
// compares greater, so the pass also sums the row: a NaN sum sends the row to a scalar search
// for its first NaN (infinities of both signs sum to NaN too; the search then finds none and
// the answer stands). Indices ride in float lanes: exact below 2^24 (the entry point checks).
// Greedy sampling's whole cost: torch's argmax took 120-130 us on one 49,152-wide row here.
void argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t* out) {
  float lane_index[kLanes];
  for (int i = 0; i < kLanes; ++i) lane_index[i] = static_cast<float>(i);
  const vfloat iota = load(lane_index);
  const int64_t whole = cols / kLanes * kLanes;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    float best = row[0], best_at = 0;
    bool nan = std::isnan(row[0]);
    int64_t tail = 1;
    if (whole > 0) {
      vfloat lane_best = load(row), lane_at = iota, total = lane_best;
      for (int64_t i = kLanes; i < whole; i += kLanes) {
        const vfloat v = load(row + i);
        const vint greater = v > lane_best;
        lane_best = select(greater, v, lane_best);
        lane_at = select(greater, iota + static_cast<float>(i), lane_at);
        total += v;
      }
      best = lane_best[0], best_at = lane_at[0];
      for (int l = 1; l < kLanes; ++l)
        if (lane_best[l] > best || (lane_best[l] == best && lane_at[l] < best_at))
          best = lane_best[l], best_at = lane_at[l];
      nan = std::isnan(sum(total));
      tail = whole;
    }
    int64_t answer = static_cast<int64_t>(best_at);
    for (int64_t i = tail; i < cols; ++i) {
      nan = nan || std::isnan(row[i]);
      if (row[i] > best) best = row[i], answer = i;
    }
    if (nan)
      for (int64_t i = 0; i < cols; ++i)
        if (std::isnan(row[i])) {
          answer = i;
          break;
        }
    out[r] = answer;
  }
}

}  // namespace
}  // namespace kvshare

// The entry points (kvshare_native.h says what each takes and returns).
using namespace kvshare;

extern "C" {

int kvshare_argmax(const float* x, int64_t rows, int64_t cols, int64_t* out) {
  if (cols < 1 || cols > (int64_t{1} << 24)) return 2;
  argmax_rows(x, rows, cols, out);
  return 0;
}

int kvshare_rms_norm(int dtype, const void* x, const void* weight, void* out, int64_t rows,
                     int dim, float eps, int num_threads) {
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    rms_norm(static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<T*>(out), rows,
             dim, eps, num_threads);
    return 0;
  });
}

int kvshare_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int inter,
                     int num_threads) {
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_mul(static_cast<const T*>(gate_up), static_cast<T*>(out), rows, inter, num_threads);
    return 0;
  });
}

int kvshare_gelu_tanh_mul(int dtype, const void* gate_up, void* out, int64_t rows, int inter,
                          int num_threads) {
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    gelu_tanh_mul(static_cast<const T*>(gate_up), static_cast<T*>(out), rows, inter,
                  num_threads);
    return 0;
  });
}

int kvshare_qk_norm(int dtype, void* qkv, int64_t row_stride, const void* q_weight,
                    const void* k_weight, int64_t tokens, int heads, int kv_heads, int head_dim,
                    float eps, int num_threads) {
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    qk_norm(static_cast<T*>(qkv), row_stride, static_cast<const T*>(q_weight),
            static_cast<const T*>(k_weight), tokens, heads, kv_heads, head_dim, eps,
            num_threads);
    return 0;
  });
}

int kvshare_rope(int dtype, const void* x, int64_t row_stride, const void* cos, const void* sin,
                 void* out, int64_t tokens, int heads, int head_dim, int num_threads) {
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    rope(static_cast<const T*>(x), row_stride, static_cast<const T*>(cos),
         static_cast<const T*>(sin), static_cast<T*>(out), tokens, heads, head_dim, num_threads);
    return 0;
  });
}

int kvshare_rope_store(int dtype, int cache_dtype, const void* qkv, int64_t row_stride,
                       const void* cos, const void* sin, const int64_t* slots, void* q_out,
                       void* k_cache, void* v_cache, int64_t tokens, int heads, int kv_heads,
                       int head_dim, int64_t num_slots, int num_threads) {
  return with_cache_dtype(dtype, cache_dtype, [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using C = decltype(cache_tag);
    return rope_store(static_cast<const T*>(qkv), row_stride, static_cast<const T*>(cos),
                      static_cast<const T*>(sin), slots, static_cast<T*>(q_out),
                      static_cast<C*>(k_cache), static_cast<C*>(v_cache), tokens, heads,
                      kv_heads, head_dim, num_slots, num_threads);
  });
}

int kvshare_add_rms_norm(int dtype, void* x, const void* delta, const void* weight, void* out,
                         int64_t rows, int dim, float eps, int num_threads) {
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm(static_cast<T*>(x), static_cast<const T*>(delta), static_cast<const T*>(weight),
                 static_cast<T*>(out), rows, dim, eps, num_threads);
    return 0;
  });
}

int kvshare_gemv(int dtype, const void* x, const void* weight, void* out, int rows,
                 int in_features, int64_t out_features, int num_threads) {
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    gemv(static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<T*>(out), rows,
         in_features, out_features, num_threads);
    return 0;
  });
}

}  // extern "C"
