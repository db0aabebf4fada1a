// The vectors every kvshare kernel computes with: 16 lanes whatever the target, so one source
// serves every ISA level. With AVX-512 a vector is one GCC vector extension of 64 bytes (one
// register). Below it, a vector is a struct of parts of the widest registers the level has
// (two of 8 lanes with AVX2, four of 4 with SSE), each part a GCC vector of that width: GCC 12
// gives a 64-byte vector extension no machine mode there and keeps it in memory, lane stores
// and partial reloads that stall on store forwarding (the block kernels ran 20x slower on an
// AVX2-only Zen 3 than with parts), while parts stay in registers.
//
// Kernels use only what both forms offer: arithmetic and bitwise operators (vector with
// vector or scalar), comparisons giving a vint mask, select(), to_float() / to_int() /
// bitcast<>(), lane reads v[i], load() / store() of each storage type, splat() and sum().
// Included by every kernel source; kernels live in namespace kvshare with these.

#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "kvshare_native.h"

namespace kvshare {

typedef float vfloat8 __attribute__((vector_size(32)));
typedef float vfloat4 __attribute__((vector_size(16)));

#if defined(__AVX512F__)

typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef int32_t vint __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vuint __attribute__((vector_size(kLanes * 4)));

inline vfloat select(vint mask, vfloat a, vfloat b) { return mask ? a : b; }
inline vfloat to_float(vint v) { return __builtin_convertvector(v, vfloat); }
inline vint to_int(vfloat v) { return __builtin_convertvector(v, vint); }  // truncates
template <typename To, typename From>
inline To bitcast(From v) {
  return reinterpret_cast<To>(v);
}

#else

#if defined(__AVX2__)
constexpr int kPartBytes = 32;
#else
constexpr int kPartBytes = 16;
#endif

// 16 lanes of T as kParts GCC vectors of kPartBytes each, lanes in order.
template <typename T>
struct Lanes {
  static constexpr int kPartLanes = kPartBytes / static_cast<int>(sizeof(T));
  static constexpr int kParts = kLanes / kPartLanes;
  typedef T Part __attribute__((vector_size(kPartBytes)));
  Part p[kParts];
  T operator[](int i) const { return p[i / kPartLanes][i % kPartLanes]; }
};

typedef Lanes<float> vfloat;
typedef Lanes<int32_t> vint;
typedef Lanes<uint32_t> vuint;

// Part by part: the same operation as on one wide vector, lane for lane.
#define KVSHARE_LANES_OP(OP)                                                              \
  template <typename T>                                                                   \
  inline Lanes<T> operator OP(Lanes<T> a, Lanes<T> b) {                                   \
    for (int i = 0; i < Lanes<T>::kParts; ++i) a.p[i] = a.p[i] OP b.p[i];                 \
    return a;                                                                             \
  }                                                                                       \
  template <typename T, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>> \
  inline Lanes<T> operator OP(Lanes<T> a, S b) {                                          \
    for (int i = 0; i < Lanes<T>::kParts; ++i) a.p[i] = a.p[i] OP static_cast<T>(b);      \
    return a;                                                                             \
  }                                                                                       \
  template <typename T, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>> \
  inline Lanes<T> operator OP(S a, Lanes<T> b) {                                          \
    for (int i = 0; i < Lanes<T>::kParts; ++i) b.p[i] = static_cast<T>(a) OP b.p[i];      \
    return b;                                                                             \
  }                                                                                       \
  template <typename T, typename B>                                                       \
  inline Lanes<T>& operator OP##=(Lanes<T>& a, B b) {                                     \
    return a = a OP b;                                                                    \
  }
KVSHARE_LANES_OP(+)
KVSHARE_LANES_OP(-)
KVSHARE_LANES_OP(*)
KVSHARE_LANES_OP(/)
KVSHARE_LANES_OP(&)
KVSHARE_LANES_OP(|)
KVSHARE_LANES_OP(<<)
KVSHARE_LANES_OP(>>)
#undef KVSHARE_LANES_OP

