// MatMulQ8: y = a · W with W [K, N] stored as symmetric 8-bit blocks, as an ONNX Runtime custom op
// (domain "ai.dflash", version 1). The 8-bit sibling of MatMulQ4: the inputs, the activation
// quantization, the row-count invariance and the op itself are shared (quantized_matmul.h), so an
// int8 target needs no padding row (which ORT's MatMulNBits does); this file holds the 8-bit
// weight layout and its tile paths.
//
// Weights: W[k][n] ~= (u - 128) * scale, u in 0..255, or with offsets (asymmetric, GGUF Q5_1 / Q5_K
// kept exactly) W[k][n] = u * scale + offset; weight is uint8 [T, K/32, 512]. In tile t,
// block b, byte 64*g + 4*c + i (g in 0..7, column c = n - 16t in 0..15, i in 0..3) holds u for
// k = 32b + 4*g + i: four consecutive k of one column sit in one 32-bit lane, which is what a VNNI
// dot product consumes.
//
// A block's dot is sum(q * u) - 128 * sum(q): |dot| <= 32 * 127 * 128 < 2^24, exact in int32 and
// in float. The three paths (AVX-512 VNNI, AVX2+FMA, portable) give the same bits.

#include <cmath>
#include <type_traits>

#include "quantized_matmul.h"

#ifdef DFLASH_QMM_X86
// GCC 12 warns about _mm512_undefined_* inside its own intrinsics (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace dflash {
namespace {

constexpr int32_t kZero = 128;       // u = w + 128
constexpr int64_t kTileBytes = 512;  // bytes of one tile-block (16 columns x 32 rows)
constexpr int64_t kBlock = kQBlock, kTile = kQTile;

void tile_portable(const Job& job, int64_t t) {
  const int64_t K = job.K, KB = K / kBlock;
  const QuantizedRows& qa = *job.rows;
  for (int64_t m = 0; m < job.M; ++m) {
    float acc[kTile] = {};
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* tb = job.tile_block(t, b);
      const int8_t* q = qa.q.data() + m * K + b * kBlock;
      const float sa = qa.scale[m * KB + b];
      for (int64_t c = 0; c < kTile; ++c) {
        int32_t dot = qa.offset[m * KB + b];
        for (int64_t k = 0; k < kBlock; ++k) dot += q[k] * tb[64 * (k / 4) + 4 * c + k % 4];
        acc[c] = std::fma(static_cast<float>(dot), sa * param_at(job, job.scales, t, b, c), acc[c]);
        if (job.offsets) acc[c] = std::fma(param_at(job, job.offsets, t, b, c), qa.total[m * KB + b], acc[c]);
      }
    }
    std::memcpy(job.y + m * job.N + t * kTile, acc, static_cast<size_t>(job.width(t)) * sizeof(float));
  }
}

#ifdef DFLASH_QMM_X86
// R rows (1..8) of one tile: each 64-byte load of weights (k = 4g..4g+3 of the block, 16 columns)
// feeds one VNNI dot product per row, started at the row's -128 * sum(q); then the same float step
// as tile_portable (Asym: and the offset step). Registers: R dots and R float accumulators, within
// the 32 of AVX-512.
template <int R, bool Asym, bool Half>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows_avx512(const Job& job, int64_t t, int64_t m0) {
  const int64_t K = job.K, KB = K / kBlock;
  const int8_t* q = job.rows->q.data() + m0 * K;
  const float* sa = job.rows->scale.data() + m0 * KB;
  const int32_t* offset = job.rows->offset.data() + m0 * KB;
  const float* total = job.rows->total.data() + m0 * KB;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* tb = job.tile_block(t, b);
    prefetch_ahead(job, t, b);  // past the end of the weights is harmless: prefetches never fault
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_set1_epi32(offset[r * KB + b]);
    for (int g = 0; g < 8; ++g) {
      const __m512i u = _mm512_loadu_si512(tb + 64 * g);
      for (int r = 0; r < R; ++r)
        dot[r] = _mm512_dpbusd_epi32(dot[r], u, _mm512_set1_epi32(quad_at(q + r * K + b * kBlock + 4 * g)));
    }
    using P = std::conditional_t<Half, uint16_t, float>;
    const __m512 sb = params16<Half>(job.tile_scales<P>(t, b));
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_mul_ps(_mm512_set1_ps(sa[r * KB + b]), sb);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), s, acc[r]);
    }
    if (Asym) {
      const __m512 ob = params16<Half>(job.tile_offsets<P>(t, b));
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(ob, _mm512_set1_ps(total[r * KB + b]), acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << job.width(t)) - 1u);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(job.y + (m0 + r) * job.N + t * kTile, keep, acc[r]);
}

