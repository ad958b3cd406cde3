// TreeAttention: attention over a fixed-capacity KV cache plus new rows under an arbitrary mask,
// as an ONNX Runtime custom op (domain "ai.dflash", version 1), for B sequences at once (B = 1 in
// the runtime's graphs; a batched graph answers many requests together, each with its own cache).
//
// Inputs
//   0 query       float [B, S, H*D]        rotary already applied
//   1 key         float [B, S_kv, Hkv*D]   new key rows, rotary already applied
//   2 value       float [B, S_kv, Hkv*D]   new value rows
//   3 key_cache   [B, Hkv, C, W]           sequence b's rows < its past_len are valid; float32 or
//   4 value_cache [B, Hkv, C, W]           float16 (W = D), or uint8 in the q8 format (kv_format.h,
//                                          W = D + 4*ceil(D/32)); the two alike
//   5 past_len    int64, shape [] or [1] (every sequence), or [B] (one per sequence)
//   6 mask        bool  [S, S_kv]          query row i may attend new row j iff mask[i, j]
//                                          (causal, tree = ancestor-or-self, all-true = bidirectional),
//                                          the same for every sequence
// Attributes
//   num_heads (int, H), kv_num_heads (int, Hkv; H must be a multiple), scale (float, default
//   1/sqrt(D)). D = key width / Hkv.
// Outputs
//   0 output        float [B, S, H*D]
//   1 present_key   [B, Hkv, C, W]  the caches' type
//   2 present_value [B, Hkv, C, W]
//
// Behaviour
//   Each sequence is computed as it would be alone, bit for bit.
//   present_* = the input caches with the new rows written at rows past_len .. past_len+S_kv-1,
//   in the caches' format; attention reads every key and value, new rows included, as stored.
//   When a present output is the same memory as its cache input (IOBinding of one buffer to both,
//   the normal case), only the new rows are written, in place; otherwise the input cache is first
//   copied to the output. Query row i, head h uses kv head h / (H/Hkv) and attends to every cache
//   row < past_len plus the new rows j with mask[i, j]: softmax(scale * q.k) weighted sum of v.
//   Cache rows >= past_len + S_kv are never read for attention. A row that sees nothing (mask
//   row all false, past_len 0) gets zeros.
//   Bad shapes, types or lengths make the op return an error status naming the problem; it never
//   reads or writes out of bounds.
//
// Implementation: the work is split into items (kv head, group of query rows, chunk of key rows);
// an item runs all H/Hkv query heads of its kv head together so each K/V row is loaded once per
// group, in blocks of kKeyBlock rows with a one-pass online softmax. Items run on ORT's intra-op
// thread pool (KernelContext_ParallelFor). When the key range is split into chunks, a second
// parallel pass merges the partial softmax results. A float16 or q8 cache's rows are widened to
// float32 a key block at a time (exactly) and go through the same loops. The inner loops
// (kernels.cc) come in AVX-512, AVX2 and portable versions, picked when the session creates the
// kernel.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"
#include "kv_format.h"
#include "quantized_matmul.h"
#include "op_support.h"

namespace dflash {
namespace {

constexpr const char* kDomain = "ai.dflash";
constexpr const char* kOpName = "TreeAttention";

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  fail_in(kOpName, args...);
}

// A growable, 64-byte aligned float buffer, one per thread (thread_local), so the kernel does no
// heap allocation per call once the buffers have reached their working size.
class Scratch {
 public:
  ~Scratch() { std::free(data_); }
  float* get(size_t count) {
    if (count > size_) {
      std::free(data_);
      size_ = std::max(count, size_ + size_ / 2);
      data_ = static_cast<float*>(std::aligned_alloc(64, ((size_ * sizeof(float) + 63) / 64) * 64));
      if (data_ == nullptr) {
        size_ = 0;
        throw std::bad_alloc();
      }
    }
    return data_;
  }

