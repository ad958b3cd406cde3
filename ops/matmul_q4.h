// MatMulQ4, the 4-bit weight MatMul whose rows round alike for any row count (matmul_q4.cc).
#pragma once

struct OrtCustomOp;

namespace dflash {
const OrtCustomOp* matmul_q4_op();
}  // namespace dflash
