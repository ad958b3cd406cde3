// The quantized MatMul ops' shared part (quantized_matmul.h): activation quantization (portable,
// AVX2 and AVX-512, the same bits), the kernel path choice, and the op around an op's tile functions.

#include "quantized_matmul.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>

#ifdef DFLASH_QMM_X86
// GCC 12 warns about _mm512_undefined_* inside its own intrinsics (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace dflash {
namespace {

// Runs of tiles a MatMul call is cut into for the pool: enough for a few threads to balance.
constexpr int64_t kTileBatches = 16;

using QuantizeFn = void (*)(const float* a, int64_t blocks, int32_t zero, int8_t* q, float* scale, int32_t* offset,
                            float* total);

// Quantize `blocks` consecutive blocks of 32 activations, with each block's zero-point term for
// weights stored with zero point `zero` and its dequantized sum (see quantized_matmul.h).
void quantize_portable(const float* a, int64_t blocks, int32_t zero, int8_t* q, float* scale, int32_t* offset,
                       float* total) {
  for (int64_t blk = 0; blk < blocks; ++blk, a += kQBlock, q += kQBlock) {
    float amax = 0.0f;
    for (int64_t k = 0; k < kQBlock; ++k) amax = std::max(amax, std::fabs(a[k]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
    for (int64_t k = 0; k < kQBlock; ++k) {
      const float r = std::nearbyint(a[k] * inv);  // the default rounding: to nearest even
      q[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
      s += q[k];
    }
    scale[blk] = amax / 127.0f;
    offset[blk] = -zero * s;
    total[blk] = scale[blk] * static_cast<float>(s);
  }
}

#ifdef DFLASH_QMM_X86
// The same arithmetic as quantize_portable: max and products are exact or singly rounded alike,
// and the conversion rounds to nearest even (the default MXCSR mode); |a * inv| <= 127 needs no clamp.
__attribute__((target("avx512f,avx512bw"))) void quantize_avx512(const float* a, int64_t blocks, int32_t zero,
                                                                 int8_t* q, float* scale, int32_t* offset,
                                                                 float* total) {
  for (int64_t blk = 0; blk < blocks; ++blk, a += kQBlock, q += kQBlock) {
    const __m512 x0 = _mm512_loadu_ps(a), x1 = _mm512_loadu_ps(a + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
    const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    scale[blk] = amax / 127.0f;
    offset[blk] = -zero * s;
    total[blk] = scale[blk] * static_cast<float>(s);
  }
}

// The same again in 256-bit registers. The portable loop is no substitute on an AVX2 CPU: the
// baseline ISA has no rounding instruction, so it calls nearbyintf once per activation, and at 8
// rows that call was a third of an int4 verify's time on the AVX2 path.
__attribute__((target("avx2,fma"))) void quantize_avx2(const float* a, int64_t blocks, int32_t zero, int8_t* q,
                                                       float* scale, int32_t* offset, float* total) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i byte_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the per-lane packs
  for (int64_t blk = 0; blk < blocks; ++blk, a += kQBlock, q += kQBlock) {
    __m256 x[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      x[i] = _mm256_loadu_ps(a + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, x[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, byte_order));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const int32_t s = _mm_cvtsi128_si32(s4);
    scale[blk] = amax / 127.0f;
    offset[blk] = -zero * s;
    total[blk] = scale[blk] * static_cast<float>(s);
  }
}
#endif

QuantizeFn quantize_for(KernelPath path) {
#ifdef DFLASH_QMM_X86
  if (path == KernelPath::avx512) return quantize_avx512;
  if (path == KernelPath::avx2) return quantize_avx2;
#endif
  (void)path;
  return quantize_portable;
}

struct QuantizedMatMulKernel {
  const QuantizedFormat* format = nullptr;
  int64_t K = 0, N = 0;
  bool split_activations = false;  // attribute split_activations = 1 (see quantize_split)
  TileFn tile = nullptr;
  QuantizeFn quantize = nullptr;

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded(format->name, [&] { Compute(context); });
  }

  template <typename... Args>
  [[noreturn]] void fail(const Args&... args) const {
    fail_in(format->name, args...);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    const size_t inputs = ctx.GetInputCount();
    if (inputs < 3 || inputs > 4 || ctx.GetOutputCount() != 1) fail("expects 3 or 4 inputs and 1 output");
    const auto a = ctx.GetInput(0), weight = ctx.GetInput(1), scales = ctx.GetInput(2);
    const auto offsets = inputs == 4 ? ctx.GetInput(3) : Ort::ConstValue{nullptr};
    const bool asymmetric = static_cast<const OrtValue*>(offsets) != nullptr;
    const auto scale_type = scales.GetTensorTypeAndShapeInfo().GetElementType();
    const bool half = scale_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    if (!half && scale_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) fail("scales must be float or float16");
    if (asymmetric && offsets.GetTensorTypeAndShapeInfo().GetElementType() != scale_type)
      fail("offsets must have the scales' type (float or float16)");
    const auto a_shape = a.GetTensorTypeAndShapeInfo().GetShape();
    if (a_shape.empty() || a_shape.back() != K) fail("input a ", shape_str(a_shape), " must end in K = ", K);
    const int64_t T = (N + kQTile - 1) / kQTile, KB = K / kQBlock;
    const std::vector<int64_t> w_want{T, KB, format->tile_bytes}, s_want{T, KB, kQTile};
    const auto w_shape = weight.GetTensorTypeAndShapeInfo().GetShape();
    const auto s_shape = scales.GetTensorTypeAndShapeInfo().GetShape();
    if (w_shape != w_want) fail("weight ", shape_str(w_shape), " must be ", shape_str(w_want), " for K, N = ", K, ", ", N);
    if (s_shape != s_want) fail("scales ", shape_str(s_shape), " must be ", shape_str(s_want), " for K, N = ", K, ", ", N);
    if (asymmetric) {
      const auto o_shape = offsets.GetTensorTypeAndShapeInfo().GetShape();
      if (o_shape != s_want) fail("offsets ", shape_str(o_shape), " must be ", shape_str(s_want), " (as scales)");
    }
    const int64_t M = leading_rows(a_shape);
    std::vector<int64_t> y_shape = a_shape;
    y_shape.back() = N;
    float* y = ctx.GetOutput(0, y_shape).GetTensorMutableData<float>();
    if (M == 0) return;

    // Asymmetric codes have no zero point: their offset term is the float one (total x offsets).
    const int32_t zero = asymmetric ? 0 : format->zero_point;
    // split_activations: each row is two quantized rows, itself and what its rounding left, whose
    // products are summed into y afterwards
    const int64_t rows_in = split_activations ? 2 * M : M;
    static thread_local QuantizedRows rows;  // pool threads only read it
    const int64_t blocks = rows_in * KB;     // rows are KB blocks wide, so all blocks are contiguous
    rows.q.resize(static_cast<size_t>(rows_in * K));
    rows.scale.resize(static_cast<size_t>(blocks));
    rows.offset.resize(static_cast<size_t>(blocks));
    rows.total.resize(static_cast<size_t>(blocks));
    static thread_local std::vector<float> partial;
    float* out = y;
    if (split_activations) {
      quantize_split(a.GetTensorData<float>(), M, zero, rows);
      partial.resize(static_cast<size_t>(rows_in * N));
      out = partial.data();
    } else {
      quantize(a.GetTensorData<float>(), blocks, zero, rows.q.data(), rows.scale.data(), rows.offset.data(),
               rows.total.data());
    }
    const Job job{&rows, weight.GetTensorData<uint8_t>(), scales.GetTensorRawData(),
                  asymmetric ? offsets.GetTensorRawData() : nullptr, half, out, rows_in, K, N, format->tile_bytes};
    // Tiles in kTileBatches runs: taking thousands of tiles one by one (the lm_head has 3072)
    // costs an atomic add on a counter both cores write, per tile.
    parallel_for(context, T, [&](int64_t t) { tile(job, t); }, "a tile failed", std::min<int64_t>(T, kTileBatches));
    if (split_activations)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) y[m * N + n] = partial[(2 * m) * N + n] + partial[(2 * m + 1) * N + n];
  }

  // split_activations: row m of a [M, K] goes to quantized rows 2m (a itself) and 2m + 1 (its
  // residual r = a - sa * q, in double, where sa * q is exact, then rounded to float once, and
  // quantized like any row), so that the two rows' products sum to ~15-bit activations (the
  // residual's own int8 rounding is 1/254 of the row's).
  void quantize_split(const float* a, int64_t M, int32_t zero, QuantizedRows& rows) const {
    const int64_t KB = K / kQBlock;
    static thread_local std::vector<float> residual;
    residual.resize(static_cast<size_t>(K));
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t r = 2 * m + half;
        quantize(half ? residual.data() : a + m * K, KB, zero, rows.q.data() + r * K, rows.scale.data() + r * KB,
                 rows.offset.data() + r * KB, rows.total.data() + r * KB);
        if (half) continue;
        for (int64_t k = 0; k < K; ++k) {
          const double sq = static_cast<double>(rows.scale[r * KB + k / kQBlock]) * rows.q[r * K + k];
          residual[k] = static_cast<float>(static_cast<double>(a[m * K + k]) - sq);
        }
      }
    }
  }
};

struct QuantizedMatMulOp : Ort::CustomOpBase<QuantizedMatMulOp, QuantizedMatMulKernel, /*WithStatus=*/true> {
  const QuantizedFormat* format;

