// Paged decode attention (one query token per sequence, K/V read in place from the paged pool
// through each sequence's block table, no gather into a dense copy).
//
// Built on first use by engine/runtime/cpu/native.py (g++ -O3 -fopenmp, -march=native or a forced
// lower level: x86-64-v3 for AVX2, x86-64-v2 for SSE4.2) and called through ctypes with raw
// pointers to contiguous tensors; kvshare_native.h declares the entry points.
//
// Decode attention:
// Shapes (the attention interface's axes):
//   query [B, H, D], out [B, H, D]
//   k_cache, v_cache [num_blocks, block_size, Hkv, D]
//   block_tables [B, max_blocks] int32, seq_lens [B] int32
// A row sees positions [first, seq_len): first 0, or seq_len - window for a sliding-window
// layer whose window is shorter than the context.
// A task is one sequence (or, with few sequences, one of its KV heads). The G = H / Hkv query
// heads that share a KV head are done together, so each K/V row is read once for all (GQA).
// Math is fp32 whatever the storage type, in two passes: scores and their softmax, then the
// weighted sum of V. Vectors have 16 floats whatever the target (vectors.h), so one source
// serves every level: one AVX-512 register, or two AVX2 (x86-64-v3) or four SSE (x86-64-v2)
// registers. D is 64, 128 or 256.

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

bool continues_chunk(const int32_t* block_tables, const int32_t* seq_lens, int64_t row,
                     int64_t max_blocks) {
  return row > 0 && seq_lens[row] == seq_lens[row - 1] + 1 &&
         block_tables[row * max_blocks] == block_tables[(row - 1) * max_blocks];
}

