// Inner loops of TreeAttention: portable, AVX2 and AVX-512 versions, chosen at run time.
//
// One work item handles V query vectors that share a kv head (the H/Hkv query heads of a group,
// for one or more query rows) against a range of key rows, in blocks of at most kKeyBlock rows.
// The query vectors sit in SIMD lanes, so the scores of a key row for all V vectors are one
// vector and the online softmax needs no horizontal reductions. Layouts
// (Vp = V rounded up to a multiple of 16, padding lanes hold zeros):
//   qT  [D][Vp]   query vectors, transposed, already multiplied by scale*log2(e)
//   s   [n][Vp]   scores (base-2 logits), then probabilities, of n key rows
//   acc [V][D]    unnormalised output rows
//   k,v [n][D]    key / value rows: a float32 cache's own rows, or rows widened from float16 / q8
#pragma once

#include <cstdint>

#include "kv_format.h"

namespace dflash {

constexpr int64_t kKeyBlock = 64;  // key rows per block; a multiple of 16

struct Kernels {
  const char* name;
  // s[j][m] = sum_d qT[d][m] * k[j][d]   for j < n <= kKeyBlock, m < Vp
  void (*scores)(const float* qT, int64_t Vp, int64_t D, const float* k, int64_t n, float* s);
  // One online-softmax step in base 2, per lane m (masked scores are -inf):
  //   m_new = max(m_run, max_j s[j][m]); alpha[m] = 2^(m_run - m_new);
  //   s[j][m] = 2^(s[j][m] - m_new); l_run = l_run * alpha + sum_j s[j][m]; m_run = m_new.
  // A lane that has seen only -inf keeps m_run = -inf and gets zeros (never NaN).
  void (*softmax)(float* s, int64_t n, int64_t Vp, float* m_run, float* l_run, float* alpha);
  // acc[m][:] = acc[m][:] * alpha[m] + sum_j p[j][m] * v[j][:]   for m < V
  void (*accumulate)(const float* p, int64_t Vp, int64_t V, int64_t n, const float* v, int64_t D,
                     float* acc, const float* alpha);
  // Stored cache rows widened to float32, exactly (kv_format.h): n float16 values, or n_rows
  // rows of the q8 format (row_bytes(q8, D) apart) into n_rows rows of D floats.
  void (*widen_f16)(const uint16_t* h, int64_t n, float* out);
  void (*widen_q8)(const uint8_t* rows, int64_t n_rows, int64_t D, float* out);
};

const Kernels& portable_kernels();
// nullptr when the library was built without x86 dispatch or the CPU lacks the instructions.
const Kernels* avx2_kernels();
const Kernels* avx512_kernels();
// The best kernels this CPU runs: AVX-512, else AVX2+FMA, else portable. The environment
// variable DFLASH_OPS_KERNELS=portable|avx2 caps the choice (used by tests to run every path).
const Kernels& select_kernels();

// The SwiGLU op's loop over one row: out[i] = silu(x[i]) * x[I + i] for i < I, on the path
// select_kernels() picks.
using SwigluFn = void (*)(const float* x, int64_t I, float* out);
SwigluFn select_swiglu();

}  // namespace dflash
