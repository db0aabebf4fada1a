// kvshare's native CPU kernels: paged decode attention (one query token per sequence, K/V read
// in place from the paged pool through each sequence's block table, no gather into a dense
// copy) and the Llama block's fused ops (RMSNorm alone or after the residual add, SiLU-and-mul,
// rope alone or with the KV store, and a few-row matrix-vector product for the LM head; at the
// end).
//
// Built on first use by engine/runtime/cpu/native.py (g++ -O3 -fopenmp, -march=native or a forced
// lower level: x86-64-v3 for AVX2, x86-64-v2 for SSE4.2) and called through ctypes with raw
// pointers to contiguous tensors; kvshare_native.h declares the entry points.
//
// Decode attention.
// Shapes (the attention interface's axes):
//   query [B, H, D], out [B, H, D]
//   k_cache, v_cache [num_blocks, block_size, Hkv, D]
//   block_tables [B, max_blocks] int32, seq_lens [B] int32
// A task is one sequence (or, with few sequences, one of its KV heads). The G = H / Hkv query
// heads that share a KV head are done together, so each K/V row is read once for all (GQA).
// Math is fp32 whatever the storage type, in two passes: scores and their softmax, then the
// weighted sum of V. Vectors have 16 floats whatever the target (vectors.h), so one source
// serves every level: one AVX-512 register, or two AVX2 (x86-64-v3) or four SSE (x86-64-v2)
// registers. D must be a multiple of 16.

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kvshare_native.h"
#include "vectors.h"

