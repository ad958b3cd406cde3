// Portable, AVX2 and AVX-512 inner loops of TreeAttention (see kernels.h for the data layouts).
//
// The AVX2 / AVX-512 functions carry __attribute__((target(...))) and are only called after
// __builtin_cpu_supports said yes, so the library still loads and runs on any x86-64 CPU (and
// builds elsewhere with the portable path only). Everything here has internal linkage: no
// AVX-512 copy of an inline function can be picked by the linker for use on another path.

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(DFLASH_NO_SIMD_DISPATCH)
#define DFLASH_HAVE_X86_DISPATCH 1
#define DFLASH_HAVE_AVX512 1
#include <cpuid.h>
#include <immintrin.h>
// GCC 12 warns about _mm512_undefined_ps() inside its own intrinsics (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace dflash {
namespace {

// 2^f = e^(f ln2) for |f| <= 0.5: Taylor coefficients ln2^k / k!, truncation error < 6e-9.
constexpr float kC1 = 0.6931471805599453f;
constexpr float kC2 = 0.2402265069591007f;
constexpr float kC3 = 0.05550410866482158f;
constexpr float kC4 = 0.009618129107628477f;
constexpr float kC5 = 0.0013333558146428443f;
constexpr float kC6 = 0.00015403530393381608f;
constexpr float kC7 = 1.525273380405984e-05f;

// ---------------------------------------------------------------------------------------------
// Generic path, written with GCC/Clang vector extensions. F is a native SIMD vector type of the
// target: 4 floats for the baseline build (SSE2 on x86-64, NEON on arm64), 8 floats for a copy
// compiled with target("avx2,fma") for x86 CPUs without AVX-512. A block of 16 query lanes is
// 16/W vectors; the accumulators are small arrays of F with fixed sizes, so they live in
// registers. The bodies are always inlined into the entry points below.
#define DFLASH_BODY inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi"  // vector arguments of always-inlined helpers: no ABI
constexpr int kL = 16;                    // lanes per block, as in the AVX-512 path

typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi4 __attribute__((vector_size(16)));
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef float vf16 __attribute__((vector_size(64)));  // only the AVX-512 SwiGLU loop uses these
typedef int32_t vi16 __attribute__((vector_size(64)));
template <class F> struct IntVec;
template <> struct IntVec<vf4> { typedef vi4 type; };
template <> struct IntVec<vf8> { typedef vi8 type; };
template <> struct IntVec<vf16> { typedef vi16 type; };

template <class F> DFLASH_BODY F load(const float* p) {
  F v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class F> DFLASH_BODY void store(float* p, const F& v) { std::memcpy(p, &v, sizeof v); }
template <class F> DFLASH_BODY F splat(float x) { return F{} + x; }

// 2^x for x <= 0 (what the softmax needs). Exactly 0 below -125 (so masked keys, at -inf, give 0).
template <class F> DFLASH_BODY F exp2_generic(const F& x) {
  typedef typename IntVec<F>::type I;
  const F lo = splat<F>(-125.0f), zero = splat<F>(0.0f);
  F xc = x < lo ? lo : x;
  xc = xc > zero ? zero : xc;
  const I n = __builtin_convertvector(xc + 126.5f, I) - 126;  // round to nearest; the sum is > 0
  const F f = xc - __builtin_convertvector(n, F);             // in [-0.5, 0.5]
  F p = splat<F>(kC7);
  p = p * f + kC6;
  p = p * f + kC5;
  p = p * f + kC4;
  p = p * f + kC3;
  p = p * f + kC2;
  p = p * f + kC1;
  p = p * f + 1.0f;
  const I bits = (n + 127) << 23;  // 2^n as a float bit pattern
  F two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < lo ? zero : p * two_n;
}

// NK key rows x 16 lanes of scores.
template <class F, int NK>
DFLASH_BODY void scores_rows_generic(const float* qT, int64_t Vp, int64_t D, const float* k, float* s) {
  constexpr int W = sizeof(F) / sizeof(float), NV = kL / W;
  F acc[NK][NV];
  _Pragma("GCC unroll 16") for (int j = 0; j < NK; ++j)
    _Pragma("GCC unroll 16") for (int z = 0; z < NV; ++z) acc[j][z] = splat<F>(0.0f);
  for (int64_t d = 0; d < D; ++d) {
    F q[NV];
    _Pragma("GCC unroll 16") for (int z = 0; z < NV; ++z) q[z] = load<F>(qT + d * Vp + W * z);
    _Pragma("GCC unroll 16") for (int j = 0; j < NK; ++j) {
      const float kd = k[j * D + d];
      _Pragma("GCC unroll 16") for (int z = 0; z < NV; ++z) acc[j][z] += q[z] * kd;
    }
  }
  _Pragma("GCC unroll 16") for (int j = 0; j < NK; ++j)
    _Pragma("GCC unroll 16") for (int z = 0; z < NV; ++z) store(s + j * Vp + W * z, acc[j][z]);
}

template <class F>
DFLASH_BODY void scores_generic(const float* qT, int64_t Vp, int64_t D, const float* k, int64_t n, float* s) {
  // NK key rows x 16 lanes: 12 SSE/NEON or 12 AVX2 accumulators (16 registers on SSE and AVX2)
  constexpr int NK = sizeof(F) == 32 ? 6 : 3;
  for (int64_t m = 0; m < Vp; m += kL) {
    int64_t j = 0;
    for (; j + NK <= n; j += NK) scores_rows_generic<F, NK>(qT + m, Vp, D, k + j * D, s + j * Vp + m);
    for (; j < n; ++j) scores_rows_generic<F, 1>(qT + m, Vp, D, k + j * D, s + j * Vp + m);
  }
}

template <class F>
DFLASH_BODY void softmax_generic(float* s, int64_t n, int64_t Vp, float* m_run, float* l_run, float* alpha) {
  constexpr int W = sizeof(F) / sizeof(float);
  const F neg_inf = splat<F>(-std::numeric_limits<float>::infinity()), zero = splat<F>(0.0f);
  for (int64_t m = 0; m < Vp; m += W) {
    const F m_old = load<F>(m_run + m);
    F mx = m_old;
    for (int64_t j = 0; j < n; ++j) {
      const F x = load<F>(s + j * Vp + m);
      mx = x > mx ? x : mx;
    }
    const F ref = mx == neg_inf ? zero : mx;  // nothing seen yet: exps are 0, not NaN
    F sum = zero;
    for (int64_t j = 0; j < n; ++j) {
      const F p = exp2_generic(load<F>(s + j * Vp + m) - ref);
      store(s + j * Vp + m, p);
      sum += p;
    }
    const F a = exp2_generic(m_old - ref);
    store(alpha + m, a);
    store(l_run + m, load<F>(l_run + m) * a + sum);
    store(m_run + m, mx);
  }
}

// NM output rows x 16 columns kept in registers while the value rows stream through.
template <class F, int NM>
DFLASH_BODY void accumulate_cols_generic(const float* p, int64_t Vp, int64_t n, const float* v, int64_t D,
                                         float* acc, const float* alpha) {
  constexpr int W = sizeof(F) / sizeof(float), NV = kL / W;
  F a[NM][NV];
  _Pragma("GCC unroll 16") for (int m = 0; m < NM; ++m)
    _Pragma("GCC unroll 16") for (int z = 0; z < NV; ++z) a[m][z] = load<F>(acc + m * D + W * z) * alpha[m];
  for (int64_t j = 0; j < n; ++j) {
    F vj[NV];
    _Pragma("GCC unroll 16") for (int z = 0; z < NV; ++z) vj[z] = load<F>(v + j * D + W * z);
    _Pragma("GCC unroll 16") for (int m = 0; m < NM; ++m) {
      const float pj = p[j * Vp + m];
      _Pragma("GCC unroll 16") for (int z = 0; z < NV; ++z) a[m][z] += pj * vj[z];
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < NM; ++m)
    _Pragma("GCC unroll 16") for (int z = 0; z < NV; ++z) store(acc + m * D + W * z, a[m][z]);
}

template <class F>
DFLASH_BODY void accumulate_generic(const float* p, int64_t Vp, int64_t V, int64_t n, const float* v, int64_t D,
                                    float* acc, const float* alpha) {
  // NM rows x 16 columns: 12 SSE/NEON or 12 AVX2 accumulators plus the value vectors
  constexpr int NM = sizeof(F) == 32 ? 6 : 3;
  const int64_t D16 = D / kL * kL;
  int64_t m = 0;
  for (; m + NM <= V; m += NM)
    for (int64_t d = 0; d < D16; d += kL)
      accumulate_cols_generic<F, NM>(p + m, Vp, n, v + d, D, acc + m * D + d, alpha + m);
  for (; m + 3 <= V; m += 3)
    for (int64_t d = 0; d < D16; d += kL)
      accumulate_cols_generic<F, 3>(p + m, Vp, n, v + d, D, acc + m * D + d, alpha + m);
  for (; m < V; ++m)
    for (int64_t d = 0; d < D16; d += kL)
      accumulate_cols_generic<F, 1>(p + m, Vp, n, v + d, D, acc + m * D + d, alpha + m);
  for (int64_t r = 0; r < V && D16 < D; ++r) {  // the last D % 16 columns, plainly
    float* ar = acc + r * D;
    for (int64_t d = D16; d < D; ++d) ar[d] *= alpha[r];
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = D16; d < D; ++d) ar[d] += p[j * Vp + r] * v[j * D + d];
  }
}

// SwiGLU of one row: out[i] = silu(x[i]) * x[I + i]. silu(g) = g * sigmoid(g), and sigmoid is
// taken from t = 2^(-|g| log2 e) <= 1 (the exponent exp2_generic needs): 1/(1+t) for g >= 0,
// t/(1+t) below. Lanes are independent, so a row's values do not depend on its neighbours.
template <class F>
DFLASH_BODY void swiglu_generic(const float* x, int64_t I, float* out) {
  constexpr int W = sizeof(F) / sizeof(float);
  const F zero = splat<F>(0.0f), one = splat<F>(1.0f), minus_log2e = splat<F>(-1.4426950408889634f);
  auto row = [&](const F& g, const F& u) {
    const F t = exp2_generic((g < zero ? -g : g) * minus_log2e);
    const F sigmoid = (g < zero ? t : one) / (one + t);
    return g * sigmoid * u;
  };
  int64_t i = 0;
  for (; i + W <= I; i += W) store(out + i, row(load<F>(x + i), load<F>(x + I + i)));
  if (i < I) {  // the last I % W values through a zero-padded vector
    float g[W] = {}, u[W] = {}, o[W];
    std::memcpy(g, x + i, (I - i) * sizeof(float));
    std::memcpy(u, x + I + i, (I - i) * sizeof(float));
    store(o, row(load<F>(g), load<F>(u)));
    std::memcpy(out + i, o, (I - i) * sizeof(float));
  }
}

// Cache rows widened to float32 (kv_format.h), exactly: a float16's bits rebuilt (normal values
// rebias the exponent; subnormals are m * 2^-24, exact in float32); a q8 value is its int8 times
// the block's scale, one rounding. The SIMD paths below give the same floats.
inline float widen_half(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t bits = sign | ((e + 112) << 23) | (m << 13);
  if (e == 31) bits = sign | 0x7f800000u | (m << 13);
  if (e == 0) {
    const float tiny = static_cast<float>(m) * 5.9604644775390625e-08f;
    std::memcpy(&bits, &tiny, sizeof bits);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

void widen_f16_portable(const uint16_t* h, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = widen_half(h[i]);
}

void widen_q8_portable(const uint8_t* rows, int64_t n_rows, int64_t D, float* out) {
  const int64_t stride = row_bytes(KvFormat::q8, D);
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t b = 0; b < q8_blocks(D); ++b) {
      float s;
      std::memcpy(&s, rows + r * stride + D + 4 * b, sizeof s);
      for (int64_t d = b * kQ8Block; d < std::min(D, (b + 1) * kQ8Block); ++d)
        out[r * D + d] = static_cast<float>(static_cast<int8_t>(rows[r * stride + d])) * s;
    }
}

void scores_portable(const float* qT, int64_t Vp, int64_t D, const float* k, int64_t n, float* s) {
  scores_generic<vf4>(qT, Vp, D, k, n, s);
}
void softmax_portable(float* s, int64_t n, int64_t Vp, float* m_run, float* l_run, float* alpha) {
  softmax_generic<vf4>(s, n, Vp, m_run, l_run, alpha);
}
void accumulate_portable(const float* p, int64_t Vp, int64_t V, int64_t n, const float* v, int64_t D,
                         float* acc, const float* alpha) {
  accumulate_generic<vf4>(p, Vp, V, n, v, D, acc, alpha);
}
const Kernels kPortable = {"portable", scores_portable, softmax_portable, accumulate_portable,
                           widen_f16_portable, widen_q8_portable};
void swiglu_portable(const float* x, int64_t I, float* out) { swiglu_generic<vf4>(x, I, out); }

#ifdef DFLASH_HAVE_X86_DISPATCH
#define DFLASH_AVX2 __attribute__((target("avx2,fma")))
#define DFLASH_F16C __attribute__((target("avx2,fma,f16c")))
DFLASH_AVX2 void scores_avx2(const float* qT, int64_t Vp, int64_t D, const float* k, int64_t n, float* s) {
  scores_generic<vf8>(qT, Vp, D, k, n, s);
}
DFLASH_AVX2 void softmax_avx2(float* s, int64_t n, int64_t Vp, float* m_run, float* l_run, float* alpha) {
  softmax_generic<vf8>(s, n, Vp, m_run, l_run, alpha);
}
DFLASH_AVX2 void accumulate_avx2(const float* p, int64_t Vp, int64_t V, int64_t n, const float* v, int64_t D,
                                 float* acc, const float* alpha) {
  accumulate_generic<vf8>(p, Vp, V, n, v, D, acc, alpha);
}
// The AVX2 path also requires F16C (every AVX2 CPU has it): vcvtph2ps is exact, as widen_half.
DFLASH_F16C void widen_f16_avx2(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) out[i] = widen_half(h[i]);
}
DFLASH_AVX2 void widen_q8_avx2(const uint8_t* rows, int64_t n_rows, int64_t D, float* out) {
  const int64_t stride = row_bytes(KvFormat::q8, D);
  for (int64_t r = 0; r < n_rows; ++r) {
    const uint8_t* row = rows + r * stride;
    float* dst = out + r * D;
    for (int64_t b = 0; b < q8_blocks(D); ++b) {
      float s;
      std::memcpy(&s, row + D + 4 * b, sizeof s);
      const __m256 scale = _mm256_set1_ps(s);
      const int64_t d1 = std::min(D, (b + 1) * kQ8Block);
      int64_t d = b * kQ8Block;
      for (; d + 8 <= d1; d += 8) {  // 8 int8 -> 8 int32 -> 8 floats, times the block's scale
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d));
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale));
      }
      for (; d < d1; ++d) dst[d] = static_cast<float>(static_cast<int8_t>(row[d])) * s;
    }
  }
}
const Kernels kAvx2 = {"avx2", scores_avx2, softmax_avx2, accumulate_avx2, widen_f16_avx2,
                       widen_q8_avx2};
