// Host interface between the XLA FFI handler (plain C++) and the CUDA launcher.
//
// The SM90 forward computes, for every row n of hidden [N, D] and the vocabulary
// projection W (weight [V, D] "vd" or [D, V] "dv", optional f32 bias [V]):
//   z_v = (hidden_n . W_v + bias_v) / T
//   lse_n = logsumexp_v z_v,   entropy_n = lse_n - sum_v softmax(z)_v z_v,
//   logp_n = z_{target_n} - lse_n
// without writing z to global memory. Rows are processed in blocks of 128 and the
// vocabulary in tiles of 256 split into `splits` contiguous ranges; each (row block,
// split) "unit" leaves 3 floats per row in `partials` ([splits][3][N]) that a small
// second kernel combines.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

namespace jaxrl_sm90 {

enum class DType { kBF16, kF16 };

// How the work is laid out over the persistent grid (see choose_plan).
struct Plan {
  int row_blocks = 0;   // P = ceil(N / 128)
  int vocab_tiles = 0;  // Vt = ceil(V / 256)
  int splits = 0;       // S: contiguous vocabulary ranges per row block
  int group_rows = 0;   // row blocks per L2 group (units are ordered group, split, row)
  int grid = 0;         // persistent CTAs (<= number of SMs)
  long long makespan = 0;  // most 128x256 tiles any CTA computes
};

struct Args {
  const void* hidden = nullptr;     // [N, D]
  const void* weight = nullptr;     // [V, D] or [D, V]
  const float* bias = nullptr;      // [V] or null
  const int32_t* targets = nullptr; // [N]
  const uint8_t* row_valid = nullptr;  // [N] (bool)
  float* logp = nullptr;            // [N] out
  float* entropy = nullptr;         // [N] out
  float* lse = nullptr;             // [N] out
  float* partials = nullptr;        // [splits * 3 * N] scratch
  int n = 0, v = 0, d = 0;
  DType dtype = DType::kBF16;
  bool weight_dv = false;
  float temperature = 1.0f;
};

constexpr int kBlockM = 128;
constexpr int kBlockN = 256;
constexpr int kStages = 4;  // shared-memory pipeline depth (4 x 48 KiB)

// Plan for N rows, V vocabulary entries on a device with `num_sms` SMs.
// `force_splits` > 0 overrides the split count (tuning only).
Plan choose_plan(int n, int v, int num_sms, int force_splits = 0);

inline size_t partials_bytes(const Plan& plan, int n) {
  return sizeof(float) * 3ull * static_cast<size_t>(plan.splits) * static_cast<size_t>(n);
}

// Enqueues both kernels on `stream`. Returns an empty string on success, else
// the reason. Never synchronises, never allocates device memory.
std::string launch(const Args& args, const Plan& plan, cudaStream_t stream);

// Information about the build, for the Python module.
std::string build_info();

}  // namespace jaxrl_sm90
