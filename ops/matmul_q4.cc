// MatMulQ4: y = a · W with W [K, N] stored as symmetric 4-bit blocks, as an ONNX Runtime custom op
// (domain "ai.dflash", version 1).
//
// Why not ORT's MatMulNBits: it takes one kernel for a single row and another for several, and
// the two round differently, so a one-token decode step and a verify of many rows could choose
// different tokens (speculation would stop being lossless). Here every row goes through the same
// sequence of operations whatever the row count -- rows share only the weight loads -- so a row's
// result is bit-identical for any number of rows and any thread count.
//
// Inputs
//   0 a       float [..., K]
//   1 weight  uint8 [T, K/32, 256]   T = ceil(N/16) tiles of 16 columns, in blocks of 32 rows of W
//   2 scales  float [T, K/32, 16]    one scale per block and column (padding columns: 0)
// Attributes: K, N (ints).  Output: y float [..., N].
//
// Weights: W[k][n] ~= (u - 8) * scale, u in 0..15. In tile t, block b, byte 64*c4 + 4*c + i
// (c4 in 0..3, column c = n - 16t in 0..15, i in 0..3) holds u for k = 32b + 4*c4 + i in its low
// nibble and for k = 32b + 16 + 4*c4 + i in its high nibble. Four consecutive k of one column sit
// in one 32-bit lane, which is what a VNNI dot product consumes.
//
// Arithmetic, per row: each block of 32 activations is quantized to int8 with its own scale
// sa = max|a| / 127, q = round-to-nearest-even(a * (127 / max|a|)) (a zero block gives q = 0,
// sa = 0). Then y[n] = sum over blocks b in order of fma(float(dot_b(q, u) - 8 * sum_b(q)),
// sa_b * scale_bn, acc) from acc = 0. The integer parts are exact, so the three paths (AVX-512
// VNNI, AVX2+FMA, portable; the best the CPU has is picked when the session creates the kernel)
// give the same bits.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "matmul_q4.h"
#include "op_support.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DFLASH_NO_SIMD_DISPATCH)
#define DFLASH_Q4_X86 1
#include <immintrin.h>
// GCC 12 warns about _mm512_undefined_ps() inside its own intrinsics (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace dflash {
namespace {

constexpr const char* kName = "MatMulQ4";
constexpr int64_t kBlock = 32;       // rows of W per quantization block
constexpr int64_t kTile = 16;        // columns per tile
constexpr int64_t kTileBytes = 256;  // packed bytes of one tile-block (16 columns x 32 rows x 4 bits)

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  fail_in(kName, args...);
}

// The activations of one call, quantized per row and block.
struct QuantizedRows {
  std::vector<int8_t> q;        // [M][K]
  std::vector<float> scale;     // [M][KB]
  std::vector<int32_t> offset;  // [M][KB]: -8 * sum of the block's q (the u - 8 of W), a dot's start
};

// Quantize `blocks` consecutive blocks of 32 activations (see the header comment).
void quantize_portable(const float* a, int64_t blocks, int8_t* q, float* scale, int32_t* offset) {
  for (int64_t blk = 0; blk < blocks; ++blk, a += kBlock, q += kBlock) {
    float amax = 0.0f;
    for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(a[k]));
    int32_t sum = 0;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t k = 0; k < kBlock; ++k) {
      const float r = std::nearbyint(a[k] * inv);  // the default rounding: to nearest even
      q[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
      sum += q[k];
    }
    scale[blk] = amax / 127.0f;
    offset[blk] = -8 * sum;
  }
}

// One call's work: rows x tiles. A work item is one tile for every row.
struct Job {
  const QuantizedRows* rows;
  const uint8_t* weight;
  const float* scales;
  float* y;
  int64_t M, K, N;
};

// The unpacked 4-bit value for row k (within the block) of column c of a tile-block.
inline int32_t nibble(const uint8_t* tb, int64_t k, int64_t c) {
  const int64_t hi = k / 16, c4 = (k % 16) / 4, i = k % 4;
  const uint8_t byte = tb[64 * c4 + 4 * c + i];
  return hi ? byte >> 4 : byte & 0x0F;
}