constexpr int kRowsAvx512 = 8;
template <bool Asym, bool Half>
constexpr RowsFn rows_avx512_fns[kRowsAvx512 + 1] = {
    nullptr,
    rows_avx512<1, Asym, Half>,
    rows_avx512<2, Asym, Half>,
    rows_avx512<3, Asym, Half>,
    rows_avx512<4, Asym, Half>,
    rows_avx512<5, Asym, Half>,
    rows_avx512<6, Asym, Half>,
    rows_avx512<7, Asym, Half>,
    rows_avx512<8, Asym, Half>};
const RowsFn* const tables_avx512[2][2] = {{rows_avx512_fns<false, false>, rows_avx512_fns<false, true>},
                                           {rows_avx512_fns<true, false>, rows_avx512_fns<true, true>}};
void tile_avx512(const Job& job, int64_t t) { tile_in_row_groups<kRowsAvx512>(job, t, rows_for(job, tables_avx512)); }

// AVX2 has no VNNI, and maddubs (u8 x s8 pairs summed to int16) would saturate on 255 * 127 * 2.
// So each weight byte is split into nibbles, u = 16 * hi + lo, and dot(q, u) = 16 * dot(q, hi) +
// dot(q, lo): a block's 8 groups of 4 sum to at most 8 * 2 * 15 * 127 = 30480 per int16 lane,
// exact, as in MatMulQ4's AVX2 path. The float part is the same fma sequence: the same bits.
// Eight columns per register, so each half of a tile runs its own pass over the blocks, R rows
// (1..4) at a time.
template <int R, bool Asym, bool Half>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Job& job, int64_t t, int64_t m0) {
  const int64_t K = job.K, KB = K / kBlock;
  const int8_t* q = job.rows->q.data() + m0 * K;
  const float* sa = job.rows->scale.data() + m0 * KB;
  const int32_t* offset = job.rows->offset.data() + m0 * KB;
  const float* total = job.rows->total.data() + m0 * KB;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* tb = job.tile_block(t, b) + 32 * half;
      if (half == 0) prefetch_ahead(job, t, b);  // the second half finds the block in cache
      __m256i lo_sum[R], hi_sum[R];
      for (int r = 0; r < R; ++r) lo_sum[r] = hi_sum[r] = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 64 * g));
        const __m256i lo = _mm256_and_si256(bytes, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        for (int r = 0; r < R; ++r) {
          const __m256i qg = _mm256_set1_epi32(quad_at(q + r * K + b * kBlock + 4 * g));
          lo_sum[r] = _mm256_add_epi16(lo_sum[r], _mm256_maddubs_epi16(lo, qg));
          hi_sum[r] = _mm256_add_epi16(hi_sum[r], _mm256_maddubs_epi16(hi, qg));
          keep_in_register(lo_sum[r]);
          keep_in_register(hi_sum[r]);
        }
      }
      using P = std::conditional_t<Half, uint16_t, float>;
      const __m256 sb = params8<Half>(job.tile_scales<P>(t, b) + 8 * half);
      for (int r = 0; r < R; ++r) {
        // 16 * hi + lo, widened to int32 pairwise (madd), plus the -128 * sum(q) offset
        const __m256i dot = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(hi_sum[r], sixteens), _mm256_madd_epi16(lo_sum[r], ones)),
            _mm256_set1_epi32(offset[r * KB + b]));
        const __m256 s = _mm256_mul_ps(_mm256_set1_ps(sa[r * KB + b]), sb);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r]);
      }
      if (Asym) {
        const __m256 ob = params8<Half>(job.tile_offsets<P>(t, b) + 8 * half);
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(ob, _mm256_set1_ps(total[r * KB + b]), acc[r]);
      }
    }
    const int64_t first = 8 * half, width = std::min<int64_t>(8, job.width(t) - first);
    for (int r = 0; r < R && width > 0; ++r) {
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[r]);
      std::memcpy(job.y + (m0 + r) * job.N + t * kTile + first, out, static_cast<size_t>(width) * sizeof(float));
    }
  }
}

constexpr int kRowsAvx2 = 4;
template <bool Asym, bool Half>
constexpr RowsFn rows_avx2_fns[kRowsAvx2 + 1] = {nullptr, rows_avx2<1, Asym, Half>, rows_avx2<2, Asym, Half>,
                                                 rows_avx2<3, Asym, Half>, rows_avx2<4, Asym, Half>};
const RowsFn* const tables_avx2[2][2] = {{rows_avx2_fns<false, false>, rows_avx2_fns<false, true>},
                                         {rows_avx2_fns<true, false>, rows_avx2_fns<true, true>}};
void tile_avx2(const Job& job, int64_t t) { tile_in_row_groups<kRowsAvx2>(job, t, rows_for(job, tables_avx2)); }
#endif

}  // namespace

#ifdef DFLASH_QMM_X86
const QuantizedFormat q8_format{"MatMulQ8", kTileBytes, kZero, tile_portable, tile_avx2, tile_avx512};
#else
const QuantizedFormat q8_format{"MatMulQ8", kTileBytes, kZero, tile_portable, nullptr, nullptr};
#endif

}  // namespace dflash