DFLASH_AVX2 void swiglu_avx2(const float* x, int64_t I, float* out) { swiglu_generic<vf8>(x, I, out); }
#endif

// ---------------------------------------------------------------------------------------------
// AVX-512 path.
#ifdef DFLASH_HAVE_AVX512
#define DFLASH_AVX512 __attribute__((target("avx512f")))

DFLASH_AVX512 inline __m512 exp2_avx512(__m512 x) {
  // Clamp below at -200 so -inf gives 0 (2^-200 underflows to 0 in scalef) instead of NaN;
  // max(-200, NaN) keeps the NaN. x <= 0 here, so no upper clamp is needed.
  x = _mm512_max_ps(_mm512_set1_ps(-200.0f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kC7);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC5));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);  // p * 2^n, handles underflow
}

// Scores of NK key rows for NZ*16 query lanes. The NK*NZ accumulators stay in registers; per d
// the kernel loads NZ query vectors and broadcasts NK key elements. 16 accumulators (8 x 2) keep
// both FMA ports busy despite the 4-cycle FMA latency; more than that spills.
template <int NK, int NZ>
DFLASH_AVX512 inline void scores_tile(const float* qT, int64_t Vp, int64_t D, const float* k, float* s) {
  __m512 acc[NK][NZ];
  _Pragma("GCC unroll 8") for (int j = 0; j < NK; ++j)
    _Pragma("GCC unroll 8") for (int z = 0; z < NZ; ++z) acc[j][z] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 qv[NZ];
    _Pragma("GCC unroll 8") for (int z = 0; z < NZ; ++z) qv[z] = _mm512_loadu_ps(qT + d * Vp + 16 * z);
    _Pragma("GCC unroll 8") for (int j = 0; j < NK; ++j) {
      const __m512 kb = _mm512_set1_ps(k[j * D + d]);
      _Pragma("GCC unroll 8") for (int z = 0; z < NZ; ++z) acc[j][z] = _mm512_fmadd_ps(qv[z], kb, acc[j][z]);
    }
  }
  _Pragma("GCC unroll 8") for (int j = 0; j < NK; ++j)
    _Pragma("GCC unroll 8") for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(s + j * Vp + 16 * z, acc[j][z]);
}