void tile_portable(const Job& job, int64_t t) {
  const int64_t K = job.K, KB = K / kBlock, width = std::min(kTile, job.N - t * kTile);
  const QuantizedRows& qa = *job.rows;
  for (int64_t m = 0; m < job.M; ++m) {
    float acc[kTile] = {};
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* tb = job.weight + (t * KB + b) * kTileBytes;
      const float* sb = job.scales + (t * KB + b) * kTile;
      const int8_t* q = qa.q.data() + m * K + b * kBlock;
      const float sa = qa.scale[m * KB + b];
      for (int64_t c = 0; c < kTile; ++c) {
        int32_t dot = qa.offset[m * KB + b];
        for (int64_t k = 0; k < kBlock; ++k) dot += q[k] * nibble(tb, k, c);
        const float s = sa * sb[c];
        acc[c] = std::fma(static_cast<float>(dot), s, acc[c]);
      }
    }
    std::memcpy(job.y + m * job.N + t * kTile, acc, static_cast<size_t>(width) * sizeof(float));
  }
}

// Four consecutive int8 activations as one 32-bit lane value, to broadcast to every column. Read
// from memory (not from a register) so the compiler folds it into the instruction as a broadcast
// load: a broadcast from a general register costs a vector uop per use, as many as the dot itself.
inline int32_t quad_at(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, sizeof v);
  return v;
}

// The row groups of a call: a tile function takes R rows at once (1..kMaxRows), so each tile-block
// is loaded and unpacked once per group of rows, not once per row.
using RowsFn = void (*)(const Job&, int64_t t, int64_t m0);

// One tile for every row: full groups of R rows, then one smaller group for the rest.
template <int R>
void tile_in_row_groups(const Job& job, int64_t t, const RowsFn (&rows)[R + 1]) {
  int64_t m = 0;
  for (; m + R <= job.M; m += R) rows[R](job, t, m);
  if (job.M > m) rows[job.M - m](job, t, m);
}

#ifdef DFLASH_Q4_X86
// R rows (1..8) of one tile. Per block: each of the four 64-byte loads gives two registers of
// unpacked weights (low and high nibbles) that every row uses at once; each row sums its exact
// int32 dot for the block, then takes the same float step as tile_portable. Registers: R chains,
// R float accumulators and a few for the weights, within the 32 of AVX-512.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_rows_avx512(const Job& job, int64_t t,
                                                                               int64_t m0) {
  const int64_t K = job.K, KB = K / kBlock;
  const int8_t* q = job.rows->q.data() + m0 * K;
  const float* sa = job.rows->scale.data() + m0 * KB;
  const int32_t* offset = job.rows->offset.data() + m0 * KB;
  // One dot chain per row is eight dependent VNNI steps; with few rows, two chains per row keep
  // enough independent work in flight to hide their latency (integer sums: the order is free).
  constexpr int kChains = R < 4 ? 2 : 1;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* tb = job.weight + (t * KB + b) * kTileBytes;
    __m512i dot[R][kChains];  // the low-nibble and high-nibble halves of a row's dot
    for (int r = 0; r < R; ++r) {
      dot[r][0] = _mm512_set1_epi32(offset[r * KB + b]);
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
    const __m512 sb = _mm512_loadu_ps(job.scales + (t * KB + b) * kTile);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_mul_ps(_mm512_set1_ps(sa[r * KB + b]), sb);
      const __m512i d = kChains == 2 ? _mm512_add_epi32(dot[r][0], dot[r][1]) : dot[r][0];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[r]);
    }
  }
  const int64_t width = std::min(kTile, job.N - t * kTile);
  const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1u);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(job.y + (m0 + r) * job.N + t * kTile, keep, acc[r]);
}

constexpr int kRowsAvx512 = 8;
const RowsFn rows_avx512[kRowsAvx512 + 1] = {nullptr,
                                             tile_rows_avx512<1>,
                                             tile_rows_avx512<2>,
                                             tile_rows_avx512<3>,
                                             tile_rows_avx512<4>,
                                             tile_rows_avx512<5>,
                                             tile_rows_avx512<6>,
                                             tile_rows_avx512<7>,
                                             tile_rows_avx512<8>};
