// Element types of the matmul and reduce launchers, and host conversions for the CPU backend.
// No FFI types here: launchers stay usable without XLA.
#ifndef FICCO_JAX_XLA_FFI_BASE_DTYPE_H_
#define FICCO_JAX_XLA_FFI_BASE_DTYPE_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ficco {

enum class Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline size_t ByteWidth(Dtype dtype) { return dtype == Dtype::kF32 ? 4 : 2; }

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

inline float LoadAsFloat(const void* base, int64_t index, Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32: return static_cast<const float*>(base)[index];
    case Dtype::kBF16: return Bf16ToFloat(static_cast<const uint16_t*>(base)[index]);
    case Dtype::kF16: return F16ToFloat(static_cast<const uint16_t*>(base)[index]);
  }
  return 0.0f;
}

inline void StoreFromFloat(void* base, int64_t index, Dtype dtype, float value) {
  switch (dtype) {
    case Dtype::kF32: static_cast<float*>(base)[index] = value; return;
    case Dtype::kBF16: static_cast<uint16_t*>(base)[index] = FloatToBf16(value); return;
    case Dtype::kF16: static_cast<uint16_t*>(base)[index] = FloatToF16(value); return;
  }
}

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_BASE_DTYPE_H_
