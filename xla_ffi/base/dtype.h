// Element types of the matmul and reduce launchers, and host conversions for the CPU backend.
// No FFI types here: launchers stay usable without XLA.
#ifndef FICCO_JAX_XLA_FFI_BASE_DTYPE_H_
#define FICCO_JAX_XLA_FFI_BASE_DTYPE_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ficco {

// The FP8 types are matmul operands only (per-tensor scaled, see MatmulTypes in device/gemm.h):
// the executor reads them, moves their bytes, and never writes one.
enum class Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2, kF8E4M3 = 3, kF8E5M2 = 4 };

inline size_t ByteWidth(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32: return 4;
    case Dtype::kBF16:
    case Dtype::kF16: return 2;
    case Dtype::kF8E4M3:
    case Dtype::kF8E5M2: return 1;
  }
  return 4;
}

inline bool IsFp8(Dtype dtype) { return dtype == Dtype::kF8E4M3 || dtype == Dtype::kF8E5M2; }

inline float BitsToFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t FloatToBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(uint32_t{h} << 16); }

// Round to nearest even, as XLA does.
inline uint16_t FloatToBf16(float value) {
  uint32_t bits = FloatToBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in f32
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Round to nearest even; overflow to infinity.
inline uint16_t FloatToF16(float value) {
  const uint32_t bits = FloatToBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) return sign | (magnitude > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (magnitude < 0x38800000u) {                        // below 2^-14: a half subnormal
    float scaled = BitsToFloat(magnitude) * 16777216.0f;  // * 2^24, exact
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
}

// float8_e4m3fn: bias 7, no infinities, S.1111.111 is NaN. float8_e5m2: bias 15, IEEE-style
// infinities and NaNs. Both exact in f32.
inline float F8E4M3ToFloat(uint8_t v) {
  const float sign = (v & 0x80u) ? -1.0f : 1.0f;
  const int exponent = (v >> 3) & 0xf, mantissa = v & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m * 2^-6 / 8
  return sign * std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
}

inline float F8E5M2ToFloat(uint8_t v) { return F16ToFloat(static_cast<uint16_t>(uint16_t{v} << 8)); }

inline float LoadAsFloat(const void* base, int64_t index, Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32: return static_cast<const float*>(base)[index];
    case Dtype::kBF16: return Bf16ToFloat(static_cast<const uint16_t*>(base)[index]);
    case Dtype::kF16: return F16ToFloat(static_cast<const uint16_t*>(base)[index]);
    case Dtype::kF8E4M3: return F8E4M3ToFloat(static_cast<const uint8_t*>(base)[index]);
    case Dtype::kF8E5M2: return F8E5M2ToFloat(static_cast<const uint8_t*>(base)[index]);
  }
  return 0.0f;
}

inline void StoreFromFloat(void* base, int64_t index, Dtype dtype, float value) {
  switch (dtype) {
    case Dtype::kF32: static_cast<float*>(base)[index] = value; return;
    case Dtype::kBF16: static_cast<uint16_t*>(base)[index] = FloatToBf16(value); return;
    case Dtype::kF16: static_cast<uint16_t*>(base)[index] = FloatToF16(value); return;
    case Dtype::kF8E4M3:
    case Dtype::kF8E5M2: return;  // never an output (see Dtype)
  }
}

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_BASE_DTYPE_H_