template <typename T>
inline Lanes<T> operator-(Lanes<T> a) {
  for (int i = 0; i < Lanes<T>::kParts; ++i) a.p[i] = -a.p[i];
  return a;
}

// Comparisons of floats: an all-ones int32 lane where true, as GCC's vector comparison gives.
#define KVSHARE_LANES_CMP(OP)                                                          \
  inline vint operator OP(vfloat a, vfloat b) {                                        \
    vint mask;                                                                         \
    for (int i = 0; i < vfloat::kParts; ++i) mask.p[i] = a.p[i] OP b.p[i];             \
    return mask;                                                                       \
  }                                                                                    \
  inline vint operator OP(vfloat a, float b) {                                         \
    vint mask;                                                                         \
    for (int i = 0; i < vfloat::kParts; ++i) mask.p[i] = a.p[i] OP b;                  \
    return mask;                                                                       \
  }
KVSHARE_LANES_CMP(<)
KVSHARE_LANES_CMP(>)
#undef KVSHARE_LANES_CMP

inline vfloat select(vint mask, vfloat a, vfloat b) {
  for (int i = 0; i < vfloat::kParts; ++i) a.p[i] = mask.p[i] ? a.p[i] : b.p[i];
  return a;
}

inline vfloat to_float(vint v) {
  vfloat r;
  for (int i = 0; i < vint::kParts; ++i) r.p[i] = __builtin_convertvector(v.p[i], vfloat::Part);
  return r;
}

inline vint to_int(vfloat v) {  // truncates
  vint r;
  for (int i = 0; i < vfloat::kParts; ++i) r.p[i] = __builtin_convertvector(v.p[i], vint::Part);
  return r;
}

template <typename To, typename From>
inline To bitcast(From v) {
  static_assert(sizeof(To) == sizeof(From) && To::kParts == From::kParts);
  To r;
  for (int i = 0; i < From::kParts; ++i) r.p[i] = reinterpret_cast<typename To::Part>(v.p[i]);
  return r;
}

#endif

inline vfloat splat(float x) { return vfloat{} + x; }

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 16 bytes (uint8_t or int8_t) as int32 lanes, zero- or sign-extended.
template <typename Byte>
inline vint widen_int(const Byte* bytes) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i upper = _mm_srli_si128(b, 8);
  vint v;
  if constexpr (std::is_signed_v<Byte>) {
    v.p[0] = reinterpret_cast<vint::Part>(_mm256_cvtepi8_epi32(b));
    v.p[1] = reinterpret_cast<vint::Part>(_mm256_cvtepi8_epi32(upper));
  } else {
    v.p[0] = reinterpret_cast<vint::Part>(_mm256_cvtepu8_epi32(b));
    v.p[1] = reinterpret_cast<vint::Part>(_mm256_cvtepu8_epi32(upper));
  }
  return v;
#else
  // Through an int32 array: GCC 12 vectorizes this loop (vpmovzxbd/vpmovsxbd) but lowers a
  // direct __builtin_convertvector of a byte vector lane by lane.
  int32_t wide[kLanes];
  for (int i = 0; i < kLanes; ++i) wide[i] = bytes[i];
  vint v;
  std::memcpy(&v, wide, sizeof(v));
  return v;