namespace kvshare {

bool continues_chunk(const int32_t* block_tables, const int32_t* seq_lens, int64_t row,
                     int64_t max_blocks) {
  return row > 0 && seq_lens[row] == seq_lens[row - 1] + 1 &&
         block_tables[row * max_blocks] == block_tables[(row - 1) * max_blocks];
}

namespace {

inline void store_one(float x, float* p) { *p = x; }

inline void store_one(float x, bf16* p) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  *p = static_cast<bf16>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float max(vfloat v) {
  float best = v[0];
  for (int i = 1; i < kLanes; ++i) best = v[i] > best ? v[i] : best;
  return best;
}

// exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7), 2^n built in the exponent bits. Below -87 the result flushes to ~0.
inline vfloat exp_nonpositive(vfloat x) {
  x = select(x < -87.f, splat(-87.f), x);
  const float kRound = 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vfloat n = (x * 1.44269504f + kRound) - kRound;
  const vfloat r = x - n * 0.693145752f - n * 1.42860677e-6f;
  vfloat p = splat(1.3888889e-3f);
  p = p * r + 8.3333338e-3f;
  p = p * r + 4.1666668e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vint exponent = (to_int(n) + 127) << 23;
  return p * bitcast<vfloat>(exponent);
}

struct Shape {
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  // The caller asked for the K/V ahead (decode_step.cpp, during the layer before): every row
  // then scores in tiles, as a prefill chunk's later rows do.
  bool warm = false;
};

// Per-thread scratch: scores [G, L] of one KV head's query heads, L rounded up to whole vectors.
struct Scratch {
  std::vector<float> scores;
};

// Softmax of each of `rows` score rows, in place; the padding past seq_len gets weight 0.
void softmax_rows(float* scores, int rows, int seq_len, int padded_len) {
  for (int h = 0; h < rows; ++h) {
    float* row_scores = scores + static_cast<int64_t>(h) * padded_len;
    for (int t = seq_len; t < padded_len; ++t) row_scores[t] = -1e30f;
    vfloat best = splat(-1e30f);
    for (int t = 0; t < padded_len; t += kLanes) {
      const vfloat v = load(row_scores + t);
      best = select(v > best, v, best);
    }
    const float max_score = max(best);
    vfloat total = splat(0.f);
    for (int t = 0; t < padded_len; t += kLanes) {
      const vfloat e = exp_nonpositive(load(row_scores + t) - max_score);
      store(e, row_scores + t);
      total += e;
    }
    const float inv_total = 1.f / sum(total);
    for (int t = 0; t < padded_len; t += kLanes) {
      store(load(row_scores + t) * inv_total, row_scores + t);
    }
  }
}

// Asks for the rows of KV heads first, first + step, ... of one block before they are read
// (attend() asks two to four blocks ahead). Blocks lie anywhere in the pool and a head's rows are
// strided by the other heads' (384 bytes apart for 3 fp16 heads of 64), so each block is a
// short new stream the hardware prefetcher barely starts on: without this, a long context's
// decode row, whose K/V come from memory at every step, waits on latency rather than
// bandwidth. A task asks, in its first pass over a sequence, for the rows of every head it
// will compute there (step 1 from head 0: the whole block, one contiguous stream); its later
// heads then find their rows in cache.
template <typename T>
inline void prefetch_rows(const T* cache, int32_t block, int first, int step, const Shape& s,
                          int head_dim) {
  const int64_t row_bytes = static_cast<int64_t>(head_dim) * sizeof(T);
  const int64_t slot_bytes = s.num_kv_heads * row_bytes;
  const char* slot = reinterpret_cast<const char*>(cache) + block * slot_bytes * s.block_size;
  if (first == 0 && step == 1) {
    for (int64_t line = 0; line < slot_bytes * s.block_size; line += 64)
      __builtin_prefetch(slot + line, 0, 3);
    return;
  }
  for (int t = 0; t < s.block_size; ++t, slot += slot_bytes)
    for (int kv = first; kv < s.num_kv_heads; kv += step)
      for (int64_t line = 0; line < row_bytes; line += 64)
        __builtin_prefetch(slot + kv * row_bytes + line, 0, 3);
}

#if defined(__AVX512F__)
// The scores of 16 tokens at once. Each token's 16 lane-wise products are summed as sum()
// sums them (lanes i + i + 8, then i + i + 4, then (0 + 2) + (1 + 3)), but for 16 tokens
// together: each level adds two vectors that hold the halves of two tokens' partial sums, so
// 15 vector additions and 30 in-register shuffles do the work of 16 horizontal sums (about 7
// operations each). The bits are sum()'s, so a token's score does not depend on the path.
// Level 1 (A, B: one token each): [A 0-7 + A 8-15 | B 0-7 + B 8-15].
inline __m512 pair_eighths(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
// Level 2 (two level-1 vectors, tokens a b and c d): per 128-bit lane, one token's
// lanes 0-3 + 4-7.
inline __m512 pair_quarters(__m512 ab, __m512 cd) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
}
// Level 3: in each 128-bit lane, (0 + 2, 1 + 3) of the first token, then of the second.
inline __m512 pair_twos(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
}
// Level 4: (0 + 2) + (1 + 3): one score per lane, lane 4k + j holding token k + 4j.
inline __m512 pair_ones(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

// Whether a tile's partial sums (three levels of kGroup vectors) and two K rows fit the 32
// registers; larger head groups and dims sum token by token.
template <int kVecs, int kGroup>
constexpr bool kScoreTiles = 3 * kGroup + 2 * kVecs <= 24;

// scores[g * padded_len + i] = q[g] . k_i for the tile's 16 tokens (i < valid read their rows,
// the rest repeat row valid - 1), for each of the kGroup query heads.
template <typename C, int kVecs, int kGroup>
inline void score_tile(const vfloat (&q)[kGroup][kVecs], const C* k, int64_t slot_stride,
                       int valid, float* scores, int padded_len) {
  auto dot = [&](int g, const vfloat (&row)[kVecs]) {
    vfloat d = q[g][0] * row[0];
    for (int i = 1; i < kVecs; ++i) d += q[g][i] * row[i];
    return reinterpret_cast<__m512>(d);
  };
  auto row_at = [&](int i, vfloat (&row)[kVecs]) {
    const C* r = k + (i < valid ? i : valid - 1) * slot_stride;
    for (int v = 0; v < kVecs; ++v) row[v] = load(r + v * kLanes);
  };
  // Per head, the partial sums of the tile's first 4, 8 and 16 tokens as they are built.
  __m512 four[kGroup], eight[kGroup], sixteen[kGroup];
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
    for (int p = 0; p < 2; ++p) {
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e) {
        const int i = 8 * h + 4 * p + 2 * e;
        vfloat a[kVecs], b[kVecs];
        row_at(i, a);
        row_at(i + 1, b);
        for (int g = 0; g < kGroup; ++g) {
          const __m512 pair = pair_eighths(dot(g, a), dot(g, b));
          four[g] = e == 0 ? pair : pair_quarters(four[g], pair);
        }
      }
      for (int g = 0; g < kGroup; ++g)
        eight[g] = p == 0 ? four[g] : pair_twos(eight[g], four[g]);
    }
    for (int g = 0; g < kGroup; ++g)
      sixteen[g] = h == 0 ? eight[g] : pair_ones(sixteen[g], eight[g]);
  }
  // Lane 4k + j holds token k + 4j: back to token order.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int g = 0; g < kGroup; ++g)
    _mm512_storeu_ps(scores + g * padded_len, _mm512_permutexvar_ps(order, sixteen[g]));
}
#endif

// One task: one sequence (`query`/`out` are its [H, D] rows), KV heads [kv_begin, kv_end).
// Its first head's passes ask for the rows of heads kv_begin, kv_begin + ask_step, ... (the
// heads this thread computes in this sequence); ask_step 0: nothing asked.
// Each context slot holds the K (V) rows of all KV heads side by side, so a block is read front
// to back, and each K/V row is converted once for the kGroup query heads that share it; with
// D and G known at compile time the queries and accumulators stay in registers.
// T: the query's and output's type; C: the KV cache's.
template <typename T, typename C, int kVecs, int kGroup>  // kVecs = D / 16, kGroup = H / Hkv
void attend(const T* query, const C* k_cache, const C* v_cache, const int32_t* table, int seq_len,
            int kv_begin, int kv_end, int ask_step, const Shape& s, float scale, bool cold,
            Scratch& scratch, T* out) {
  constexpr int kHeadDim = kVecs * kLanes;
  const int padded_len = (seq_len + kLanes - 1) / kLanes * kLanes;
  const int64_t slot_stride = static_cast<int64_t>(s.num_kv_heads) * kHeadDim;
  const int64_t block_stride = slot_stride * s.block_size;
  float* scores = scratch.scores.data();
  // Blocks asked for ahead of the one being read: 4 for whole blocks (every head's rows; 5%
  // faster than 2 at batch 8 on an AMD Zen 4), 2 for a head's rows.
  const int lead = ask_step == 1 ? 4 : 2;

  for (int kv = kv_begin; kv < kv_end; ++kv) {
    const int64_t first_row = static_cast<int64_t>(kv) * kGroup * kHeadDim;
    const bool ask = cold && ask_step > 0 && kv == kv_begin;
    // The first `lead` blocks of K, and of V (read after all of K).
    for (int b = 0; ask && b < lead && b * s.block_size < seq_len; ++b) {
      prefetch_rows(k_cache, table[b], kv, ask_step, s, kHeadDim);
      prefetch_rows(v_cache, table[b], kv, ask_step, s, kHeadDim);
    }
    // Pass 1: scores [G, L] = scale * q . k.
    vfloat q[kGroup][kVecs];
    for (int g = 0; g < kGroup; ++g) {
      for (int i = 0; i < kVecs; ++i) {
        q[g][i] = load(query + first_row + g * kHeadDim + i * kLanes) * scale;
      }
    }
    for (int start = 0; start < seq_len; start += s.block_size) {
      const C* k = k_cache + table[start / s.block_size] * block_stride + kv * kHeadDim;
      const int end = start + s.block_size < seq_len ? start + s.block_size : seq_len;
      const int ahead = end + (lead - 1) * s.block_size;
      if (ask && ahead < seq_len)
        prefetch_rows(k_cache, table[ahead / s.block_size], kv, ask_step, s, kHeadDim);
#if defined(__AVX512F__)
      // Whole tiles of 16 tokens; a last partial one repeats its last row, whose extra scores
      // softmax_rows() overwrites with the padding. Only where the rows are in cache (a prefill
      // chunk's rows after its first, or every row when the caller asked for them ahead,
      // Shape::warm): from memory the token-by-token loop is faster
      // (ab_attention.py at batch 1 and 8, 300 positions, on an AMD EPYC Zen 4: each token's
      // work stands alone, so more of the next rows' loads are in flight at once). Shapes past
      // the register budget never instantiate score_tile.
      if constexpr (kScoreTiles<kVecs, kGroup>) {
        if ((!cold || s.warm) && s.block_size % kLanes == 0) {
          for (int t = start; t < end; t += kLanes, k += kLanes * slot_stride) {
            const int valid = end - t < kLanes ? end - t : kLanes;
            score_tile<C, kVecs, kGroup>(q, k, slot_stride, valid, scores + t, padded_len);
          }
          continue;
        }
      }
#endif
      for (int t = start; t < end; ++t, k += slot_stride) {
        vfloat row[kVecs];
        for (int i = 0; i < kVecs; ++i) row[i] = load(k + i * kLanes);
        for (int g = 0; g < kGroup; ++g) {
          vfloat dot = q[g][0] * row[0];
          for (int i = 1; i < kVecs; ++i) dot += q[g][i] * row[i];
          scores[g * padded_len + t] = sum(dot);
        }
      }
    }
    softmax_rows(scores, kGroup, seq_len, padded_len);
    // Pass 2: out [G, D] = sum_t p[g, t] * v[t].
    vfloat acc[kGroup][kVecs] = {};
    for (int start = 0; start < seq_len; start += s.block_size) {
      const C* v = v_cache + table[start / s.block_size] * block_stride + kv * kHeadDim;
      const int end = start + s.block_size < seq_len ? start + s.block_size : seq_len;
      const int ahead = end + (lead - 1) * s.block_size;
      if (ask && ahead < seq_len)
        prefetch_rows(v_cache, table[ahead / s.block_size], kv, ask_step, s, kHeadDim);
      for (int t = start; t < end; ++t, v += slot_stride) {
        vfloat row[kVecs];
        for (int i = 0; i < kVecs; ++i) row[i] = load(v + i * kLanes);
        for (int g = 0; g < kGroup; ++g) {
          const float p = scores[g * padded_len + t];
          for (int i = 0; i < kVecs; ++i) acc[g][i] += p * row[i];
        }
      }
    }
    for (int g = 0; g < kGroup; ++g) {
      for (int i = 0; i < kVecs; ++i) store(acc[g][i], out + first_row + g * kHeadDim + i * kLanes);
    }
  }
}

template <typename T, typename C, int kVecs, int kGroup>
void paged_decode(const T* query, const C* k_cache, const C* v_cache, const int32_t* block_tables,
                  const int32_t* seq_lens, T* out, const Shape& s, float scale, int num_threads) {
  int max_len = 0;
  for (int b = 0; b < s.num_seqs; ++b) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
  // Whole sequences per task when there are enough to keep every thread busy; otherwise one
  // KV head per task, dealt round robin, so a thread knows which heads of a sequence are its.
  const bool whole = s.num_seqs >= 2 * num_threads;
  const int heads_per_task = whole ? s.num_kv_heads : 1;
  const int tasks_per_seq = s.num_kv_heads / heads_per_task;
  const int num_tasks = s.num_seqs * tasks_per_seq;
  const size_t scratch_size = static_cast<size_t>(kGroup) * ((max_len + kLanes - 1) / kLanes * kLanes);
#pragma omp parallel num_threads(num_threads)
  {
    thread_local Scratch scratch;  // per pool thread, grown to the largest call so far
    if (scratch.scores.size() < scratch_size) scratch.scores.resize(scratch_size);
    const int threads = omp_get_num_threads();
    auto run = [&](int task) {
      const int b = task / tasks_per_seq;
      const int kv_begin = (task % tasks_per_seq) * heads_per_task;
      const int64_t seq_offset = static_cast<int64_t>(b) * s.num_heads * s.head_dim;
      const int32_t* table = block_tables + b * s.max_blocks;
      // The rows of a prefill chunk after its first see the context the one before read:
      // in cache, no prefetch needed.
      const bool cold = !continues_chunk(block_tables, seq_lens, b, s.max_blocks);
      // A whole sequence asks for whole blocks; one head, for its thread's heads of the
      // sequence when it is the first of them (round robin: heads kv_begin + threads, ...).
      const int ask_step = whole ? 1 : (kv_begin < threads ? threads : 0);
      attend<T, C, kVecs, kGroup>(query + seq_offset, k_cache, v_cache, table, seq_lens[b],
                                  kv_begin, kv_begin + heads_per_task, ask_step, s, scale, cold,
                                  scratch, out + seq_offset);
    };
    if (whole) {
#pragma omp for schedule(dynamic, 1)
      for (int task = 0; task < num_tasks; ++task) run(task);
    } else {
#pragma omp for schedule(static, 1)
      for (int task = 0; task < num_tasks; ++task) run(task);
    }
  }
}

#define KVSHARE_DECODE(VECS, GROUP)                                                        \
  paged_decode<T, C, VECS, GROUP>(query, k_cache, v_cache, block_tables, seq_lens, out, s, scale, \
                               num_threads);                                                \
  return 0

// Instantiates the kernel per (group size, head dim); 2 = a shape this build does not cover.
template <typename T, typename C, int kVecs>
int dispatch_group(const T* query, const C* k_cache, const C* v_cache,
                   const int32_t* block_tables, const int32_t* seq_lens, T* out, const Shape& s,
                   float scale, int num_threads) {
  switch (s.num_heads / s.num_kv_heads) {
    case 1: KVSHARE_DECODE(kVecs, 1);
    case 2: KVSHARE_DECODE(kVecs, 2);
    case 3: KVSHARE_DECODE(kVecs, 3);
    case 4: KVSHARE_DECODE(kVecs, 4);
    case 5: KVSHARE_DECODE(kVecs, 5);
    case 6: KVSHARE_DECODE(kVecs, 6);
    case 7: KVSHARE_DECODE(kVecs, 7);
    case 8: KVSHARE_DECODE(kVecs, 8);
    default: return 2;
  }
}

template <typename T, typename C>
int dispatch_head_dim(const T* query, const C* k_cache, const C* v_cache,
                      const int32_t* block_tables, const int32_t* seq_lens, T* out,
                      const Shape& s, float scale, int num_threads) {
  switch (s.head_dim) {
    case 64:
      return dispatch_group<T, C, 4>(query, k_cache, v_cache, block_tables, seq_lens, out, s, scale,
                                  num_threads);
    case 128:
      return dispatch_group<T, C, 8>(query, k_cache, v_cache, block_tables, seq_lens, out, s, scale,
                                  num_threads);
    default:
      return 2;
  }
}

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

// out = weight * to_T(x * rsqrt(mean(x^2) + eps)), statistics in fp32 (LlamaRMSNorm).
template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int dim, float eps,
              int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * dim;
    vfloat squares = splat(0.f);
    for (int i = 0; i < dim; i += kLanes) {
      const vfloat v = load(row + i);
      squares += v * v;
    }
    const float inv_rms = 1.f / std::sqrt(sum(squares) / dim + eps);
    for (int i = 0; i < dim; i += kLanes) {
      const vfloat normed = round_as<T>(load(row + i) * inv_rms);
      store(load(weight + i) * normed, out + r * dim + i);
    }
  }
}

