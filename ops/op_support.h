// What every op of the library shares: the ORT C++ API (initialised by RegisterCustomOps), input
// errors that become ORT statuses, shape printing, and ParallelFor on ORT's intra-op pool.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace dflash {

// An input problem: becomes an ORT_INVALID_ARGUMENT status.
struct OpError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throw an OpError whose message starts with the op's name.
template <typename... Args>
[[noreturn]] void fail_in(const char* op, const Args&... args) {
  std::ostringstream os;
  os << op << ": ";
  (os << ... << args);
  throw OpError(os.str());
}

inline std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? "," : "") << shape[i];
  os << "]";
  return os.str();
}

// Run a Compute body, turning its exceptions into ORT statuses (an input problem ->
// INVALID_ARGUMENT); exceptions must not cross the C API.
template <typename F>
OrtStatusPtr guarded(const char* name, F&& compute) {
  try {
    compute();
    return nullptr;
  } catch (const OpError& e) {
    return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, e.what());
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), (std::string(name) + ": " + e.what()).c_str());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, (std::string(name) + ": " + e.what()).c_str());
  }
}

// fn(i) for i in 0..n-1 on ORT's intra-op pool. An exception on a pool thread would terminate the
// process, so it is caught there and reported here as std::runtime_error(on_failure).
// batches = 0: the pool's threads take one i at a time (each take is an atomic add on a shared
// counter); batches > 0: the range is cut into that many contiguous runs of i, taken one at a time.
template <typename F>
void parallel_for(OrtKernelContext* ctx, int64_t n, const F& fn, const char* on_failure, int64_t batches = 0) {
  if (n <= 0) return;
  struct Job {
    const F* fn;
    std::atomic<bool> failed{false};
  } job{&fn};
  auto thunk = [](void* data, size_t i) {
    auto* j = static_cast<Job*>(data);
    try {
      (*j->fn)(static_cast<int64_t>(i));
    } catch (...) {
      j->failed = true;
    }
  };
  Ort::ThrowOnError(Ort::GetApi().KernelContext_ParallelFor(ctx, thunk, static_cast<size_t>(n),
                                                                static_cast<size_t>(batches), &job));
  if (job.failed) throw std::runtime_error(on_failure);
}

// The rows of a [..., H] tensor: the product of all but its last dimension.
inline int64_t leading_rows(const std::vector<int64_t>& shape) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return rows;
}

// row(m) for m in 0..rows-1, for ops whose rows are independent. A call of fewer than 64K values
// runs on the calling thread: ORT's pool would cost more than it saves (it splits even 8 rows);
// a larger one goes to the pool in at most 16 runs of rows.
template <typename F>
void for_each_row(OrtKernelContext* ctx, int64_t rows, int64_t values, const F& row, const char* on_failure) {
  constexpr int64_t kInlineValues = 64 * 1024, kRowBatches = 16;
  if (values < kInlineValues) {
    for (int64_t m = 0; m < rows; ++m) row(m);
  } else {
    parallel_for(ctx, rows, row, on_failure, std::min(rows, kRowBatches));
  }
}

// The ops defined outside tree_attention.cc (which registers them all).
const OrtCustomOp* skip_rms_norm_op();  // skip_rms_norm.cc
const OrtCustomOp* swiglu_op();         // swiglu.cc

}  // namespace dflash
