// SwiGLU: out = silu(x[..., :I]) * x[..., I:] for x [..., 2I], as an ONNX Runtime custom op
// (domain "ai.dflash", version 1): the MLP's activation after the fused gate|up projection.
//
// One node where the plain graph has three (Split, and Sigmoid + two Mul, which ORT fuses into
// QuickGelu + Mul): deleting those nodes from the int4 default model saved ~0.2 ms a forward at
// 1 and at 8 rows. Small calls run on the calling thread (for_each_row, op_support.h); the loop
// is elementwise (kernels.cc), so a row's values never depend on the other rows.

#include <memory>
#include <string>

#include "kernels.h"
#include "op_support.h"

namespace dflash {
namespace {

struct SwigluKernel {
  SwigluFn swiglu = nullptr;

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded("SwiGLU", [&] { Compute(context); });
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    if (ctx.GetInputCount() != 1 || ctx.GetOutputCount() != 1) fail_in("SwiGLU", "expects 1 input and 1 output");
    const auto x = ctx.GetInput(0);
    auto shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() % 2 != 0)
      fail_in("SwiGLU", "input ", shape_str(shape), " must end in an even dimension (gate | up)");
    const int64_t I = shape.back() / 2;
    const int64_t M = leading_rows(shape);
    shape.back() = I;
    float* out = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    const float* xs = x.GetTensorData<float>();
    for_each_row(context, M, M * I, [&](int64_t m) { swiglu(xs + 2 * I * m, I, out + I * m); }, "SwiGLU failed");
  }
};

struct SwigluOp : Ort::CustomOpBase<SwigluOp, SwigluKernel, /*WithStatus=*/true> {
  SwigluOp() {
    start_ver_ = 1;
    end_ver_ = 1;
  }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo*, void** op_kernel) const {
    auto kernel = std::make_unique<SwigluKernel>();
    kernel->swiglu = select_swiglu();  // DFLASH_OPS_KERNELS=portable picks the portable loop
    *op_kernel = kernel.release();
    return nullptr;
  }
  const char* GetName() const { return "SwiGLU"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* swiglu_op() {
  static SwigluOp op;
  return &op;
}

}  // namespace dflash