namespace {

inline float max(vfloat v) {
  float best = v[0];
  for (int i = 1; i < kLanes; ++i) best = v[i] > best ? v[i] : best;
  return best;
}

struct Shape {
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int window;  // a sliding window's width in positions; 0: none
  // The caller asked for the K/V ahead (decode_step.cpp, during the layer before): every row
  // then scores in tiles, as a prefill chunk's later rows do.
  bool warm = false;
};

// Per-thread scratch: scores [G, L] of one KV head's query heads, L rounded up to whole vectors.
struct Scratch {
  std::vector<float> scores;
};

// The first position a row of context length seq_len sees.
inline int first_visible(int seq_len, int window) {
  return window > 0 && seq_len > window ? seq_len - window : 0;
}

// Softmax of each of `rows` score rows over slots [begin, padded_len), in place; begin is a
// multiple of kLanes. The slots before `first` and the padding past seq_len are masked.
void softmax_rows(float* scores, int rows, int begin, int first, int seq_len, int padded_len) {
  for (int h = 0; h < rows; ++h) {
    float* row_scores = scores + static_cast<int64_t>(h) * padded_len;
    for (int t = begin; t < first; ++t) row_scores[t] = -1e30f;
    for (int t = seq_len; t < padded_len; ++t) row_scores[t] = -1e30f;
    vfloat best = splat(-1e30f);
    for (int t = begin; t < padded_len; t += kLanes) {
      const vfloat v = load(row_scores + t);
      best = select(v > best, v, best);
    }
    const float max_score = max(best);
    vfloat total = splat(0.f);
    for (int t = begin; t < padded_len; t += kLanes) {
      const vfloat x = load(row_scores + t) - max_score;
      // Weight 0 below e^-87 (where exp_nonpositive stops): a masked slot's is exactly 0, adds
      // nothing to the total, and a window is full attention with its earlier keys masked.
      const vfloat e = select(x < -87.f, splat(0.f), exp_nonpositive(x));
      store(e, row_scores + t);
      total += e;
    }
    const float inv_total = 1.f / sum(total);
    for (int t = begin; t < padded_len; t += kLanes) {
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
// registers. Past it, at D 128 and 256, score_tile_wide() takes the rows a vector at a time
// (D 256 group 4, fp16 cache, 512-token chunk over 1,500 tokens: 2.5x faster with pass 2's
// slices, on an AMD EPYC Zen 4); at D 64 (group 8) it was slower over short contexts, so
// groups 6 to 8 there sum token by token.
template <int kVecs, int kGroup>
constexpr bool kScoreTiles = 3 * kGroup + 2 * kVecs <= 24;
template <int kVecs, int kGroup>
constexpr bool kWideTiles = !kScoreTiles<kVecs, kGroup> && kVecs >= 8;

// The tree of one tile of 16 tokens for kHeads heads: pair_dots(i, fold) computes the dot
// products of tokens i and i + 1 for each head h and calls fold(h, pair_eighths(dot i,
// dot i + 1)); scores[h * padded_len + i] gets each token's sum.
template <int kHeads, typename PairDots>
inline void tile_tree(PairDots pair_dots, float* scores, int padded_len) {
  // Per head, the partial sums of the tile's first 4, 8 and 16 tokens as they are built.
  __m512 four[kHeads], eight[kHeads], sixteen[kHeads];
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
    for (int p = 0; p < 2; ++p) {
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e) {
        pair_dots(8 * h + 4 * p + 2 * e, [&](int g, __m512 pair) {
          four[g] = e == 0 ? pair : pair_quarters(four[g], pair);
        });
      }
      for (int g = 0; g < kHeads; ++g)
        eight[g] = p == 0 ? four[g] : pair_twos(eight[g], four[g]);
    }
    for (int g = 0; g < kHeads; ++g)
      sixteen[g] = h == 0 ? eight[g] : pair_ones(sixteen[g], eight[g]);
  }
  // Lane 4k + j holds token k + 4j: back to token order.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int g = 0; g < kHeads; ++g)
    _mm512_storeu_ps(scores + g * padded_len, _mm512_permutexvar_ps(order, sixteen[g]));
}

// The rows of a tile's token i: i < valid read their own, the rest repeat row valid - 1.
template <typename C>
inline const C* tile_row(const C* k, int64_t slot_stride, int valid, int i) {
  return k + (i < valid ? i : valid - 1) * slot_stride;
}

// scores[g * padded_len + i] = q[g] . k_i for the tile's 16 tokens, for each of the kGroup
// query heads; the queries and two K rows in registers.
template <typename C, int kVecs, int kGroup>
inline void score_tile(const vfloat (&q)[kGroup][kVecs], const C* k, int64_t slot_stride,
                       int valid, float* scores, int padded_len) {
  auto dot = [&](int g, const vfloat (&row)[kVecs]) {
    vfloat d = q[g][0] * row[0];
    for (int i = 1; i < kVecs; ++i) d += q[g][i] * row[i];
    return reinterpret_cast<__m512>(d);
  };
  auto row_at = [&](int i, vfloat (&row)[kVecs]) {
    const C* r = tile_row(k, slot_stride, valid, i);
    for (int v = 0; v < kVecs; ++v) row[v] = load(r + v * kLanes);
  };
  auto pair_dots = [&](int i, auto fold) {
    vfloat a[kVecs], b[kVecs];
    row_at(i, a);
    row_at(i + 1, b);
    for (int g = 0; g < kGroup; ++g) fold(g, pair_eighths(dot(g, a), dot(g, b)));
  };
  tile_tree<kGroup>(pair_dots, scores, padded_len);
}

// score_tile() past the register budget, for heads g0 to g0 + kHeads - 1 of q: a pair of
// tokens' dot products are built a vector at a time, each head's query vector read from L1,
// so eight chains run side by side (kHeads 4) in 26 registers. Each chain is the token-by-token
// loop's, q[g][0] k[0] then + q[g][v] k[v] in order, unrolled as that loop is: GCC then fuses
// the products into the same FMAs (rolled, its first FMA pairs them otherwise: other bits).
template <typename C, int kVecs, int kGroup, int kHeads>
inline void score_tile_heads(const vfloat (&q)[kGroup][kVecs], int g0, const C* k,
                             int64_t slot_stride, int valid, float* scores, int padded_len) {
  auto pair_dots = [&](int i, auto fold) {
    const C* a = tile_row(k, slot_stride, valid, i);
    const C* b = tile_row(k, slot_stride, valid, i + 1);
    vfloat da[kHeads], db[kHeads];
    const vfloat a0 = load(a), b0 = load(b);
    for (int g = 0; g < kHeads; ++g) {
      da[g] = q[g0 + g][0] * a0;
      db[g] = q[g0 + g][0] * b0;
    }
#pragma GCC unroll 16
    for (int v = 1; v < kVecs; ++v) {
      const vfloat av = load(a + v * kLanes), bv = load(b + v * kLanes);
      for (int g = 0; g < kHeads; ++g) {
        da[g] += q[g0 + g][v] * av;
        db[g] += q[g0 + g][v] * bv;
      }
    }
    for (int g = 0; g < kHeads; ++g)
      fold(g, pair_eighths(reinterpret_cast<__m512>(da[g]), reinterpret_cast<__m512>(db[g])));
  };
  tile_tree<kHeads>(pair_dots, scores + g0 * padded_len, padded_len);
}

// The whole group in passes of 4 heads (a head's scores depend on its own query only).
template <typename C, int kVecs, int kGroup>
inline void score_tile_wide(const vfloat (&q)[kGroup][kVecs], const C* k, int64_t slot_stride,
                            int valid, float* scores, int padded_len) {
  constexpr int kHeads = kGroup < 4 ? kGroup : 4;
  for (int g0 = 0; g0 + kHeads <= kGroup; g0 += kHeads)
    score_tile_heads<C, kVecs, kGroup, kHeads>(q, g0, k, slot_stride, valid, scores, padded_len);
  if constexpr (kGroup % kHeads != 0) {
    score_tile_heads<C, kVecs, kGroup, kGroup % kHeads>(q, kGroup - kGroup % kHeads, k,
                                                        slot_stride, valid, scores, padded_len);
  }
}
#endif

// Pass 2's vectors of D per sweep over a block's rows: all of them, but at D 256 with a group
// of 2 or more (an accumulator of 32 or more vectors, kept on the stack) a slice of 16 / G,
// whose accumulators stay in registers over the block while its rows stay in L1. Each output
// lane still adds p[g, t] * v_t in the order of t, so the bits do not depend on the slice.
template <int kVecs, int kGroup>
constexpr int kValueSlice = kVecs == 16 && kGroup > 1 ? 16 / kGroup : kVecs;

// part[g][i] += p[g, t] * v_t[i] for t in [start, end), v at row start's first vector of the
// slice.
template <typename C, int kGroup, int kSlice>
inline void accumulate_values(vfloat (&part)[kGroup][kSlice], const C* v, int64_t slot_stride,
                              const float* scores, int padded_len, int start, int end) {
  for (int t = start; t < end; ++t, v += slot_stride) {
    vfloat row[kSlice];
    for (int i = 0; i < kSlice; ++i) row[i] = load(v + i * kLanes);
    for (int g = 0; g < kGroup; ++g) {
      const float p = scores[g * padded_len + t];
      for (int i = 0; i < kSlice; ++i) part[g][i] += p * row[i];
    }
  }
}

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
  // Scores [G, L] keep absolute positions: a window's are written from the block holding its
  // first position, and its softmax starts at the vector holding that position, so each score
  // keeps full attention's lane (and a windowed row is full attention's with the rest masked).
  const int first = first_visible(seq_len, s.window);
  const int first_block = first / s.block_size;
  const int softmax_begin = first / kLanes * kLanes;
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
    for (int b = first_block; ask && b < first_block + lead && b * s.block_size < seq_len; ++b) {
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
    for (int start = first_block * s.block_size; start < seq_len; start += s.block_size) {
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
      // work stands alone, so more of the next rows' loads are in flight at once).
      if constexpr (kScoreTiles<kVecs, kGroup> || kWideTiles<kVecs, kGroup>) {
        if ((!cold || s.warm) && s.block_size % kLanes == 0) {
          for (int t = start; t < end; t += kLanes, k += kLanes * slot_stride) {
            const int valid = end - t < kLanes ? end - t : kLanes;
            if constexpr (kScoreTiles<kVecs, kGroup>)
              score_tile<C, kVecs, kGroup>(q, k, slot_stride, valid, scores + t, padded_len);
            else
              score_tile_wide<C, kVecs, kGroup>(q, k, slot_stride, valid, scores + t, padded_len);
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
    softmax_rows(scores, kGroup, softmax_begin, first, seq_len, padded_len);
    // Pass 2: out [G, D] = sum_t p[g, t] * v[t], over the visible positions only.
    vfloat acc[kGroup][kVecs] = {};
    for (int start = first; start < seq_len;) {
      const int block = start / s.block_size;
      const C* v = v_cache + table[block] * block_stride + (start % s.block_size) * slot_stride +
                   kv * kHeadDim;
      const int end = (block + 1) * s.block_size < seq_len ? (block + 1) * s.block_size : seq_len;
      const int ahead = end + (lead - 1) * s.block_size;
      if (ask && ahead < seq_len)
        prefetch_rows(v_cache, table[ahead / s.block_size], kv, ask_step, s, kHeadDim);
      if constexpr (kValueSlice<kVecs, kGroup> == kVecs) {
        accumulate_values<C, kGroup, kVecs>(acc, v, slot_stride, scores, padded_len, start, end);
      } else {
        constexpr int kSlice = kValueSlice<kVecs, kGroup>;
        static_assert(kSlice > 0 && kVecs % kSlice == 0, "slices must tile the head dim");
        for (int i0 = 0; i0 < kVecs; i0 += kSlice) {
          vfloat part[kGroup][kSlice];
          for (int g = 0; g < kGroup; ++g)
            for (int i = 0; i < kSlice; ++i) part[g][i] = acc[g][i0 + i];
          accumulate_values<C, kGroup, kSlice>(part, v + i0 * kLanes, slot_stride, scores,
                                               padded_len, start, end);
          for (int g = 0; g < kGroup; ++g)
            for (int i = 0; i < kSlice; ++i) acc[g][i0 + i] = part[g][i];
        }
      }
      start = end;
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

// The (head dim, group) shapes the kernel is instantiated for: groups 1 to 8 at D 64 and 128;
// at D 256 the powers of two only (every Gemma's: 1, 2, 4, 8), as the other four would add a
// fifth more to the library's build time for no model known to use them.
constexpr bool covers_shape(int head_dim, int group) {
  const bool power_of_two = (group & (group - 1)) == 0;
  return (head_dim == 64 || head_dim == 128 || (head_dim == 256 && power_of_two)) && group >= 1 &&
         group <= 8;
}

#define KVSHARE_DECODE(VECS, GROUP)                                                          \
  if constexpr (covers_shape(VECS * kLanes, GROUP)) {                                        \
    paged_decode<T, C, VECS, GROUP>(query, k_cache, v_cache, block_tables, seq_lens, out, s, \
                                    scale, num_threads);                                     \
    return 0;                                                                                \
  }                                                                                          \
  return 2

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
    case 256:
      return dispatch_group<T, C, 16>(query, k_cache, v_cache, block_tables, seq_lens, out, s,
                                      scale, num_threads);
    default:
      return 2;
  }
}

}  // namespace
}  // namespace kvshare

// The entry points (kvshare_native.h says what each takes and returns).
using namespace kvshare;

extern "C" {

int kvshare_supports_shape(int head_dim, int group) { return covers_shape(head_dim, group); }

int kvshare_paged_decode_warm(int dtype, int cache_dtype, const void* query, const void* k_cache,
                              const void* v_cache, const int32_t* block_tables,
                              const int32_t* seq_lens, void* out, int num_seqs, int num_heads,
                              int num_kv_heads, int head_dim, int block_size, int max_blocks,
                              float scale, int num_threads, int warm, int window) {
  if (window < 0) return 2;
  const Shape s{num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, window,
                warm != 0};
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
                         float scale, int num_threads, int window) {
  return kvshare_paged_decode_warm(dtype, cache_dtype, query, k_cache, v_cache, block_tables,
                                   seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim,
                                   block_size, max_blocks, scale, num_threads, 0, window);
}

}  // extern "C"
