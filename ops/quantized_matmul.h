// What the quantized MatMul ops (MatMulQ4 in matmul_q4.cc, MatMulQ8 in matmul_q8.cc) share: the
// activations quantized per block, the work of one call, row groups, and the op itself (attribute
// and shape checks, then every tile of 16 columns on ORT's pool). Each op brings its weight layout
// and its tile paths.
//
// Why our own ops and not ORT's MatMulNBits: it takes one kernel for a single row and another for
// several, and the two round differently, so a one-token decode step and a verify of many rows could
// choose different tokens (speculation would stop being lossless). Here every row goes through the
// same sequence of operations whatever the row count -- rows share only the weight loads -- so a
// row's result is bit-identical for any number of rows, thread count and kernel path.
//
// Inputs of both ops
//   0 a       float [..., K]
//   1 weight  uint8 [T, K/32, tile bytes]   T = ceil(N/16) tiles of 16 columns, blocks of 32 rows
//   2 scales  float or float16 [T, K/32, 16]  one scale per block and column (padding columns: 0);
//                                           float16 holds GGUF's own d exactly in half the bytes
//   3 offsets optional, scales' type [T, K/32, 16]  asymmetric blocks: W = u * scale + offset, u the
//                                           stored code with no zero point (GGUF Q4_1 / Q4_K / Q5_1 /
//                                           Q5_K: scale d, offset m, kept exactly); absent: W = (u - z) * scale
// Attributes: K, N (ints); split_activations (int, optional, default 0): 1 quantizes each row as two
// int8 rows, the row and what its rounding left (r = a - sa * q, computed in double and rounded to
// float once), runs both, and adds their results in float: ~15-bit activations for twice the
// integer work, the same for every row count.  Output: y float [..., N].
//
// Activations, per row: each block of 32 is quantized to int8 with its own scale sa = max|a| / 127,
// q = round-to-nearest-even(a * (127 / max|a|)), all in float32 (a zero block gives q = 0, sa = 0).
// Then y[n] = sum over blocks b in order of fma(float(dot_b), sa_b * scale_bn, acc) from acc = 0,
// where dot_b is the block's exact integer dot with the stored weights minus their zero point.
// With offsets, each block's step is followed by acc = fma(offset_bn, total_b, acc), total_b =
// sa_b * sum(q) the block's dequantized activations summed: the offset term costs one FMA per block
// and column, as the min term of llama.cpp's Q4_1 x Q8_1 dot does, and dequant(W) * dequant(a) is
// what the op computes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "op_support.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DFLASH_NO_SIMD_DISPATCH)
#define DFLASH_QMM_X86 1
#include <immintrin.h>
#endif

namespace dflash {

constexpr int64_t kQBlock = 32;  // rows of W (and activations) per quantization block
constexpr int64_t kQTile = 16;   // columns per tile

// The activations of one call, quantized per row and block. Rows are K/32 blocks wide and stored
// one after another, so block j of row m is block m * K/32 + j.
struct QuantizedRows {
  std::vector<int8_t> q;      // [M][K]
  std::vector<float> scale;   // [M][K/32]  sa
  std::vector<int32_t> offset;  // [M][K/32]  -z * (the sum of the block's q), z the weights' zero point:
                                // the dot's zero-point term, read straight from memory by the kernels
  std::vector<float> total;     // [M][K/32]  sa * (the sum of the block's q): what asymmetric blocks'
                                // offsets multiply
};

// One call's work. A work item is one tile (16 columns) for every row, so how the columns are
// split among threads never changes what a row computes.
struct Job {
  const QuantizedRows* rows;
  const uint8_t* weight;
  const void* scales;   // float, or float16 when half
  const void* offsets;  // the same type; null: symmetric blocks
  bool half;
  float* y;
  int64_t M, K, N, tile_bytes;

  int64_t blocks() const { return K / kQBlock; }
  const uint8_t* tile_block(int64_t t, int64_t b) const { return weight + (t * blocks() + b) * tile_bytes; }
  // The 16 scales / offsets of tile t, block b, as float or float16 (uint16_t) elements.
  template <typename P>
  const P* tile_scales(int64_t t, int64_t b) const { return static_cast<const P*>(scales) + (t * blocks() + b) * kQTile; }
  template <typename P>
  const P* tile_offsets(int64_t t, int64_t b) const { return static_cast<const P*>(offsets) + (t * blocks() + b) * kQTile; }
  int64_t width(int64_t t) const { return std::min(kQTile, N - t * kQTile); }  // real columns of tile t
};

// float16 -> float, exactly (normal, subnormal, zero, inf, nan), without F16C: the portable path.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: value = mantissa * 2^-24
    float value = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &value, sizeof bits);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Parameter c (scale or offset) of a tile-block, as float.