 private:
  float* data_ = nullptr;
  size_t size_ = 0;
};

const char* dtype_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return "bool";
    default: return "another type";
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Everything the parallel work items need.
struct Plan {
  const float* q;
  const uint8_t* mask;  // [S, S_kv]
  const uint8_t* kc;    // present_key  [Hkv, C, row], new rows already written
  const uint8_t* vc;    // present_value
  KvFormat kv;          // the caches' format, row_bytes bytes a row
  int64_t row_bytes;
  float* out;
  int64_t S, Skv, H, Hkv, G, D, C, past, T;  // T = past + S_kv keys in total
  float qscale;                              // scale * log2(e): the softmax works in base 2
  int64_t rows_per_group, n_qgroups, n_chunks, chunk_len, vmax;
  float* partial;  // n_chunks > 1: [Hkv][n_qgroups][n_chunks][vmax][2 + D] = (max, sum, acc)
  const Kernels* kern;
  // Rows that must take their new keys by rank (see ranked_blocks): 1 if one of the new rows a
  // query row sees lies in another key block than in plain decoding. tail_begin = the first key
  // row of the block holding row `past`: the rows below it are whole blocks of cache rows.
  const uint8_t* regroup;
  int64_t tail_begin;
};

// Work decomposition. Query vectors of one kv head are grouped up to ~64 per item (the K/V rows
// are streamed once per group); the key range is cut into chunks of a fixed kChunk rows, each an
// item of its own, merged afterwards; if that still leaves too few items to keep the pool busy,
// the query rows are split into more groups.
// The chunk boundaries depend on nothing but the key positions, and a query vector's arithmetic
// on nothing but its own lane, so a row's output is bit for bit the same whatever the number of
// rows verified with it and the thread count: speculative decoding relies on that to be lossless.
// Every group's vectors are padded to whole SIMD widths (16 lanes), and padding lanes are wasted
// work, so a split of the rows is only taken when it pads no more lanes in all.
void make_plan(Plan& p) {
  constexpr int64_t kVecTarget = 64;   // query vectors per item
  constexpr int64_t kItemTarget = 16;  // enough items to balance a few threads
  constexpr int64_t kChunk = 4 * kKeyBlock;  // key rows per chunk
  const int64_t S = p.S, G = p.G;
  auto padded = [&](int64_t rows) {  // lanes of all groups of `rows` rows (the last one shorter)
    return S / rows * round_up(rows * G, 16) + (S % rows ? round_up(S % rows * G, 16) : 0);
  };
  // The smallest group size in [lo, hi] that pads no more lanes than groups of hi rows.
  auto settle = [&](int64_t lo, int64_t hi) {
    for (int64_t r = std::max<int64_t>(1, lo); r < hi; ++r)
      if (padded(r) <= padded(hi)) return r;
    return hi;
  };
  const int64_t nc = std::max<int64_t>(1, ceil_div(p.T, kChunk));
  const int64_t lane_rows = 16 / std::gcd<int64_t>(16, G);  // rows whose G heads fill whole vectors
  int64_t rows = std::max<int64_t>(1, kVecTarget / G);
  if (rows >= lane_rows) rows = rows / lane_rows * lane_rows;
  rows = std::min(S, rows);
  rows = settle(ceil_div(S, ceil_div(S, rows)), rows);  // even out the groups
  if (p.Hkv * ceil_div(S, rows) * nc < kItemTarget)     // few items: split the rows further
    rows = settle(ceil_div(S, ceil_div(kItemTarget, p.Hkv * nc)), rows);
  p.rows_per_group = rows;
  p.n_qgroups = ceil_div(S, rows);
  p.n_chunks = nc;
  p.chunk_len = kChunk;
  p.vmax = rows * G;
}

// Rows [r0, r0 + n) of kv head g of a present cache as float32 rows of D: a float32 cache's own
// memory, else the stored rows widened into `buf` (valid until its next use).
const float* cache_rows(const Plan& p, const uint8_t* cache, int64_t g, int64_t r0, int64_t n, Scratch& buf) {
  const uint8_t* src = cache + (g * p.C + r0) * p.row_bytes;
  if (p.kv == KvFormat::f32) return reinterpret_cast<const float*>(src);
  float* out = buf.get(static_cast<size_t>(std::max<int64_t>(1, n * p.D)));
  if (p.kv == KvFormat::f16)
    p.kern->widen_f16(reinterpret_cast<const uint16_t*>(src), n * p.D, out);
  else
    p.kern->widen_q8(src, n, p.D, out);
  return out;
}

// Each pool thread's buffers for widened key and value rows.
thread_local Scratch key_rows, value_rows;

// The key blocks from p.tail_begin on of the query rows [i0, i1) within chunk c, by rank.
// A tree node off the first chain sees its ancestors and itself at verify rows with gaps between
// them; decoded alone, the same token sees the same keys at consecutive rows. So the k-th new row
// a query row sees (its rank past + k), not its row, decides its block and chunk: otherwise the
// online softmax would rescale at other points, round differently, and speculative decoding would
// stop being lossless. Per block: the scores of the cache rows in it (shared by all rows), then one
// score row per rank, each lane taking the score of its own k-th new row (-inf past its last);
// after the softmax, each rank's weights go back to the rows they came from and the new value rows
// are summed in row order, which for every lane is its rank order. Every step is lane-wise, so a
// lane gets the bits plain decoding gives it.
void ranked_blocks(const Plan& p, int64_t g, int64_t c, int64_t i0, int64_t i1, const float* qT, int64_t Vp,
                   float* s, float* m_run, float* l_run, float* acc, float* alpha) {
  static thread_local Scratch scratch;
  static thread_local std::vector<int64_t> kth, seen;  // kth[r * Skv + k]: the k-th new row row i0 + r sees
  const int64_t G = p.G, D = p.D, Skv = p.Skv, V = (i1 - i0) * G;
  kth.resize(static_cast<size_t>((i1 - i0) * Skv));
  seen.assign(static_cast<size_t>(i1 - i0), 0);
  int64_t most = 0;
  for (int64_t i = i0; i < i1; ++i) {
    int64_t& n = seen[i - i0];
    for (int64_t j = 0; j < Skv; ++j)
      if (p.mask[i * Skv + j]) kth[(i - i0) * Skv + n++] = j;
    most = std::max(most, n);
  }
  const int64_t r_begin = std::max(p.tail_begin, c * p.chunk_len);
  const int64_t r_end = std::min(p.past + most, (c + 1) * p.chunk_len);
  if (r_begin >= r_end) return;

  // A new row of rank >= r_begin is row j >= r_begin - past (a rank is never above its row).
  const int64_t j_first = std::max<int64_t>(0, r_begin - p.past), nj = Skv - j_first;
  float* snew = scratch.get(static_cast<size_t>(2 * nj * Vp + Vp));  // scores of new rows, then weights
  float* pnew = snew + nj * Vp;
  float* ones = pnew + nj * Vp;
  std::fill(ones, ones + Vp, 1.0f);
  for (int64_t j = 0; j < nj; j += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, nj - j);
    p.kern->scores(qT, Vp, D, cache_rows(p, p.kc, g, p.past + j_first + j, n, key_rows), n, snew + j * Vp);
  }

  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kKeyBlock) {  // r_begin is a multiple of kKeyBlock
    const int64_t nc = std::max<int64_t>(0, std::min(p.past, r0 + kKeyBlock) - r0);  // cache rows
    const int64_t k0 = std::max(r0, p.past) - p.past, k1 = std::min(r0 + kKeyBlock, r_end) - p.past;
    if (nc > 0) p.kern->scores(qT, Vp, D, cache_rows(p, p.kc, g, r0, nc, key_rows), nc, s);
    std::fill(s + nc * Vp, s + (nc + k1 - k0) * Vp, neg_inf);
    int64_t j_last = k0;  // new rows k0 .. j_last-1 hold this block's ranks
    for (int64_t r = 0; r < i1 - i0; ++r)
      for (int64_t k = k0; k < std::min(k1, seen[r]); ++k) {
        const int64_t j = kth[r * Skv + k];
        std::copy_n(snew + (j - j_first) * Vp + r * G, G, s + (nc + k - k0) * Vp + r * G);
        j_last = std::max(j_last, j + 1);
      }
    p.kern->softmax(s, nc + k1 - k0, Vp, m_run, l_run, alpha);
    if (nc > 0) p.kern->accumulate(s, Vp, V, nc, cache_rows(p, p.vc, g, r0, nc, value_rows), D, acc, alpha);
    std::fill(pnew, pnew + (j_last - k0) * Vp, 0.0f);
    for (int64_t r = 0; r < i1 - i0; ++r)
      for (int64_t k = k0; k < std::min(k1, seen[r]); ++k)
        std::copy_n(s + (nc + k - k0) * Vp + r * G, G, pnew + (kth[r * Skv + k] - k0) * Vp + r * G);
    // The cache rows' call already rescaled acc by alpha; this one continues the same sums.
    p.kern->accumulate(pnew, Vp, V, j_last - k0, cache_rows(p, p.vc, g, p.past + k0, j_last - k0, value_rows), D,
                       acc, nc > 0 ? ones : alpha);
  }
}

