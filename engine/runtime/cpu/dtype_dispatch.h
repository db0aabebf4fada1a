// What the kernels on activations and KV caches share about their storage types: one float
// stored as a storage type, and the dispatch from a dtype code (kvshare_native.h) to the type
// a kernel template runs on.

#pragma once

#include <cstdint>
#include <cstring>

#include "kvshare_native.h"
#include "vectors.h"

namespace kvshare {

inline void store_one(float x, float* p) { *p = x; }

inline void store_one(float x, bf16* p) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  *p = static_cast<bf16>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
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

}  // namespace kvshare
