// SkipRMSNorm: sum = input + skip; output = sum / sqrt(mean(sum^2) + epsilon) * gamma, per row, as
// an ONNX Runtime custom op (domain "ai.dflash", version 1). Outputs: output, sum (the residual
// stream the next layer adds to).
//
// It does what ORT's com.microsoft.SkipSimplifiedLayerNormalization does, without its thread pool
// hand-off: ORT splits even an 8-row call over the pool, and 60 such nodes cost an 8-row int4
// verify of the default model ~0.5 ms (measured by deleting them), while a one-row call runs
// inline. Here small calls run on the calling thread (for_each_row, op_support.h). Each row's
// arithmetic is the same whatever the row count (16 running sums in a fixed order), so a row
// verified with others gets the bits it gets alone.

#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "op_support.h"

namespace dflash {
namespace {

constexpr int64_t kLanes = 16;  // running sums of squares per row

void norm_row(const float* x, const float* skip, const float* gamma, float eps, int64_t H, float* out, float* sum) {
  float part[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= H; k += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      const float s = x[k + j] + skip[k + j];
      sum[k + j] = s;
      part[j] += s * s;
    }
  for (int64_t j = 0; k + j < H; ++j) {
    const float s = x[k + j] + skip[k + j];
    sum[k + j] = s;
    part[j] += s * s;
  }
  for (int64_t width = kLanes / 2; width > 0; width /= 2)  // pairwise, in a fixed order
    for (int64_t j = 0; j < width; ++j) part[j] += part[j + width];
  const float inv = 1.0f / std::sqrt(part[0] / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = sum[i] * inv * gamma[i];
}

struct SkipRMSNormKernel {
  float epsilon = 0.0f;

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded("SkipRMSNorm", [&] { Compute(context); });
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    if (ctx.GetInputCount() != 3 || ctx.GetOutputCount() != 2)
      fail_in("SkipRMSNorm", "expects 3 inputs (input, skip, gamma) and 2 outputs (output, sum)");
    const auto x = ctx.GetInput(0), skip = ctx.GetInput(1), gamma = ctx.GetInput(2);
    const auto shape = x.GetTensorTypeAndShapeInfo().GetShape();
    const auto skip_shape = skip.GetTensorTypeAndShapeInfo().GetShape();
    const auto gamma_shape = gamma.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty()) fail_in("SkipRMSNorm", "input must have at least one dimension");
    const int64_t H = shape.back();
    if (skip_shape != shape)
      fail_in("SkipRMSNorm", "skip ", shape_str(skip_shape), " must have the input's shape ", shape_str(shape));
    if (gamma_shape != std::vector<int64_t>{H})
      fail_in("SkipRMSNorm", "gamma ", shape_str(gamma_shape), " must be [", H, "], the input's last dimension");
    const int64_t M = leading_rows(shape);
    float* out = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    float* sum = ctx.GetOutput(1, shape).GetTensorMutableData<float>();
    const float* xs = x.GetTensorData<float>();
    const float* ss = skip.GetTensorData<float>();
    const float* g = gamma.GetTensorData<float>();
    for_each_row(context, M, M * H, [&](int64_t m) {
      norm_row(xs + m * H, ss + m * H, g, epsilon, H, out + m * H, sum + m * H);
    }, "SkipRMSNorm failed");
  }
};

struct SkipRMSNormOp : Ort::CustomOpBase<SkipRMSNormOp, SkipRMSNormKernel, /*WithStatus=*/true> {
  SkipRMSNormOp() {
    start_ver_ = 1;
    end_ver_ = 1;
  }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const {
    try {
      auto kernel = std::make_unique<SkipRMSNormKernel>();
      kernel->epsilon = Ort::ConstKernelInfo(info).GetAttribute<float>("epsilon");
      if (!(kernel->epsilon >= 0.0f)) {
        std::ostringstream os;
        os << "SkipRMSNorm: epsilon = " << kernel->epsilon << " must be >= 0";
        return api.CreateStatus(ORT_INVALID_ARGUMENT, os.str().c_str());
      }
      *op_kernel = kernel.release();
      return nullptr;
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (std::string("SkipRMSNorm: ") + e.what()).c_str());
    }
  }
  const char* GetName() const { return "SkipRMSNorm"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* skip_rms_norm_op() {
  static SkipRMSNormOp op;
  return &op;
}

}  // namespace dflash
