// The vectors every kvshare kernel computes with: GCC vector extensions of 16 floats whatever
// the target, so one source serves every ISA level (one AVX-512 register, two AVX2 or four SSE
// registers). Included by kernels.cpp and block_kernels.cpp, inside their anonymous namespaces.

constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef int32_t vint __attribute__((vector_size(kLanes * 4)));
typedef float vfloat8 __attribute__((vector_size(32)));
typedef float vfloat4 __attribute__((vector_size(16)));

inline vfloat splat(float x) { return vfloat{} + x; }

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Horizontal sum as a tree of halves (a loop of scalar adds would be one long dependency chain).
inline float sum(vfloat v) {
  const vfloat8 v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vfloat4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) +
                     __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}
