// Host interface of the kept-set kernel (kept_set_kernel.cuh; launch_kept_set in kept_set_launch.cu),
// called by its FFI handler (ffi_kept_set.cc).
//
// For each row r of u [R, V] (float32: the logits over the temperature) with an anchor
// m_r >= max u_r, the sampler's kept set {u >= tau_r} under min-p, then top-k, then top-p
// (jaxrl_kernels/formulas/sampler_math.py states the rules), found by one CTA per row in passes over
// the row (jaxrl_kernels/backends/ffi/kept_set.py states them). Outputs per row: the
// gradient's floor (the midpoint between tau and the largest value below it; -inf when
// nothing lies below), s = sum of exp(u - m) and a = sum of exp(u - m)(u - m) over the kept
// set, and the number of passes over the row. Rows with active_r false get floor -inf,
// s = a = 0 and no pass.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

namespace jaxrl_kept {

struct KeptSetArgs {
  const float* u = nullptr;      // [R, V]
  const float* m = nullptr;      // [R]
  const bool* active = nullptr;  // [R]
  float* floor = nullptr;        // [R]
  float* s = nullptr;            // [R]
  float* a = nullptr;            // [R]
  int32_t* passes = nullptr;     // [R]
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t top_k = 0;   // 0: no top-k
  float top_p = 1.0f;  // 1: no top-p
  bool has_min_p = false;
  float log_min_p = 0.0f;  // float32(log(min_p))
};

// Rows the kernel takes at most in one launch, and the largest V (the fixed-point masses
// of a row's values must not overflow 64 bits).
constexpr int64_t kMaxRows = int64_t{1} << 31;
constexpr int64_t kMaxVocab = int64_t{1} << 23;

// Enqueues the kernel on `stream`; an empty string on success, else why not.
std::string launch_kept_set(const KeptSetArgs& args, cudaStream_t stream);

}  // namespace jaxrl_kept