// One work item: kv head g, query rows [i0, i1), key rows of chunk c.
void run_item(const Plan& p, int64_t item) {
  static thread_local Scratch scratch;
  const int64_t c = item % p.n_chunks;
  const int64_t qg = (item / p.n_chunks) % p.n_qgroups;
  const int64_t g = item / (p.n_chunks * p.n_qgroups);
  const int64_t i0 = qg * p.rows_per_group;
  const int64_t i1 = std::min(p.S, i0 + p.rows_per_group);
  if (i0 >= i1) return;
  const int64_t G = p.G, D = p.D, H = p.H;
  const int64_t V = (i1 - i0) * G;  // vector v = (row i0 + v / G, head g*G + v % G)
  const int64_t Vp = round_up(V, 16);

  float* qT = scratch.get(static_cast<size_t>(D * Vp + kKeyBlock * Vp + V * D + 3 * Vp));
  float* s = qT + D * Vp;
  float* acc = s + kKeyBlock * Vp;
  float* m_run = acc + V * D;
  float* l_run = m_run + Vp;
  float* alpha = l_run + Vp;

  // Query vectors of rows i0..i1-1, heads g*G..g*G+G-1 are contiguous in q: row i's G heads
  // start at q + i*H*D + g*G*D. Transpose them into the lanes of qT.
  for (int64_t v = 0; v < V; ++v) {
    const float* src = p.q + (i0 + v / G) * H * D + (g * G + v % G) * D;
    for (int64_t d = 0; d < D; ++d) qT[d * Vp + v] = src[d] * p.qscale;
  }
  for (int64_t d = 0; d < D; ++d) std::fill(qT + d * Vp + V, qT + (d + 1) * Vp, 0.0f);
  std::fill(m_run, m_run + Vp, -std::numeric_limits<float>::infinity());
  std::fill(l_run, l_run + Vp, 0.0f);
  std::fill(acc, acc + V * D, 0.0f);

  const int64_t t_begin = c * p.chunk_len;
  int64_t t_end = std::min(p.T, t_begin + p.chunk_len);
  // Trailing new rows that no row of this group may see are skipped (with a causal mask, the
  // first query rows see only the first new rows: this halves the work of a long prefill).
  auto visible_to_group = [&](int64_t t) {
    for (int64_t i = i0; i < i1; ++i)
      if (p.mask[i * p.Skv + (t - p.past)]) return true;
    return false;
  };
  while (t_end > std::max(t_begin, p.past) && !visible_to_group(t_end - 1)) --t_end;
  // Rows to regroup: the blocks from tail_begin on go by rank (ranked_blocks) for the whole group.
  const bool by_rank = std::any_of(p.regroup + i0, p.regroup + i1, [](uint8_t r) { return r != 0; });
  if (by_rank) t_end = std::min(t_end, p.tail_begin);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, t_end - t0);
    const int64_t j_begin = std::max(t0, p.past);  // first new (masked) key row in this block
    if (j_begin >= t0 + n) {
      p.kern->scores(qT, Vp, D, cache_rows(p, p.kc, g, t0, n, key_rows), n, s);
    } else {
      // The block holds new rows: skip it if no row of this group may see any of them.
      bool any = t0 < p.past;
      for (int64_t i = i0; i < i1 && !any; ++i) {
        const uint8_t* mrow = p.mask + i * p.Skv;
        for (int64_t t = j_begin; t < t0 + n; ++t) any |= mrow[t - p.past] != 0;
      }
      if (!any) continue;
      p.kern->scores(qT, Vp, D, cache_rows(p, p.kc, g, t0, n, key_rows), n, s);
      // Masked (query row, new key) pairs get -inf, for all G heads of the row (lanes r*G .. r*G+G-1).
      const float neg_inf = -std::numeric_limits<float>::infinity();
      for (int64_t i = i0; i < i1; ++i) {
        const uint8_t* mrow = p.mask + i * p.Skv;
        float* lanes = s + (i - i0) * G;
        for (int64_t t = j_begin; t < t0 + n; ++t)
          if (!mrow[t - p.past]) std::fill(lanes + (t - t0) * Vp, lanes + (t - t0) * Vp + G, neg_inf);
      }
    }
    p.kern->softmax(s, n, Vp, m_run, l_run, alpha);
    p.kern->accumulate(s, Vp, V, n, cache_rows(p, p.vc, g, t0, n, value_rows), D, acc, alpha);
  }
  if (by_rank) ranked_blocks(p, g, c, i0, i1, qT, Vp, s, m_run, l_run, acc, alpha);

  if (p.n_chunks == 1) {
    for (int64_t v = 0; v < V; ++v) {
      float* dst = p.out + (i0 + v / G) * H * D + (g * G + v % G) * D;
      const float inv = l_run[v] > 0.0f ? 1.0f / l_run[v] : 0.0f;
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[v * D + d] * inv;
    }
  } else {
    const int64_t rec = 2 + D;
    float* base = p.partial + ((g * p.n_qgroups + qg) * p.n_chunks + c) * p.vmax * rec;
    for (int64_t v = 0; v < V; ++v) {
      float* r = base + v * rec;
      r[0] = m_run[v];
      r[1] = l_run[v];
      std::memcpy(r + 2, acc + v * D, static_cast<size_t>(D) * sizeof(float));
    }
  }
}

