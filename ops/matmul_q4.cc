// MatMulQ4: y = a · W with W [K, N] stored as symmetric 4-bit blocks, as an ONNX Runtime custom op
// (domain "ai.dflash", version 1). The inputs, the activation quantization, the row-count
// invariance and the op itself are shared with MatMulQ8 (quantized_matmul.h); this file holds the
// 4-bit weight layout and its tile paths.
//
// Weights: W[k][n] ~= (u - 8) * scale, u in 0..15, or with offsets (asymmetric, GGUF Q4_1 / Q4_K kept
// exactly) W[k][n] = u * scale + offset; weight is uint8 [T, K/32, 256]. In tile t,
// block b, byte 64*c4 + 4*c + i (c4 in 0..3, column c = n - 16t in 0..15, i in 0..3) holds u for
// k = 32b + 4*c4 + i in its low nibble and for k = 32b + 16 + 4*c4 + i in its high nibble. Four
// consecutive k of one column sit in one 32-bit lane, which is what a VNNI dot product consumes.
//
// A block's dot is sum(q * u) - 8 * sum(q) (asymmetric: sum(q * u)), exact in int32. The three
// paths (AVX-512 VNNI, AVX2+FMA, portable) give the same bits.

#include <cmath>
#include <type_traits>

#include "quantized_matmul.h"

#ifdef DFLASH_QMM_X86
// GCC 12 warns about _mm512_undefined_ps() inside its own intrinsics (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace dflash {
namespace {

constexpr int32_t kZero = 8;           // u = w + 8
constexpr int64_t kTileBytes = 256;    // packed bytes of one tile-block (16 columns x 32 rows x 4 bits)
constexpr int64_t kBlock = kQBlock, kTile = kQTile;

// The unpacked 4-bit value for row k (within the block) of column c of a tile-block.
inline int32_t nibble(const uint8_t* tb, int64_t k, int64_t c) {
  const int64_t hi = k / 16, c4 = (k % 16) / 4, i = k % 4;
  const uint8_t byte = tb[64 * c4 + 4 * c + i];
  return hi ? byte >> 4 : byte & 0x0F;
}

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
        for (int64_t k = 0; k < kBlock; ++k) dot += q[k] * nibble(tb, k, c);
        const float s = sa * param_at(job, job.scales, t, b, c);
        acc[c] = std::fma(static_cast<float>(dot), s, acc[c]);
        if (job.offsets) acc[c] = std::fma(param_at(job, job.offsets, t, b, c), qa.total[m * KB + b], acc[c]);
      }
    }
    std::memcpy(job.y + m * job.N + t * kTile, acc, static_cast<size_t>(job.width(t)) * sizeof(float));
  }
}

#ifdef DFLASH_QMM_X86
// R rows (1..8) of one tile. Per block: each of the four 64-byte loads gives two registers of
// unpacked weights (low and high nibbles) that every row uses at once; each row sums its exact
// int32 dot for the block, then takes the same float step as tile_portable (Asym: and the offset
// step). Registers: R chains, R float accumulators and a few for the weights, within the 32 of
// AVX-512.
template <int R, bool Asym, bool Half>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_rows_avx512(const Job& job, int64_t t,
                                                                               int64_t m0) {
  const int64_t K = job.K, KB = K / kBlock;
  const int8_t* q = job.rows->q.data() + m0 * K;
  const float* sa = job.rows->scale.data() + m0 * KB;
  const int32_t* offset = job.rows->offset.data() + m0 * KB;
  const float* total = job.rows->total.data() + m0 * KB;
  // One dot chain per row is eight dependent VNNI steps; with few rows, two chains per row keep
  // enough independent work in flight to hide their latency (integer sums: the order is free).
  constexpr int kChains = R < 4 ? 2 : 1;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* tb = job.tile_block(t, b);
    prefetch_ahead(job, t, b);  // past the end of the weights is harmless: prefetches never fault
    __m512i dot[R][kChains];  // the low-nibble and high-nibble halves of a row's dot
    for (int r = 0; r < R; ++r) {
      dot[r][0] = _mm512_set1_epi32(offset[r * KB + b]);  // a broadcast load: no vector ALU work
      if (kChains == 2) dot[r][1] = _mm512_setzero_si512();
    }
    for (int c4 = 0; c4 < 4; ++c4) {
      // 16 columns x 4 bytes: k = 4*c4.. (low nibbles) and k = 16 + 4*c4.. (high nibbles)
      const __m512i bytes = _mm512_loadu_si512(tb + 64 * c4);
      const __m512i lo = _mm512_and_si512(bytes, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      for (int r = 0; r < R; ++r) {
        const int8_t* qb = q + r * K + b * kBlock + 4 * c4;
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], lo, _mm512_set1_epi32(quad_at(qb)));
        dot[r][kChains - 1] = _mm512_dpbusd_epi32(dot[r][kChains - 1], hi, _mm512_set1_epi32(quad_at(qb + 16)));
      }
    }
    using P = std::conditional_t<Half, uint16_t, float>;
    const __m512 sb = params16<Half>(job.tile_scales<P>(t, b));
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_mul_ps(_mm512_set1_ps(sa[r * KB + b]), sb);
      const __m512i d = kChains == 2 ? _mm512_add_epi32(dot[r][0], dot[r][1]) : dot[r][0];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[r]);
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
constexpr RowsFn rows_avx512[kRowsAvx512 + 1] = {
    nullptr,
    tile_rows_avx512<1, Asym, Half>,
    tile_rows_avx512<2, Asym, Half>,
    tile_rows_avx512<3, Asym, Half>,
    tile_rows_avx512<4, Asym, Half>,
    tile_rows_avx512<5, Asym, Half>,
    tile_rows_avx512<6, Asym, Half>,
    tile_rows_avx512<7, Asym, Half>,
    tile_rows_avx512<8, Asym, Half>};