template <int NZ>
DFLASH_AVX512 void scores_lanes(const float* qT, int64_t Vp, int64_t D, const float* k, int64_t n, float* s) {
  constexpr int NK = 8;
  int64_t j = 0;
  for (; j + NK <= n; j += NK) scores_tile<NK, NZ>(qT, Vp, D, k + j * D, s + j * Vp);
  for (; j < n; ++j) scores_tile<1, NZ>(qT, Vp, D, k + j * D, s + j * Vp);
}

DFLASH_AVX512 void scores_avx512(const float* qT, int64_t Vp, int64_t D, const float* k, int64_t n, float* s) {
  int64_t m = 0;
  for (; m + 32 <= Vp; m += 32) scores_lanes<2>(qT + m, Vp, D, k, n, s + m);
  for (; m < Vp; m += 16) scores_lanes<1>(qT + m, Vp, D, k, n, s + m);
}

DFLASH_AVX512 void softmax_avx512(float* s, int64_t n, int64_t Vp, float* m_run, float* l_run, float* alpha) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < Vp; m += 16) {
    const __m512 m_old = _mm512_loadu_ps(m_run + m);
    __m512 mx = m_old;
    for (int64_t j = 0; j < n; ++j) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j * Vp + m));
    // Lanes that have seen nothing but -inf use 0 as the reference, so their exps are 0, not NaN.
    const __mmask16 dead = _mm512_cmp_ps_mask(mx, neg_inf, _CMP_EQ_OQ);
    const __m512 ref = _mm512_mask_blend_ps(dead, mx, _mm512_setzero_ps());
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m512 p = exp2_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + j * Vp + m), ref));
      _mm512_storeu_ps(s + j * Vp + m, p);
      sum = _mm512_add_ps(sum, p);
    }
    const __m512 a = exp2_avx512(_mm512_sub_ps(m_old, ref));
    _mm512_storeu_ps(alpha + m, a);
    _mm512_storeu_ps(l_run + m, _mm512_fmadd_ps(_mm512_loadu_ps(l_run + m), a, sum));
    _mm512_storeu_ps(m_run + m, mx);
  }
}