// Merge the per-chunk partial results of (kv head g, query group qg) into the output.
void merge_item(const Plan& p, int64_t item) {
  const int64_t qg = item % p.n_qgroups;
  const int64_t g = item / p.n_qgroups;
  const int64_t i0 = qg * p.rows_per_group;
  const int64_t i1 = std::min(p.S, i0 + p.rows_per_group);
  const int64_t G = p.G, D = p.D, rec = 2 + D;
  const float* base = p.partial + (g * p.n_qgroups + qg) * p.n_chunks * p.vmax * rec;
  for (int64_t v = 0; v < (i1 - i0) * G; ++v) {
    float* dst = p.out + (i0 + v / G) * p.H * D + (g * G + v % G) * D;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < p.n_chunks; ++c) mx = std::max(mx, base[(c * p.vmax + v) * rec]);
    std::fill(dst, dst + D, 0.0f);
    if (mx == -std::numeric_limits<float>::infinity()) continue;  // saw nothing: zeros
    float total = 0.0f;
    for (int64_t c = 0; c < p.n_chunks; ++c) {
      const float* r = base + (c * p.vmax + v) * rec;
      if (r[1] == 0.0f) continue;
      const float w = std::exp2(r[0] - mx);
      total += r[1] * w;
      for (int64_t d = 0; d < D; ++d) dst[d] += r[2 + d] * w;
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
  }
}

// Copy the whole input cache into a distinct output buffer, one kv head (per_head bytes) per task.
void copy_cache(OrtKernelContext* ctx, const uint8_t* src, uint8_t* dst, int64_t heads, size_t per_head) {
  if (src == dst || per_head == 0) return;
  const size_t total = per_head * static_cast<size_t>(heads);
  if (dst < src + total && src < dst + total) {  // overlapping but not identical: be safe
    std::memmove(dst, src, total);
    return;
  }
  parallel_for(ctx, heads, [&](int64_t h) {
    std::memcpy(dst + h * per_head, src + h * per_head, per_head);
  }, "cache copy failed");
}

// The caches' format from their element type; value_cache and the present outputs must match.
KvFormat cache_format(const Ort::ConstValue& key_cache, const Ort::ConstValue& value_cache, const char* prefix) {
  const auto kt = key_cache.GetTensorTypeAndShapeInfo().GetElementType();
  const auto vt = value_cache.GetTensorTypeAndShapeInfo().GetElementType();
  if (kt != vt) fail(prefix, "key_cache is ", dtype_name(kt), " but value_cache is ", dtype_name(vt));
  switch (kt) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return KvFormat::f32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return KvFormat::f16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return KvFormat::q8;
    default: fail(prefix, "key_cache must be float32, float16 or uint8 (the q8 format), got ", dtype_name(kt));
  }
}

// Outputs 1 and 2, the present caches of shape `shape` (rows of `row` bytes): of their caches'
// type, and holding them: nothing to do when IOBinding gave the same buffers, else copied over.
std::pair<uint8_t*, uint8_t*> present_caches(OrtKernelContext* context, Ort::KernelContext& ctx,
                                             const Ort::ConstValue& key_cache, const Ort::ConstValue& value_cache,
                                             const std::vector<int64_t>& shape, int64_t row, const char* prefix) {
  uint8_t* present[2];
  const Ort::ConstValue* caches[2] = {&key_cache, &value_cache};
  for (int i = 0; i < 2; ++i) {
    auto value = ctx.GetOutput(1 + i, shape);
    const auto have = value.GetTensorTypeAndShapeInfo().GetElementType();
    const auto want = caches[i]->GetTensorTypeAndShapeInfo().GetElementType();
    if (have != want)
      fail(prefix, i ? "present_value is " : "present_key is ", dtype_name(have), " but its cache input is ",
           dtype_name(want));
    present[i] = static_cast<uint8_t*>(value.GetTensorMutableRawData());
    copy_cache(context, static_cast<const uint8_t*>(caches[i]->GetTensorRawData()), present[i], shape[0] * shape[1],
               static_cast<size_t>(shape[2] * row));
  }
  return {present[0], present[1]};
}