void tile_avx512(const Job& job, int64_t t) { tile_in_row_groups<kRowsAvx512>(job, t, rows_avx512); }

// The same arithmetic as quantize_portable: max and products are exact or singly rounded alike,
// and the conversion rounds to nearest even (the default MXCSR mode); |a * inv| <= 127 needs no clamp.
__attribute__((target("avx512f,avx512bw"))) void quantize_avx512(const float* a, int64_t blocks, int8_t* q,
                                                                 float* scale, int32_t* offset) {
  for (int64_t blk = 0; blk < blocks; ++blk, a += kBlock, q += kBlock) {
    const __m512 x0 = _mm512_loadu_ps(a), x1 = _mm512_loadu_ps(a + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
    scale[blk] = amax / 127.0f;
    offset[blk] = -8 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

// AVX2 (no VNNI): u8 x s8 products summed in pairs by maddubs; 8 groups of 4 sum to at most
// 8 * 2 * 15 * 127 = 30480 per 16-bit lane, so the integer dot is exact, and the float part is the
// same fma sequence: the same bits as the other paths. Eight columns per register, so each half
// of a tile runs its own pass over the blocks, R rows (1..4) at a time: R int16 sums and R float
// accumulators fit the 16 registers beside the unpacked weights.
// An empty asm that claims to change v: the compiler must hold v in a register here. Without it GCC
// regroups the 32 int16 additions of a row group into a tree over the whole block (integer sums
// may be reordered), which needs more than 16 registers and spills every product to the stack.
__attribute__((target("avx2"))) inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

template <int R>
__attribute__((target("avx2,fma"))) void tile_rows_avx2(const Job& job, int64_t t, int64_t m0) {
  const int64_t K = job.K, KB = K / kBlock;
  const int8_t* q = job.rows->q.data() + m0 * K;
  const float* sa = job.rows->scale.data() + m0 * KB;
  const int32_t* offset = job.rows->offset.data() + m0 * KB;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* tb = job.weight + (t * KB + b) * kTileBytes + 32 * half;
      __m256i pairs[R];
      for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
      for (int c4 = 0; c4 < 4; ++c4) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 64 * c4));
        const __m256i lo = _mm256_and_si256(bytes, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* qb = q + r * K + b * kBlock + 4 * c4;
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(quad_at(qb))));
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(quad_at(qb + 16))));
          keep_in_register(pairs[r]);
        }
      }
      const __m256 sb = _mm256_loadu_ps(job.scales + (t * KB + b) * kTile + 8 * half);
      for (int r = 0; r < R; ++r) {
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(pairs[r], ones), _mm256_set1_epi32(offset[r * KB + b]));
        const __m256 s = _mm256_mul_ps(_mm256_set1_ps(sa[r * KB + b]), sb);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r]);
      }
    }
    const int64_t first = t * kTile + 8 * half, width = std::min<int64_t>(8, job.N - first);
    for (int r = 0; r < R && width > 0; ++r) {
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[r]);
      std::memcpy(job.y + (m0 + r) * job.N + first, out, static_cast<size_t>(width) * sizeof(float));
    }
  }
}

constexpr int kRowsAvx2 = 4;
const RowsFn rows_avx2[kRowsAvx2 + 1] = {nullptr, tile_rows_avx2<1>, tile_rows_avx2<2>, tile_rows_avx2<3>,
                                         tile_rows_avx2<4>};
void tile_avx2(const Job& job, int64_t t) { tile_in_row_groups<kRowsAvx2>(job, t, rows_avx2); }
#endif

using TileFn = void (*)(const Job&, int64_t);
using QuantizeFn = void (*)(const float*, int64_t, int8_t*, float*, int32_t*);

struct Paths {
  TileFn tile = tile_portable;
  QuantizeFn quantize = quantize_portable;
};