  explicit QuantizedMatMulOp(const QuantizedFormat& f) : format(&f) {
    start_ver_ = 1;
    end_ver_ = 1;
  }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const {
    try {
      Ort::ConstKernelInfo ki(info);
      auto kernel = std::make_unique<QuantizedMatMulKernel>();
      kernel->format = format;
      kernel->K = ki.GetAttribute<int64_t>("K");
      kernel->N = ki.GetAttribute<int64_t>("N");
      int64_t split = 0;
      if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, "split_activations", &split))
        api.ReleaseStatus(st);  // absent: one int8 row per row
      kernel->split_activations = split != 0;
      if (kernel->K <= 0 || kernel->K % kQBlock != 0 || kernel->N <= 0) {
        std::ostringstream os;
        os << format->name << ": K = " << kernel->K << " must be a positive multiple of " << kQBlock
           << " and N = " << kernel->N << " positive";
        return api.CreateStatus(ORT_INVALID_ARGUMENT, os.str().c_str());
      }
      const KernelPath path = best_path();  // chosen once, when the session creates the kernel
      kernel->tile = format->tile_for(path);
      kernel->quantize = quantize_for(path);
      *op_kernel = kernel.release();
      return nullptr;
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (std::string(format->name) + ": " + e.what()).c_str());
    }
  }
  const char* GetName() const { return format->name; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 4; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 3 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                      : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    if (index == 1) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    if (index >= 2) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // float or float16: checked in Compute
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

KernelPath best_path() {
  const char* env = std::getenv("DFLASH_OPS_KERNELS");
  const std::string cap = env ? env : "";
  if (cap == "portable") return KernelPath::portable;
#ifdef DFLASH_QMM_X86
  __builtin_cpu_init();
  if (cap != "avx2" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return KernelPath::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return KernelPath::avx2;
#endif
  return KernelPath::portable;
}

const OrtCustomOp* matmul_q4_op() {
  static QuantizedMatMulOp op(q4_format);
  return &op;
}

const OrtCustomOp* matmul_q8_op() {
  static QuantizedMatMulOp op(q8_format);
  return &op;
}

}  // namespace dflash