// Attention of B sequences at once. Sequence b: S query rows (q + b*S*H*D, unscaled) over its cache
// rows < pasts[b] plus its new rows pasts[b]..pasts[b]+Skv-1 already written into its caches
// (pk / pv + b*Hkv*C*D), under the one mask [S, Skv]; into out + b*S*H*D. Every sequence gets the
// plan it would get alone (so its bits do not depend on the batch), and the work items of all of
// them share one pass over the pool.
void attend(OrtKernelContext* context, const Kernels* kern, const float* q, const uint8_t* mask, const uint8_t* pk,
            const uint8_t* pv, KvFormat kv, float* out, int64_t B, int64_t S, int64_t Skv, int64_t H, int64_t Hkv,
            int64_t D, int64_t C, const int64_t* pasts, float scale) {
  static thread_local std::vector<Plan> plans;
  static thread_local std::vector<uint8_t> regroup;
  static thread_local std::vector<int64_t> first_item, first_merge;  // prefix sums over the sequences
  static thread_local std::vector<size_t> partial_at;  // where each sequence's partial results start
  static thread_local Scratch partial;
  plans.assign(static_cast<size_t>(B), Plan{});
  regroup.assign(static_cast<size_t>(B * S), 0);
  first_item.assign(static_cast<size_t>(B + 1), 0);
  first_merge.assign(static_cast<size_t>(B + 1), 0);
  partial_at.assign(static_cast<size_t>(B), 0);
  size_t partial_size = 0;
  for (int64_t b = 0; b < B; ++b) {
    Plan& plan = plans[b];
    const int64_t past = pasts[b];
    plan.q = q + b * S * H * D;
    plan.mask = mask;
    plan.kv = kv;
    plan.row_bytes = row_bytes(kv, D);
    plan.kc = pk + b * Hkv * C * plan.row_bytes;
    plan.vc = pv + b * Hkv * C * plan.row_bytes;
    plan.out = out + b * S * H * D;
    plan.S = S;
    plan.Skv = Skv;
    plan.H = H;
    plan.Hkv = Hkv;
    plan.G = H / Hkv;
    plan.D = D;
    plan.C = C;
    plan.past = past;
    plan.T = past + Skv;
    plan.qscale = scale * 1.4426950408889634f;  // log2(e): the softmax works in base 2
    plan.kern = kern;
    make_plan(plan);
    uint8_t* rows = regroup.data() + b * S;
    for (int64_t i = 0; i < S; ++i) {
      // Its k-th new row j in another block than rank past + k: only after a gap, across a block edge.
      const uint8_t* row = mask + i * Skv;
      for (int64_t j = 0, k = 0; j < Skv; ++j)
        if (row[j]) rows[i] |= (past + j) / kKeyBlock != (past + k++) / kKeyBlock;
    }
    plan.regroup = rows;
    plan.tail_begin = past / kKeyBlock * kKeyBlock;
    const int64_t n_groups = Hkv * plan.n_qgroups;
    first_item[b + 1] = first_item[b] + n_groups * plan.n_chunks;
    first_merge[b + 1] = first_merge[b] + (plan.n_chunks > 1 ? n_groups : 0);
    partial_at[b] = partial_size;
    if (plan.n_chunks > 1) partial_size += static_cast<size_t>(n_groups * plan.n_chunks * plan.vmax * (2 + D));
  }
  if (partial_size > 0) {
    // Partial results live in the calling thread's scratch; pool threads only write into it.
    float* base = partial.get(partial_size);
    for (int64_t b = 0; b < B; ++b) plans[b].partial = base + partial_at[b];
  }
  // The pool's threads see their own thread_locals: hand them the calling thread's arrays.
  const Plan* P = plans.data();
  const int64_t* items = first_item.data();
  const int64_t* merges = first_merge.data();
  auto owner = [B](const int64_t* first, int64_t i) {  // the sequence whose items hold item i
    return static_cast<int64_t>(std::upper_bound(first, first + B + 1, i) - first) - 1;
  };
  parallel_for(context, items[B], [&](int64_t i) {
    const int64_t b = owner(items, i);
    run_item(P[b], i - items[b]);
  }, "out of memory for the attention scratch buffers");
  parallel_for(context, merges[B], [&](int64_t i) {
    const int64_t b = owner(merges, i);
    merge_item(P[b], i - merges[b]);
  }, "out of memory for the attention scratch buffers");
}

// past_len: one length for every sequence (shape [] or [1]) or one per sequence ([B]), int64.
// Each must leave room for `rows` new rows in a cache of `C` rows. Returned in the calling thread's
// buffer (valid until its next call), so a step allocates nothing.
const std::vector<int64_t>& read_pasts(const Ort::ConstValue& past_in, int64_t B, int64_t rows, int64_t C,
                                       const char* prefix) {
  static thread_local std::vector<int64_t> pasts;
  const auto info = past_in.GetTensorTypeAndShapeInfo();
  const auto shape = info.GetShape();
  const int64_t n = static_cast<int64_t>(info.GetElementCount());
  if (shape.size() > 1 || (n != 1 && n != B))
    fail(prefix, "past_len must be a scalar (shape [] or [1]) or one length per sequence (shape [", B, "]), got shape ",
         shape_str(shape));
  pasts.resize(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t i = n == 1 ? 0 : b;
    if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64)
      fail(prefix, "past_len must be int64, got ", dtype_name(info.GetElementType()));
    pasts[b] = past_in.GetTensorData<int64_t>()[i];
    if (pasts[b] < 0) fail(prefix, "past_len ", pasts[b], " is negative");
    if (pasts[b] > C - rows) fail(prefix, "past_len ", pasts[b], " + ", rows, " new rows exceeds cache capacity ", C);
  }
  return pasts;
}

// What both attention kernels are made with (create_attention_kernel): heads, scale, kernels.
struct AttentionKernelBase {
  int64_t num_heads = 0;
  int64_t kv_num_heads = 0;
  float scale = 0.0f;
  bool has_scale = false;
  const Kernels* kern = nullptr;

  float scale_for(int64_t D) const { return has_scale ? scale : 1.0f / std::sqrt(static_cast<float>(D)); }
};

