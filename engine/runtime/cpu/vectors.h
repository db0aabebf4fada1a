// The vectors every kvshare kernel computes with: GCC vector extensions of 16 floats whatever
// the target, so one source serves every ISA level (one AVX-512 register, two AVX2 or four SSE
// registers). Included by kernels.cpp and block_kernels.cpp, inside their anonymous namespaces,
// after <immintrin.h> where __AVX512F__ or __F16C__ is defined (the fp16 conversions use it).

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

// One fp16 value (F16C's vcvtph2ps from x86-64-v3 on, libgcc's conversion below it).
inline float half(const uint8_t* p) {
  _Float16 h;
  std::memcpy(&h, p, sizeof(h));
  return static_cast<float>(h);
}

// 16 fp16 values as floats: one AVX-512 conversion, two F16C ones, or one at a time. (GCC's
// own conversion of a _Float16 vector goes lane by lane without AVX512-FP16.)
inline vfloat halves(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)  // x86-64-v3 (AVX2): two 8-lane conversions
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  vfloat v;
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
#else
  vfloat v;
  for (int i = 0; i < kLanes; ++i) v[i] = half(p + 2 * i);
  return v;
#endif
}

// 16 floats stored as fp16, rounded to nearest even (as torch's .to(float16)).
inline void store_halves(vfloat v, uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm512_cvtps_ph(reinterpret_cast<__m512>(v), _MM_FROUND_TO_NEAREST_INT);
  std::memcpy(p, &h, sizeof(h));
#elif defined(__F16C__)
  __m256 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const __m128i h_lo = _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT);
  const __m128i h_hi = _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT);
  std::memcpy(p, &h_lo, sizeof(h_lo));
  std::memcpy(p + sizeof(h_lo), &h_hi, sizeof(h_hi));
#else
  for (int i = 0; i < kLanes; ++i) {
    const _Float16 h = static_cast<_Float16>(v[i]);
    std::memcpy(p + 2 * i, &h, sizeof(h));
  }
#endif
}

// Horizontal sum as a tree of halves (a loop of scalar adds would be one long dependency chain).
inline float sum(vfloat v) {
  const vfloat8 v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vfloat4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) +
                     __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}