// Output rows m < NM, columns [0, 16*NZ) kept in registers while the n value rows stream through:
// per value row, NZ loads and NM broadcasts feed NM*NZ FMAs. With TAIL, the last vector covers
// only the columns in `tail` (masked loads/stores never touch memory outside the row).
template <int NM, int NZ, bool TAIL>
DFLASH_AVX512 void accumulate_tile(const float* p, int64_t Vp, int64_t n, const float* v, int64_t D,
                                   float* acc, const float* alpha, __mmask16 tail) {
  const __mmask16 last = TAIL ? tail : static_cast<__mmask16>(0xFFFF);
  __m512 a[NM][NZ];
  _Pragma("GCC unroll 8") for (int m = 0; m < NM; ++m) {
    const __m512 am = _mm512_set1_ps(alpha[m]);
    _Pragma("GCC unroll 8") for (int z = 0; z < NZ; ++z) {
      const float* src = acc + m * D + 16 * z;
      a[m][z] = _mm512_mul_ps(TAIL && z == NZ - 1 ? _mm512_maskz_loadu_ps(last, src) : _mm512_loadu_ps(src), am);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[NZ];
    _Pragma("GCC unroll 8") for (int z = 0; z < NZ; ++z) {
      const float* src = v + j * D + 16 * z;
      vv[z] = TAIL && z == NZ - 1 ? _mm512_maskz_loadu_ps(last, src) : _mm512_loadu_ps(src);
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < NM; ++m) {
      const __m512 pb = _mm512_set1_ps(p[j * Vp + m]);
      _Pragma("GCC unroll 8") for (int z = 0; z < NZ; ++z) a[m][z] = _mm512_fmadd_ps(pb, vv[z], a[m][z]);
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < NM; ++m)
    _Pragma("GCC unroll 8") for (int z = 0; z < NZ; ++z) {
      float* dst = acc + m * D + 16 * z;
      if (TAIL && z == NZ - 1)
        _mm512_mask_storeu_ps(dst, last, a[m][z]);
      else
        _mm512_storeu_ps(dst, a[m][z]);
    }
}

// Rows m0..m0+NM-1 over all D columns: full chunks of NZ vectors, then single vectors, then the
// masked tail. NZ is chosen so the tile has at most 16 accumulators.
template <int NM>
DFLASH_AVX512 void accumulate_rows(const float* p, int64_t Vp, int64_t n, const float* v, int64_t D, float* acc,
                                   const float* alpha) {
  constexpr int NZ = NM <= 4 ? 4 : 2;
  int64_t d = 0;
  for (; d + 16 * NZ <= D; d += 16 * NZ) accumulate_tile<NM, NZ, false>(p, Vp, n, v + d, D, acc + d, alpha, 0);
  for (; d + 16 <= D; d += 16) accumulate_tile<NM, 1, false>(p, Vp, n, v + d, D, acc + d, alpha, 0);
  if (d < D) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (D - d)) - 1u);
    accumulate_tile<NM, 1, true>(p, Vp, n, v + d, D, acc + d, alpha, tail);
  }
}