#endif
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
#elif defined(__F16C__) && defined(__AVX2__)  // x86-64-v3: two 8-lane conversions
  vfloat v;
  v.p[0] = reinterpret_cast<vfloat::Part>(
      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  v.p[1] = reinterpret_cast<vfloat::Part>(
      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return v;
#else
  float values[kLanes];
  for (int i = 0; i < kLanes; ++i) values[i] = half(p + 2 * i);
  return load(values);
#endif
}

// 16 floats stored as fp16, rounded to nearest even (as torch's .to(float16)).
inline void store_halves(vfloat v, uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm512_cvtps_ph(reinterpret_cast<__m512>(v), _MM_FROUND_TO_NEAREST_INT);
  std::memcpy(p, &h, sizeof(h));
#elif defined(__F16C__) && defined(__AVX2__)
  const __m128i h_lo = _mm256_cvtps_ph(reinterpret_cast<__m256>(v.p[0]), _MM_FROUND_TO_NEAREST_INT);
  const __m128i h_hi = _mm256_cvtps_ph(reinterpret_cast<__m256>(v.p[1]), _MM_FROUND_TO_NEAREST_INT);
  std::memcpy(p, &h_lo, sizeof(h_lo));
  std::memcpy(p + sizeof(h_lo), &h_hi, sizeof(h_hi));
#else
  for (int i = 0; i < kLanes; ++i) {
    const _Float16 h = static_cast<_Float16>(v[i]);
    std::memcpy(p + 2 * i, &h, sizeof(h));
  }
#endif
}

// Horizontal sum as a tree of halves (a loop of scalar adds would be one long dependency
// chain): lanes 0-7 + 8-15, then 0-3 + 4-7, then (0 + 2) + (1 + 3). Every form sums in this
// one order, so a level's parts change no result.
inline float sum(vfloat v) {
#if defined(__AVX512F__)
  const vfloat8 v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vfloat4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) +
                     __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
#elif defined(__AVX2__)
  const vfloat8 v8 = v.p[0] + v.p[1];
  const vfloat4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) +
                     __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
#else
  const vfloat4 v4 = (v.p[0] + v.p[2]) + (v.p[1] + v.p[3]);
#endif
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}

// ---- Loads and stores of the storage types ----

#if defined(__AVX512F__)  // bf16 rows as one vector: AVX-512 widens and narrows it in registers
typedef uint16_t vbf16 __attribute__((vector_size(kLanes * 2)));
#endif
using bf16 = uint16_t;
// fp16 is a KV cache type only (EngineConfig.kv_cache_dtype), converted by halves() /
// store_halves().
using f16 = _Float16;

inline vfloat load(const bf16* p) {
  // bf16 is the top half of an fp32: widen and shift.
#if defined(__AVX512F__)
  vbf16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  return reinterpret_cast<vfloat>(__builtin_convertvector(raw, vuint) << 16);
#else
  uint32_t wide[kLanes];
  for (int i = 0; i < kLanes; ++i) wide[i] = p[i];
  vuint bits;
  std::memcpy(&bits, wide, sizeof(bits));
  return bitcast<vfloat>(bits << 16);
#endif
}

inline vfloat load(const f16* p) { return halves(reinterpret_cast<const uint8_t*>(p)); }

inline void store(vfloat v, float* p) { std::memcpy(p, &v, sizeof(v)); }

inline void store(vfloat v, f16* p) { store_halves(v, reinterpret_cast<uint8_t*>(p)); }

inline void store(vfloat v, bf16* p) {
  // Round to nearest even, as torch does (NaN does not occur in attention outputs).
  vuint bits = bitcast<vuint>(v);
  bits += 0x7fffu + ((bits >> 16) & 1u);
#if defined(__AVX512F__)
  const vbf16 narrowed = __builtin_convertvector(bits >> 16, vbf16);
  std::memcpy(p, &narrowed, sizeof(narrowed));
#else
  uint32_t wide[kLanes];
  std::memcpy(wide, &bits, sizeof(wide));
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<bf16>(wide[i] >> 16);
#endif
}

// ---- 16 bytes as one vector (the block formats' codes) ----

typedef uint8_t vbyte __attribute__((vector_size(kLanes)));

inline vbyte load_bytes(const uint8_t* p) {
  vbyte v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Bytes to floats (vcvtdq2ps after the widening).
template <typename Byte>
inline vfloat widen(const Byte* bytes) {
  return to_float(widen_int(bytes));
}

inline vfloat to_float(vbyte v) {
  uint8_t bytes[kLanes];
  std::memcpy(bytes, &v, sizeof(bytes));
  return widen(bytes);
}

inline vfloat to_float_signed(const uint8_t* p) { return widen(reinterpret_cast<const int8_t*>(p)); }

// ---- Vector math ----

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

}  // namespace kvshare
