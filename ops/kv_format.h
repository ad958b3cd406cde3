// The KV cache's storage formats (TreeAttention's key_cache / value_cache element types).
//
//   f32  float32 [.., D]                 the rows as computed
//   f16  float16 [.., D]                 each value rounded to nearest (ties to even)
//   q8   uint8   [.., D + 4*ceil(D/32)]  per block of 32 values (the last may be shorter): int8
//                                        q = round(x / s) with s = max|x| / 127, then the blocks'
//                                        scales s as float32 after the row's D int8 values
//
// A new row is stored once, and every later read widens the stored row back to float32
// exactly (kernels.h widen_*), so a query row's arithmetic sees the same values whatever the
// number of rows verified with it: the lossless guarantee holds at every format.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace dflash {

enum class KvFormat { f32, f16, q8 };

constexpr int64_t kQ8Block = 32;

inline int64_t q8_blocks(int64_t D) { return (D + kQ8Block - 1) / kQ8Block; }

// Elements of one stored row of D values (the cache's last dimension).
inline int64_t row_width(KvFormat f, int64_t D) { return f == KvFormat::q8 ? D + 4 * q8_blocks(D) : D; }

inline int64_t row_bytes(KvFormat f, int64_t D) {
  switch (f) {
    case KvFormat::f32: return 4 * D;
    case KvFormat::f16: return 2 * D;
    default: return row_width(f, D);
  }
}

// float32 -> float16 bits, rounded to nearest, ties to even; overflow gives inf, NaN stays NaN.
inline uint16_t half_from_float(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half; adding 0.5 lets the FPU round at 2^-24
    float a;
    std::memcpy(&a, &ax, sizeof a);
    const float shifted = a + 0.5f;
    uint32_t bits;
    std::memcpy(&bits, &shifted, sizeof bits);
    return static_cast<uint16_t>(sign | (bits - 0x3f000000u));
  }
  // Rebias the exponent and round the 13 dropped mantissa bits to nearest even; a carry
  // moves into the exponent, as it should.
  const uint32_t rounded = ax - ((127u - 15u) << 23) + 0xfffu + ((ax >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

// Row x[0..D) in format f at dst (row_bytes(f, D) bytes).
inline void store_row(KvFormat f, const float* x, int64_t D, uint8_t* dst) {
  if (f == KvFormat::f32) {
    std::memcpy(dst, x, static_cast<size_t>(D) * sizeof(float));
  } else if (f == KvFormat::f16) {
    for (int64_t d = 0; d < D; ++d) {
      const uint16_t h = half_from_float(x[d]);
      std::memcpy(dst + 2 * d, &h, sizeof h);
    }
  } else {
    for (int64_t b = 0; b < q8_blocks(D); ++b) {
      const int64_t d0 = b * kQ8Block, d1 = std::min(D, d0 + kQ8Block);
      float amax = 0.0f;
      for (int64_t d = d0; d < d1; ++d) amax = std::max(amax, std::fabs(x[d]));
      const float s = amax / 127.0f;
      for (int64_t d = d0; d < d1; ++d) {
        const float q = s > 0.0f ? std::nearbyint(x[d] / s) : 0.0f;
        dst[d] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f)));
      }
      std::memcpy(dst + D + 4 * b, &s, sizeof s);
    }
  }
}

}  // namespace dflash