DFLASH_AVX512 void accumulate_avx512(const float* p, int64_t Vp, int64_t V, int64_t n, const float* v,
                                     int64_t D, float* acc, const float* alpha) {
  int64_t m = 0;
  for (; m + 8 <= V; m += 8) accumulate_rows<8>(p + m, Vp, n, v, D, acc + m * D, alpha + m);
  switch (V - m) {
    case 7: accumulate_rows<7>(p + m, Vp, n, v, D, acc + m * D, alpha + m); break;
    case 6: accumulate_rows<6>(p + m, Vp, n, v, D, acc + m * D, alpha + m); break;
    case 5: accumulate_rows<5>(p + m, Vp, n, v, D, acc + m * D, alpha + m); break;
    case 4: accumulate_rows<4>(p + m, Vp, n, v, D, acc + m * D, alpha + m); break;
    case 3: accumulate_rows<3>(p + m, Vp, n, v, D, acc + m * D, alpha + m); break;
    case 2: accumulate_rows<2>(p + m, Vp, n, v, D, acc + m * D, alpha + m); break;
    case 1: accumulate_rows<1>(p + m, Vp, n, v, D, acc + m * D, alpha + m); break;
    default: break;
  }
}

DFLASH_AVX512 void widen_f16_avx512(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)  // vcvtph2ps is exact, as the generic path
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  for (; i < n; ++i) out[i] = widen_half(h[i]);
}
DFLASH_AVX512 void widen_q8_avx512(const uint8_t* rows, int64_t n_rows, int64_t D, float* out) {
  const int64_t stride = row_bytes(KvFormat::q8, D);
  for (int64_t r = 0; r < n_rows; ++r) {
    const uint8_t* row = rows + r * stride;
    float* dst = out + r * D;
    for (int64_t b = 0; b < q8_blocks(D); ++b) {
      float s;
      std::memcpy(&s, row + D + 4 * b, sizeof s);
      const __m512 scale = _mm512_set1_ps(s);
      const int64_t d1 = std::min(D, (b + 1) * kQ8Block);
      int64_t d = b * kQ8Block;
      for (; d + 16 <= d1; d += 16) {  // 16 int8 -> 16 int32 -> 16 floats, times the block's scale
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
        _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale));
      }
      for (; d < d1; ++d) dst[d] = static_cast<float>(static_cast<int8_t>(row[d])) * s;
    }
  }
}
const Kernels kAvx512 = {"avx512", scores_avx512, softmax_avx512, accumulate_avx512,
                         widen_f16_avx512, widen_q8_avx512};