// The best path this CPU runs: AVX-512 VNNI, else AVX2+FMA, else portable (all give the same
// bits). DFLASH_OPS_KERNELS=portable|avx2 caps the choice (the tests run every path with it).
Paths select_paths() {
  Paths paths;
  const std::string cap = std::getenv("DFLASH_OPS_KERNELS") ? std::getenv("DFLASH_OPS_KERNELS") : "";
  if (cap == "portable") return paths;
#ifdef DFLASH_Q4_X86
  __builtin_cpu_init();
  if (cap != "avx2" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return {tile_avx512, quantize_avx512};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) paths.tile = tile_avx2;
#endif
  return paths;
}

struct MatMulQ4Kernel {
  int64_t K = 0, N = 0;
  Paths paths;

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded(kName, [&] { Compute(context); });
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    if (ctx.GetInputCount() != 3 || ctx.GetOutputCount() != 1) fail("expects 3 inputs and 1 output");
    const auto a = ctx.GetInput(0), weight = ctx.GetInput(1), scales = ctx.GetInput(2);
    const auto a_shape = a.GetTensorTypeAndShapeInfo().GetShape();
    if (a_shape.empty() || a_shape.back() != K) fail("input a ", shape_str(a_shape), " must end in K = ", K);
    const int64_t T = (N + kTile - 1) / kTile, KB = K / kBlock;
    const std::vector<int64_t> w_want{T, KB, kTileBytes}, s_want{T, KB, kTile};
    const auto w_shape = weight.GetTensorTypeAndShapeInfo().GetShape();
    const auto s_shape = scales.GetTensorTypeAndShapeInfo().GetShape();
    if (w_shape != w_want) fail("weight ", shape_str(w_shape), " must be ", shape_str(w_want), " for K, N = ", K, ", ", N);
    if (s_shape != s_want) fail("scales ", shape_str(s_shape), " must be ", shape_str(s_want), " for K, N = ", K, ", ", N);
    int64_t M = 1;
    for (size_t i = 0; i + 1 < a_shape.size(); ++i) M *= a_shape[i];
    std::vector<int64_t> y_shape = a_shape;
    y_shape.back() = N;
    float* y = ctx.GetOutput(0, y_shape).GetTensorMutableData<float>();
    if (M == 0) return;

    static thread_local QuantizedRows rows;  // pool threads only read it
    const int64_t blocks = M * KB;  // rows are KB blocks wide, so all blocks are contiguous
    rows.q.resize(static_cast<size_t>(M * K));
    rows.scale.resize(static_cast<size_t>(blocks));
    rows.offset.resize(static_cast<size_t>(blocks));
    paths.quantize(a.GetTensorData<float>(), blocks, rows.q.data(), rows.scale.data(), rows.offset.data());
    const Job job{&rows, weight.GetTensorData<uint8_t>(), scales.GetTensorData<float>(), y, M, K, N};
    parallel_for(context, T, [&](int64_t t) { paths.tile(job, t); }, "a tile failed");
  }
};

struct MatMulQ4Op : Ort::CustomOpBase<MatMulQ4Op, MatMulQ4Kernel, /*WithStatus=*/true> {
  MatMulQ4Op() {
    start_ver_ = 1;
    end_ver_ = 1;
  }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const {
    try {
      Ort::ConstKernelInfo ki(info);
      auto kernel = std::make_unique<MatMulQ4Kernel>();
      kernel->K = ki.GetAttribute<int64_t>("K");
      kernel->N = ki.GetAttribute<int64_t>("N");
      if (kernel->K <= 0 || kernel->K % kBlock != 0 || kernel->N <= 0) {
        std::ostringstream os;
        os << kName << ": K = " << kernel->K << " must be a positive multiple of " << kBlock << " and N = "
           << kernel->N << " positive";
        return api.CreateStatus(ORT_INVALID_ARGUMENT, os.str().c_str());
      }
      kernel->paths = select_paths();
      *op_kernel = kernel.release();
      return nullptr;
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (std::string(kName) + ": " + e.what()).c_str());
    }
  }
  const char* GetName() const { return kName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* matmul_q4_op() {
  static MatMulQ4Op op;
  return &op;
}

}  // namespace dflash