// gate_up [rows, 2I] -> out [rows, I] = to_T(silu(gate)) * up.
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
    for (int i = 0; i < inter; i += kLanes) {
      const vfloat g = load(gate + i);
      const vint negative = g < 0.f;
      const vfloat e = exp_nonpositive(select(negative, g, -g));  // e^-|g|, never overflows
      const vfloat sigmoid = select(negative, e / (1.f + e), 1.f / (1.f + e));
      store(round_as<T>(g * sigmoid) * load(up + i), out + r * inter + i);
    }
  }
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

// Calls run(T{}) with T the storage type of a dtype code (kFloat32, kBfloat16) and returns its
// status; 1 for an unknown code.
template <typename Run>
int with_dtype(int dtype, Run&& run) {
  if (dtype == kFloat32) return run(float{});
  if (dtype == kBfloat16) return run(bf16{});
  return 1;
}

// Calls run(T{}, C{}) with T the activations' type and C the KV cache's: the cache as the
// activations (cache_dtype == dtype), or a float32 model over a bfloat16 or float16 cache. 1 for
// any other pair.
template <typename Run>
int with_cache_dtype(int dtype, int cache_dtype, Run&& run) {
  if (dtype == cache_dtype) return with_dtype(dtype, [&](auto tag) { return run(tag, tag); });
  if (dtype == kFloat32 && cache_dtype == kBfloat16) return run(float{}, bf16{});
  if (dtype == kFloat32 && cache_dtype == kFloat16) return run(float{}, f16{});
  return 1;
}

}  // namespace
}  // namespace kvshare