inline float param_at(const Job& job, const void* base, int64_t t, int64_t b, int64_t c) {
  const int64_t i = (t * job.blocks() + b) * kQTile + c;
  return job.half ? half_to_float(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
}

using TileFn = void (*)(const Job&, int64_t t);

// A tile for R rows at once, rows m0..m0+R-1: each tile-block is loaded (and unpacked) once per
// group of rows, not once per row.
using RowsFn = void (*)(const Job&, int64_t t, int64_t m0);

// One tile for every row: full groups of R rows, then one smaller group for the rest. `rows` holds
// the group functions for 1..R rows at rows[1..R].
template <int R>
void tile_in_row_groups(const Job& job, int64_t t, const RowsFn* rows) {
  int64_t m = 0;
  for (; m + R <= job.M; m += R) rows[R](job, t, m);
  if (job.M > m) rows[job.M - m](job, t, m);
}

// Which tile path to run: the best this CPU has unless DFLASH_OPS_KERNELS=portable|avx2 caps it
// (the tests run every path with it).
enum class KernelPath { portable, avx2, avx512 };
KernelPath best_path();

// Four consecutive int8 activations as one 32-bit lane value, to broadcast to every column. Read
// from memory (not from a register) so the compiler folds it into the instruction as a broadcast
// load: a broadcast from a general register costs a vector uop per use, as many as the dot itself.
inline int32_t quad_at(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof v);
  return v;
}

// A row-group table per weight format: [asymmetric][half] -> rows[1..R].
inline const RowsFn* rows_for(const Job& job, const RowsFn* const (&tables)[2][2]) {
  return tables[job.offsets != nullptr][job.half];
}

#ifdef DFLASH_QMM_X86
// 16 or 8 parameters (scales or offsets) of a tile-block as float lanes.
template <bool Half>
__attribute__((target("avx512f"))) inline __m512 params16(const void* p) {
  if (Half) return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  return _mm512_loadu_ps(static_cast<const float*>(p));
}
template <bool Half>
__attribute__((target("avx2,f16c"))) inline __m256 params8(const void* p) {
  if (Half) return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  return _mm256_loadu_ps(static_cast<const float*>(p));
}

// Ask for the tile-block kPrefetchBlocks ahead (this tile's later blocks, then the next tile's): the
// weights stream from memory once per call, and the hardware prefetcher alone leaves the dot
// products waiting. Whole int4 model, 2 threads, past 256: 8 rows 9.2 -> 8.2 ms (AMD Zen 4); one
// row 3.67 -> 3.14 ms on the AVX-512 path and 4.1 -> 3.3 on the AVX2 path (Intel Xeon, AVX-512 VNNI),
// where without it one row took longer than two.
constexpr int64_t kPrefetchBlocks = 16;
inline void prefetch_ahead(const Job& job, int64_t t, int64_t b) {
  const char* ahead = reinterpret_cast<const char*>(job.tile_block(t, b)) + kPrefetchBlocks * job.tile_bytes;
  for (int64_t line = 0; line < job.tile_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

// An empty asm that claims to change v: the compiler must hold v in a register here. Without it GCC
// regroups a row group's int16 additions into a tree over the whole block (integer sums may be
// reordered), which needs more than 16 registers and spills the products to the stack.
__attribute__((target("avx2"))) inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }
#endif

// An op's format: its name, the bytes of one tile-block, and its tile function per path (the
// AVX2 and AVX-512 ones are null in a build without them).
struct QuantizedFormat {
  const char* name;
  int64_t tile_bytes;
  int32_t zero_point;  // stored weight = w + zero_point
  TileFn portable, avx2, avx512;

  TileFn tile_for(KernelPath path) const {
    if (path == KernelPath::avx512 && avx512) return avx512;
    if (path != KernelPath::portable && avx2) return avx2;
    return portable;
  }
};

extern const QuantizedFormat q4_format;  // matmul_q4.cc
extern const QuantizedFormat q8_format;  // matmul_q8.cc

const OrtCustomOp* matmul_q4_op();
const OrtCustomOp* matmul_q8_op();

}  // namespace dflash