const RowsFn* const tables_avx512[2][2] = {{rows_avx512<false, false>, rows_avx512<false, true>},
                                           {rows_avx512<true, false>, rows_avx512<true, true>}};
void tile_avx512(const Job& job, int64_t t) { tile_in_row_groups<kRowsAvx512>(job, t, rows_for(job, tables_avx512)); }

// AVX2 (no VNNI): u8 x s8 products summed in pairs by maddubs; 8 groups of 4 sum to at most
// 8 * 2 * 15 * 127 = 30480 per 16-bit lane, so the integer dot is exact, and the float part is the
// same fma sequence: the same bits as the other paths. Both 8-column halves of a tile go in one
// pass, R rows (1..4) at a time, so each activation broadcast serves 16 columns: 2R int16 sums and
// the unpacked weights of both halves take the 16 registers, and the float accumulators live in
// memory (one load and store per block and row; single-thread, weights in L2: 64 -> 85 GMAC/s at
// one row, 101 -> 119 at four, against a pass per half).
template <int R, bool Asym, bool Half>
__attribute__((target("avx2,fma,f16c"))) void tile_rows_avx2(const Job& job, int64_t t, int64_t m0) {
  const int64_t K = job.K, KB = K / kBlock;
  const int8_t* q = job.rows->q.data() + m0 * K;
  const float* sa = job.rows->scale.data() + m0 * KB;
  const int32_t* offset = job.rows->offset.data() + m0 * KB;
  const float* total = job.rows->total.data() + m0 * KB;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  alignas(32) float acc[R][16] = {};
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* tb = job.tile_block(t, b);
    prefetch_ahead(job, t, b);
    __m256i pairs[R][2];
    for (int r = 0; r < R; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
    for (int c4 = 0; c4 < 4; ++c4) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 64 * c4));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 64 * c4 + 32));
      const __m256i lo0 = _mm256_and_si256(b0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(b0, 4), low4);
      const __m256i lo1 = _mm256_and_si256(b1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(b1, 4), low4);
      for (int r = 0; r < R; ++r) {
        const int8_t* qb = q + r * K + b * kBlock + 4 * c4;
        const __m256i ql = _mm256_set1_epi32(quad_at(qb)), qh = _mm256_set1_epi32(quad_at(qb + 16));
        pairs[r][0] = _mm256_add_epi16(pairs[r][0], _mm256_maddubs_epi16(lo0, ql));
        pairs[r][1] = _mm256_add_epi16(pairs[r][1], _mm256_maddubs_epi16(lo1, ql));
        pairs[r][0] = _mm256_add_epi16(pairs[r][0], _mm256_maddubs_epi16(hi0, qh));
        pairs[r][1] = _mm256_add_epi16(pairs[r][1], _mm256_maddubs_epi16(hi1, qh));
        keep_in_register(pairs[r][0]);
        keep_in_register(pairs[r][1]);
      }
    }
    using P = std::conditional_t<Half, uint16_t, float>;
    // the block's parameters once for all rows (loads through __m128i may alias acc's stores, so
    // the compiler would not hoist them out of the row loop itself)
    const P* sbp = job.tile_scales<P>(t, b);
    const __m256 sb[2] = {params8<Half>(sbp), params8<Half>(sbp + 8)};
    __m256 ob[2];
    if (Asym) {
      const P* obp = job.tile_offsets<P>(t, b);
      ob[0] = params8<Half>(obp);
      ob[1] = params8<Half>(obp + 8);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i zero_point = _mm256_set1_epi32(offset[r * KB + b]);
      const __m256 sar = _mm256_set1_ps(sa[r * KB + b]);
      for (int h = 0; h < 2; ++h) {
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(pairs[r][h], ones), zero_point);
        const __m256 s = _mm256_mul_ps(sar, sb[h]);
        __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, _mm256_load_ps(acc[r] + 8 * h));
        if (Asym) sum = _mm256_fmadd_ps(ob[h], _mm256_set1_ps(total[r * KB + b]), sum);
        _mm256_store_ps(acc[r] + 8 * h, sum);
      }
    }
  }
  const int64_t width = job.width(t);
  for (int r = 0; r < R; ++r)
    std::memcpy(job.y + (m0 + r) * job.N + t * kTile, acc[r], static_cast<size_t>(width) * sizeof(float));
}

constexpr int kRowsAvx2 = 4;
template <bool Asym, bool Half>
constexpr RowsFn rows_avx2[kRowsAvx2 + 1] = {nullptr, tile_rows_avx2<1, Asym, Half>, tile_rows_avx2<2, Asym, Half>,
                                             tile_rows_avx2<3, Asym, Half>, tile_rows_avx2<4, Asym, Half>};
const RowsFn* const tables_avx2[2][2] = {{rows_avx2<false, false>, rows_avx2<false, true>},
                                         {rows_avx2<true, false>, rows_avx2<true, true>}};
void tile_avx2(const Job& job, int64_t t) { tile_in_row_groups<kRowsAvx2>(job, t, rows_for(job, tables_avx2)); }
#endif

}  // namespace

#ifdef DFLASH_QMM_X86
const QuantizedFormat q4_format{"MatMulQ4", kTileBytes, kZero, tile_portable, tile_avx2, tile_avx512};
#else
const QuantizedFormat q4_format{"MatMulQ4", kTileBytes, kZero, tile_portable, nullptr, nullptr};
#endif

}  // namespace dflash