// Both attention ops: attributes num_heads, kv_num_heads (H a multiple of it), optional scale.
template <typename Kernel>
OrtStatusPtr create_attention_kernel(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel,
                                     const char* name) {
  try {
    Ort::ConstKernelInfo ki(info);
    auto kernel = std::make_unique<Kernel>();
    kernel->num_heads = ki.GetAttribute<int64_t>("num_heads");
    kernel->kv_num_heads = ki.GetAttribute<int64_t>("kv_num_heads");
    float sc = 0.0f;
    if (OrtStatus* st = api.KernelInfoGetAttribute_float(info, "scale", &sc)) {
      api.ReleaseStatus(st);  // no scale attribute: use 1/sqrt(head_dim)
    } else {
      kernel->scale = sc;
      kernel->has_scale = true;
    }
    if (kernel->num_heads <= 0 || kernel->kv_num_heads <= 0 || kernel->num_heads % kernel->kv_num_heads != 0) {
      std::ostringstream os;
      os << name << ": num_heads " << kernel->num_heads << " must be a positive multiple of kv_num_heads "
         << kernel->kv_num_heads;
      return api.CreateStatus(ORT_INVALID_ARGUMENT, os.str().c_str());
    }
    kernel->kern = &select_kernels();
    *op_kernel = kernel.release();
    return nullptr;
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_INVALID_ARGUMENT, (std::string(name) + ": " + e.what()).c_str());
  }
}

struct TreeAttentionKernel : AttentionKernelBase {

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded(kOpName, [&] { Compute(context); });
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    if (ctx.GetInputCount() != 7 || ctx.GetOutputCount() != 3) fail("expects 7 inputs and 3 outputs");
    const auto query = ctx.GetInput(0), key = ctx.GetInput(1), value = ctx.GetInput(2);
    const auto key_cache = ctx.GetInput(3), value_cache = ctx.GetInput(4);
    const auto past_in = ctx.GetInput(5), mask_in = ctx.GetInput(6);

    const auto qshape = query.GetTensorTypeAndShapeInfo().GetShape();
    const auto kshape = key.GetTensorTypeAndShapeInfo().GetShape();
    const auto vshape = value.GetTensorTypeAndShapeInfo().GetShape();
    const auto kcshape = key_cache.GetTensorTypeAndShapeInfo().GetShape();
    const auto vcshape = value_cache.GetTensorTypeAndShapeInfo().GetShape();
    const auto mask_info = mask_in.GetTensorTypeAndShapeInfo();
    const auto mshape = mask_info.GetShape();

    const int64_t H = num_heads, Hkv = kv_num_heads;
    if (qshape.size() != 3 || qshape[0] < 1)
      fail("query must have shape [B, S, num_heads*head_dim], got ", shape_str(qshape));
    const int64_t B = qshape[0];
    if (kshape.size() != 3 || kshape[0] != B)
      fail("key must have shape [", B, ", S_kv, kv_num_heads*head_dim], got ", shape_str(kshape));
    if (vshape != kshape) fail("value shape ", shape_str(vshape), " differs from key shape ", shape_str(kshape));
    if (kshape[2] <= 0 || kshape[2] % Hkv != 0)
      fail("key width ", kshape[2], " is not a positive multiple of kv_num_heads ", Hkv);
    const int64_t S = qshape[1], Skv = kshape[1], D = kshape[2] / Hkv;
    if (qshape[2] != H * D)
      fail("query width ", qshape[2], " != num_heads ", H, " * head_dim ", D, " (head_dim = key width ",
           kshape[2], " / kv_num_heads ", Hkv, ")");
    const KvFormat kv = cache_format(key_cache, value_cache, "");
    if (kcshape.size() != 4 || kcshape[0] != B || kcshape[1] != Hkv || kcshape[3] != row_width(kv, D))
      fail("key_cache must have shape [", B, ", ", Hkv, ", capacity, ", row_width(kv, D), "], got ",
           shape_str(kcshape));
    if (vcshape != kcshape)
      fail("value_cache shape ", shape_str(vcshape), " differs from key_cache shape ", shape_str(kcshape));
    const int64_t C = kcshape[2];

    const std::vector<int64_t>& pasts = read_pasts(past_in, B, Skv, C, "");

    if (mask_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL)
      fail("mask must be bool, got ", dtype_name(mask_info.GetElementType()));
    if (mshape.size() != 2 || mshape[0] != S || mshape[1] != Skv)
      fail("mask must have shape [S, S_kv] = [", S, ", ", Skv, "], got ", shape_str(mshape));

    float* out = ctx.GetOutput(0, qshape).GetTensorMutableData<float>();
    const auto [pk, pv] = present_caches(context, ctx, key_cache, value_cache, kcshape, row_bytes(kv, D), "");
    const int64_t rb = row_bytes(kv, D);

    // Write the new rows: sequence b's key row j, kv head g -> its present row past_b + j of head g.
    const float* knew = key.GetTensorData<float>();
    const float* vnew = value.GetTensorData<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t j = 0; j < Skv; ++j) {
          const int64_t dst = ((b * Hkv + g) * C + pasts[b] + j) * rb, src = (b * Skv + j) * Hkv * D + g * D;
          store_row(kv, knew + src, D, pk + dst);
          store_row(kv, vnew + src, D, pv + dst);
        }
    if (S == 0) return;

    attend(context, kern, query.GetTensorData<float>(),
           reinterpret_cast<const uint8_t*>(mask_in.GetTensorData<bool>()), pk, pv, kv, out, B, S, Skv, H, Hkv, D,
           C, pasts.data(), scale_for(D));
  }
};