// The entry points (kvshare_native.h says what each takes and returns).
using namespace kvshare;

extern "C" {

int kvshare_supports_shape(int head_dim, int group) {
  return (head_dim == 64 || head_dim == 128) && group >= 1 && group <= 8;
}

int kvshare_paged_decode_warm(int dtype, int cache_dtype, const void* query, const void* k_cache,
                              const void* v_cache, const int32_t* block_tables,
                              const int32_t* seq_lens, void* out, int num_seqs, int num_heads,
                              int num_kv_heads, int head_dim, int block_size, int max_blocks,
                              float scale, int num_threads, int warm) {
  const Shape s{num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, warm != 0};
  return with_cache_dtype(dtype, cache_dtype, [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using C = decltype(cache_tag);
    return dispatch_head_dim(static_cast<const T*>(query), static_cast<const C*>(k_cache),
                             static_cast<const C*>(v_cache), block_tables, seq_lens,
                             static_cast<T*>(out), s, scale, num_threads);
  });
}

int kvshare_paged_decode(int dtype, int cache_dtype, const void* query, const void* k_cache,
                         const void* v_cache, const int32_t* block_tables,
                         const int32_t* seq_lens, void* out, int num_seqs, int num_heads,
                         int num_kv_heads, int head_dim, int block_size, int max_blocks,
                         float scale, int num_threads) {
  return kvshare_paged_decode_warm(dtype, cache_dtype, query, k_cache, v_cache, block_tables,
                                   seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim,
                                   block_size, max_blocks, scale, num_threads, 0);
}

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