DFLASH_AVX512 void swiglu_avx512(const float* x, int64_t I, float* out) { swiglu_generic<vf16>(x, I, out); }
#endif  // DFLASH_HAVE_AVX512

}  // namespace

const Kernels& portable_kernels() { return kPortable; }

const Kernels* avx2_kernels() {
#ifdef DFLASH_HAVE_X86_DISPATCH
  __builtin_cpu_init();  // harmless if libgcc's constructor already ran
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) return &kAvx2;
#endif
  return nullptr;
}

const Kernels* avx512_kernels() {
#ifdef DFLASH_HAVE_AVX512
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return &kAvx512;
#endif
  return nullptr;
}

const Kernels& select_kernels() {
  // DFLASH_OPS_KERNELS=portable|avx2|avx512 caps the choice (tests use it to run every path);
  // a path the CPU lacks falls back to the next one down.
  const char* want = std::getenv("DFLASH_OPS_KERNELS");
  const std::string cap = want != nullptr ? want : "";
  const Kernels* k512 = avx512_kernels();
  const Kernels* k2 = avx2_kernels();
  if (k512 != nullptr && cap != "portable" && cap != "avx2") return *k512;
  if (k2 != nullptr && cap != "portable") return *k2;
  return kPortable;
}

SwigluFn select_swiglu() {
#ifdef DFLASH_HAVE_AVX512
  if (&select_kernels() == &kAvx512) return swiglu_avx512;
#endif
#ifdef DFLASH_HAVE_X86_DISPATCH
  if (&select_kernels() != &kPortable) return swiglu_avx2;
#endif
  return swiglu_portable;
}

}  // namespace dflash