// Shape inference of both attention ops: output 0 has shape `out0` (from the first input's), each
// present cache its cache input's. (Their types are onnxruntime's: see GetInputType.)
template <typename Out0>
OrtStatusPtr infer_attention(OrtShapeInferContext* ort_ctx, size_t inputs, size_t key_cache, const char* name,
                             Out0 out0) {
  try {
    const OrtApi& api = Ort::GetApi();
    Ort::ShapeInferContext ctx(&api, ort_ctx);
    if (ctx.GetInputCount() != inputs)
      return api.CreateStatus(ORT_INVALID_ARGUMENT, (std::string(name) + ": wrong number of inputs").c_str());
    // An input whose shape is not known yet reads as rank 0: its output's shape stays unknown.
    Ort::Status s{nullptr};
    if (!ctx.GetInputShape(0).empty()) s = ctx.SetOutputShape(0, out0(ctx));
    for (size_t i = 0; i < 2 && s.IsOK(); ++i) {
      if (ctx.GetInputShape(key_cache + i).empty()) continue;
      OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context; only its shape is used
      s = Ort::Status(api.ShapeInferContext_GetInputTypeShape(ort_ctx, key_cache + i, &info));
      if (s.IsOK()) s = Ort::Status(api.ShapeInferContext_SetOutputTypeShape(ort_ctx, 1 + i, info));
    }
    return s.release();
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, (std::string(name) + ": " + e.what()).c_str());
  }
}

struct TreeAttentionOp : Ort::CustomOpBase<TreeAttentionOp, TreeAttentionKernel, /*WithStatus=*/true> {
  TreeAttentionOp() {
    start_ver_ = 1;
    end_ver_ = 1;
    OrtCustomOp::InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* ctx) -> OrtStatusPtr {
      return infer_attention(ctx, 7, 3, kOpName, [](Ort::ShapeInferContext& c) { return c.GetInputShape(0); });
    };
  }

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const {
    return create_attention_kernel<TreeAttentionKernel>(api, info, op_kernel, kOpName);
  }

  const char* GetName() const { return kOpName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }

  size_t GetInputTypeCount() const { return 7; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    // The caches take any type (float32, float16, q8 bytes; the op checks). onnxruntime gives the
    // present outputs the type of the last input that may have several, so past_len and mask
    // must have one each: the presents then take value_cache's.
    if (index == 3 || index == 4) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    if (index == 5) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    if (index == 6) return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }

};

// ---- PackedTreeAttention: the projection's packed output in, rotary applied in the op ----------
//
// Inputs
//   0 qkv          float [B, S, (H + 2*Hkv)*D]   q heads, then k heads, then v heads (no rotary yet)
//   1 key_cache    float [B, Hkv, C, D]
//   2 value_cache  float [B, Hkv, C, D]
//   3 past_len     int64, shape [] or [1], or [B]
//   4 mask         bool  [S, S]
//   5 position_ids int64 [B, S]                  rotary position of each new row
//   6 cos_cache    float [P, D/2]                cos/sin tables of the model's rotary embedding
//   7 sin_cache    float [P, D/2]
// Same attributes and outputs as TreeAttention (output [B, S, H*D]). Rotary is rotate-half:
// y[i] = x[i]*cos - x[i+D/2]*sin, y[i+D/2] = x[i+D/2]*cos + x[i]*sin, for q and k. One node
// instead of Split + two RotaryEmbedding + TreeAttention (node dispatch dominates a decode step).
constexpr const char* kPackedOpName = "PackedTreeAttention";

void rotate_half(const float* x, const float* c, const float* s, int64_t half, float* y) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    y[i] = a * c[i] - b * s[i];
    y[i + half] = b * c[i] + a * s[i];
  }
}

struct PackedTreeAttentionKernel : AttentionKernelBase {

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return guarded(kPackedOpName, [&] { Compute(context); });
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    if (ctx.GetInputCount() != 8 || ctx.GetOutputCount() != 3) fail("packed: expects 8 inputs and 3 outputs");
    const auto qkv = ctx.GetInput(0), key_cache = ctx.GetInput(1), value_cache = ctx.GetInput(2);
    const auto past_in = ctx.GetInput(3), mask_in = ctx.GetInput(4), pos_in = ctx.GetInput(5);
    const auto cos_in = ctx.GetInput(6), sin_in = ctx.GetInput(7);
    const auto xshape = qkv.GetTensorTypeAndShapeInfo().GetShape();
    const auto kcshape = key_cache.GetTensorTypeAndShapeInfo().GetShape();
    const auto mshape = mask_in.GetTensorTypeAndShapeInfo().GetShape();
    const auto pinfo = pos_in.GetTensorTypeAndShapeInfo();
    const auto cshape = cos_in.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t H = num_heads, Hkv = kv_num_heads, heads = H + 2 * Hkv;

    if (xshape.size() != 3 || xshape[0] < 1 || xshape[2] <= 0 || xshape[2] % heads != 0 || xshape[2] / heads % 2)
      fail("packed: qkv must have shape [B, S, (num_heads + 2*kv_num_heads) * head_dim] with an even head_dim, got ",
           shape_str(xshape));
    const int64_t B = xshape[0], S = xshape[1], D = xshape[2] / heads, half = D / 2, W = xshape[2];
    const KvFormat kv = cache_format(key_cache, value_cache, "packed: ");
    if (kcshape.size() != 4 || kcshape[0] != B || kcshape[1] != Hkv || kcshape[3] != row_width(kv, D))
      fail("packed: key_cache must have shape [", B, ", ", Hkv, ", capacity, ", row_width(kv, D), "], got ",
           shape_str(kcshape));
    if (value_cache.GetTensorTypeAndShapeInfo().GetShape() != kcshape)
      fail("packed: value_cache shape differs from key_cache shape ", shape_str(kcshape));
    const int64_t C = kcshape[2];
    const std::vector<int64_t>& pasts = read_pasts(past_in, B, S, C, "packed: ");
    if (mask_in.GetTensorTypeAndShapeInfo().GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL ||
        mshape.size() != 2 || mshape[0] != S || mshape[1] != S)
      fail("packed: mask must be bool [S, S] = [", S, ", ", S, "], got ", shape_str(mshape));
    if (pinfo.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 ||
        pinfo.GetElementCount() != static_cast<size_t>(B * S))
      fail("packed: position_ids must be int64 [B, S] = [", B, ", ", S, "]");
    if (cshape.size() != 2 || cshape[1] != half || cos_in.GetTensorTypeAndShapeInfo().GetShape() !=
                                                       sin_in.GetTensorTypeAndShapeInfo().GetShape())
      fail("packed: cos_cache and sin_cache must both have shape [positions, ", half, "], got ", shape_str(cshape));

    const float* x = qkv.GetTensorData<float>();
    const int64_t* pos = pos_in.GetTensorData<int64_t>();
    const float* cos = cos_in.GetTensorData<float>();
    const float* sin = sin_in.GetTensorData<float>();
    for (int64_t j = 0; j < B * S; ++j)
      if (pos[j] < 0 || pos[j] >= cshape[0])
        fail("packed: position_ids[", j, "] = ", pos[j], " is outside the rotary tables (", cshape[0], " positions)");

    float* out = ctx.GetOutput(0, {B, S, H * D}).GetTensorMutableData<float>();
    const auto [pk, pv] = present_caches(context, ctx, key_cache, value_cache, kcshape, row_bytes(kv, D), "packed: ");
    const int64_t rb = row_bytes(kv, D);

    // Rotate q into scratch; rotate k and store k and v into their cache rows (row j of sequence
    // b is row b*S + j of qkv and of q).
    static thread_local Scratch q_scratch, k_row;
    float* q = q_scratch.get(static_cast<size_t>(std::max<int64_t>(1, B * S * H * D)));
    float* k = k_row.get(static_cast<size_t>(D));
    for (int64_t r = 0; r < B * S; ++r) {
      const int64_t b = r / S, j = r % S;
      const float* row = x + r * W;
      const float* c = cos + pos[r] * half;
      const float* s = sin + pos[r] * half;
      for (int64_t h = 0; h < H; ++h) rotate_half(row + h * D, c, s, half, q + (r * H + h) * D);
      for (int64_t g = 0; g < Hkv; ++g) {
        const int64_t dst = ((b * Hkv + g) * C + pasts[b] + j) * rb;
        rotate_half(row + (H + g) * D, c, s, half, k);
        store_row(kv, k, D, pk + dst);
        store_row(kv, row + (H + Hkv + g) * D, D, pv + dst);
      }
    }
    if (S == 0) return;
    attend(context, kern, q, reinterpret_cast<const uint8_t*>(mask_in.GetTensorData<bool>()), pk, pv, kv, out, B, S,
           S, H, Hkv, D, C, pasts.data(), scale_for(D));
  }
};

struct PackedTreeAttentionOp
    : Ort::CustomOpBase<PackedTreeAttentionOp, PackedTreeAttentionKernel, /*WithStatus=*/true> {
  PackedTreeAttentionOp() {
    start_ver_ = 1;
    end_ver_ = 1;
    OrtCustomOp::InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* ctx) -> OrtStatusPtr {
      return infer_attention(ctx, 8, 1, kPackedOpName, [](Ort::ShapeInferContext& c) {
        auto shape = c.GetInputShape(0);  // qkv [B, S, (H + 2*Hkv)*D] -> [B, S, H*D]
        const int64_t H = c.GetAttrInt("num_heads"), Hkv = c.GetAttrInt("kv_num_heads");
        if (shape.size() == 3 && shape[2].IsInt() && H > 0 && Hkv > 0)
          shape[2] = Ort::ShapeInferContext::SymbolicInteger(shape[2].AsInt() / (H + 2 * Hkv) * H);
        return shape;
      });
    };
  }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** op_kernel) const {
    return create_attention_kernel<PackedTreeAttentionKernel>(api, info, op_kernel, kPackedOpName);
  }
  const char* GetName() const { return kPackedOpName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    // the caches: any format (as TreeAttention's: the presents take value_cache's type)
    if (index == 1 || index == 2) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    if (index == 3 || index == 5) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    if (index == 4) return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }

};

// Domains must outlive every session that uses them, including sessions destroyed during process
// exit, so they are deliberately never released.
std::mutex g_domains_mutex;
std::vector<OrtCustomOpDomain*>* g_domains = new std::vector<OrtCustomOpDomain*>();

}  // namespace
}  // namespace dflash

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    // The runtime is older than the headers we were built with; API 1 is always there.
    const OrtApi* v1 = api_base->GetApi(1);
    std::string msg = std::string("libdflash_ops was built against ONNX Runtime API ") +
                      std::to_string(ORT_API_VERSION) + " but this onnxruntime (" +
                      api_base->GetVersionString() + ") is older; rebuild it with its headers";
    return v1 != nullptr ? v1->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  Ort::InitApi(api);
  static dflash::TreeAttentionOp op;
  static dflash::PackedTreeAttentionOp packed_op;
  try {
    Ort::CustomOpDomain domain(dflash::kDomain);
    domain.Add(&op);
    domain.Add(&packed_op);
    domain.Add(dflash::matmul_q4_op());
    domain.Add(dflash::matmul_q8_op());
    domain.Add(dflash::skip_rms_norm_op());
    domain.Add(dflash::swiglu_op());
    Ort::UnownedSessionOptions(options).Add(domain);
    std::lock_guard<std::mutex> lock(dflash::g_domains_mutex);
    dflash::g_domains->push_back(domain.release());
    return nullptr;
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
}
