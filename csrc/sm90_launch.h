// Host interface between the XLA FFI handlers (plain C++, ffi_*.cc) and the CUDA launchers.
// Each launcher takes an `...Args` struct of device pointers and sizes; the kernels' own
// parameter structs (StatsParams, GradParams) extend these with what the launch derives
// (the unit layout of the plan, 1/T), so the fields are named and copied once.
//
// Forward (`launch`):
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
  int row_blocks = 0;      // P = ceil(N / 128)
  int vocab_tiles = 0;     // Vt = ceil(V / 256)
  int splits = 0;          // S: contiguous vocabulary ranges per row block
  int group_rows = 0;      // row blocks per L2 group (units are ordered group, split, row)
  int grid = 0;            // persistent CTAs (<= number of SMs)
  long long makespan = 0;  // most 128x256 tiles any CTA computes
};

struct ForwardArgs {
  const void* hidden = nullptr;        // [N, D]
  const void* weight = nullptr;        // [V, D] or [D, V]
  const float* bias = nullptr;         // [V] or null
  const int32_t* targets = nullptr;    // [N]
  const uint8_t* row_valid = nullptr;  // [N] (bool)
  float* logp = nullptr;               // [N] out
  float* entropy = nullptr;            // [N] out
  float* lse = nullptr;                // [N] out
  float* partials = nullptr;           // [splits * 3 * N] scratch
  // [N, V] in the head's dtype, or null. When set, the kernel also writes the logits
  // hidden . W^T (before bias and temperature) rounded to that dtype, and takes the row
  // statistics from the rounded values (the target logit stays unrounded): the forward of
  // memory="fast", whose backward forms the softmax from the same rounded logits.
  void* logits = nullptr;
  // [N] raw logits, or null. With `logits` set, the kernel writes instead the relative
  // probabilities E = exp((y - exp_offsets[row]) / T) rounded to the head's dtype (0 on rows
  // that are not valid), and takes the row statistics from the unrounded logits: the forward
  // of memory="fast"'s relative form (jaxrl_kernels/head/relative_probs.py).
  const float* exp_offsets = nullptr;
  int n = 0, v = 0, d = 0;
  DType dtype = DType::kBF16;
  bool weight_dv = false;
  float temperature = 1.0f;
};

constexpr int kBlockM = 128;
constexpr int kBlockN = 256;
constexpr int kStages = 4;  // shared-memory pipeline depth (4 x 48 KiB)

// Plan for N rows, V vocabulary entries on a device with `num_sms` SMs.
// `force_splits` > 0 sets the split count (ffi.linear.Config.splits, the forward call's `splits`
// attribute); 0 lets the planner choose.
// `tile_cols`: the kernel's vocabulary tile (256 here, 128 for distillation).
Plan choose_plan(int n, int v, int num_sms, int force_splits = 0, int tile_cols = kBlockN);

inline size_t partials_bytes(const Plan& plan, int n) {
  return sizeof(float) * 3ull * static_cast<size_t>(plan.splits) * static_cast<size_t>(n);
}

// Enqueues both kernels on `stream`. Returns an empty string on success, else
// the reason. Never synchronises, never allocates device memory.
std::string launch(const ForwardArgs& args, const Plan& plan, cudaStream_t stream);

// Backward, first stage (`launch_grad`): for the vocabulary chunk [start, start + size)
// (start a multiple of 256, read from device memory so one compiled call serves every
// chunk of a loop), G[n, c] = d loss / d z[n, start + c] / s_n as float16 [N, size]; see
// sm90_grad_kernel.cuh for the formula and the per-row coefficients. Alongside, the float16
// copy of the chunk's weight columns scaled by sigma_W, for the d_hidden GEMM that follows.
struct GradArgs {
  const void* hidden = nullptr;
  const void* weight = nullptr;
  const float* bias = nullptr;       // [V] or null
  const int32_t* targets = nullptr;  // [N]; ids outside [0, V) add no one-hot term
  const float* lse = nullptr;        // [N]
  const float* alpha = nullptr;      // [N]
  const float* beta = nullptr;       // [N]
  const float* gamma = nullptr;      // [N] or null
  // The truncated softmax's per-row floor on u = z / T ([N], float32), or null: no floor (a
  // kernel without it). p = 0 where u < floor (lse and the entropy in beta are then the kept
  // set's); the one-hot term of the target is not masked.
  const float* floor = nullptr;
  const int32_t* start_ptr = nullptr;  // [1], device memory, or null: `start`
  int start = 0;                       // the chunk's first column, a multiple of 256
  const float* w_scale = nullptr;      // [1], device memory: sigma_W; or null, and then:
  const uint32_t* wmax = nullptr;      //   max |W| of the chunk (sm90_weight_absmax.cuh) gives sigma_W,
  float* inv_scale = nullptr;          //   1 / sigma_W is written here,
  uint32_t* next_wmax = nullptr;       //   and max |W| of the columns [next_start, next_start +
  int next_start = 0, next_size = 0;   //   next_size) is folded into *next_wmax (if not null)
  void* out = nullptr;                 // [N, ld] float16 (columns [size, ld) written as 0)
  void* w16 = nullptr;                 // [ld, D] ("vd", rows past size 0) or [D, size] ("dv") float16:
                                       // f16(sigma_W W) of the chunk, or null
  int64_t w16_ld = 0;                  // "dv": the copy's row stride in elements; 0: size
  int n = 0, v = 0, d = 0, size = 0;
  int ld = 0;  // G's row stride; 0: size
  DType dtype = DType::kBF16;
  bool weight_dv = false;
  float temperature = 1.0f;
};

// One unit per 128 x 256 tile of the chunk, ordered for L2 reuse like the forward's.
Plan choose_grad_plan(int n, int size, int num_sms, int tile_cols = kBlockN);

std::string launch_grad(const GradArgs& args, const Plan& plan, cudaStream_t stream);

// The grad kernel's weight copy alone (its w16, w_scale / wmax, inv_scale and next_* fields), by
// a kernel on the whole GPU: for a chunk whose tiles are too few to hide the copy under them.
std::string launch_weight_copy(const GradArgs& args, int sm_count, cudaStream_t stream);

// Who writes each chunk's float16 weight copy: the grad kernel's producer warps (kInKernel), or
// launch_weight_copy before it (kApart); kAuto: choose_weight_copy's pick for the chunk's plan.
enum class WeightCopy { kAuto = 0, kInKernel = 1, kApart = 2 };

// How d_hidden's float16 GEMM covers its output (gemm_d_hidden): kAuto, hidden_plan's choice of
// K's parts and tile width; kWide (256) or kNarrow (128) pinned, K unsplit, for measuring the
// rule. A tile's width leaves each sum as it is: kWide and kNarrow give the same bits, and kAuto
// too where it does not split K.
enum class HiddenTiles { kAuto = 0, kWide = 1, kNarrow = 2 };

// kApart where the chunk has fewer row blocks of 128 than this: a CTA's share of the copy grows
// with the chunk's columns and D, its tiles' time with the columns, D and the rows, so the rows
// alone decide whether the producer warps, with few loads in flight, finish their share of the
// copy under the tiles (docs/performance.md, "Kernel constants").
constexpr int kCopyMinRowBlocks = 16;
WeightCopy choose_weight_copy(const Plan& grad_plan);

// The whole backward of the head (`launch_backward`, sm90_backward.cu): for each vocabulary
// chunk of `chunk` columns in order, the grad kernel above writes G_c and W16_c, and two
// CUTLASS GEMMs (sm90_head_gemm.cuh) consume them:
//   acc   = G_c . W16_c / sigma_c + (c > 0) acc      float32 [N, D]
//   d_W_c = dw_scale G_c^T . h16                      W's dtype, in place in d_weight
//   d_b_c = sum_n s_n G_c[n]                          float32, with a bias
// W16_c is f16(sigma_c W_c) with sigma_c the power of two of the chunk's own max |W|, and the
// GEMM's alpha is 1 / sigma_c, so acc is d_hidden up to the row scale s, applied by the caller.
// Scalars live in device memory: scalars = {dw_scale, 1}.
struct BackwardArgs {
  GradArgs grad;                     // hidden, weight, bias, targets, lse, alpha, beta, gamma, floor, n,
                                     // v, d, dtype, weight_dv, temperature (start/out/w16/size: per
                                     // chunk)
  const void* h16 = nullptr;         // [N, D] float16
  const float* row_scale = nullptr;  // [N] s (for d_bias), or null without a bias
  const float* scalars = nullptr;    // [2] device: dw_scale, 1
  float* acc = nullptr;              // [N, D] out
  void* d_weight = nullptr;          // W's shape and dtype, out
  float* d_bias = nullptr;           // [V] out, or null
  void* workspace = nullptr;         // backward_workspace_bytes(...)
  int chunk = 0;                     // columns per chunk, a multiple of 256
  int sm_count = 0;
  // K ids per row (linear_logprobs at [N, K] ids): G[n, id] += id_coef[n, k] for each
  // ids[n, k] in [0, V) (a repeated id adds twice); the targets then are all -1. id_k = 0: none.
  const int32_t* ids = nullptr;    // [N, K]
  const float* id_coef = nullptr;  // [N, K], in units of G (g_k / (s T))
  int id_k = 0;
  WeightCopy weight_copy = WeightCopy::kAuto;
  bool split_k = true;  // false: d_hidden's GEMM never splits K (gemm_d_hidden)
  HiddenTiles hidden_tiles = HiddenTiles::kAuto;
};

// Bytes of the backward's workspace: G, the weight copy, a tail buffer for d_weight, each
// chunk's max |W| and 1 / sigma, and the GEMMs' own workspace, each 256-byte aligned.
size_t backward_workspace_bytes(int n, int v, int d, int chunk, bool weight_dv, DType dtype, bool split_k = true,
                                HiddenTiles hidden_tiles = HiddenTiles::kAuto);

std::string launch_backward(const BackwardArgs& args, cudaStream_t stream);

// Distillation between two heads (sm90_distill_kernel.cuh): the student's hidden [N, D_s] and
// W_s [V, D_s], the teacher's hidden [N, D_t] and W_t [V, D_t] (both "vd", no bias, one 16-bit
// dtype), tiles of 128 x 128 with both heads' logits side by side. `mode` picks the epilogue:
//   kPairStats      partials [splits][kPairStatsK][N]: (m_s, s_s, A_s, m_t, s_t, A_t, min z_t)
//                   per row and vocabulary split (divergence_math.pair_stats_update's, in
//                   units of z = logit / T, and the smallest teacher logit);
//   kJsdSums        partials [splits][2][N]: (KL_t, KL_s) given lse_s, lse_t;
//   kGrad...        out [N, size] float16: G = coef_n dd/dz_s over the chunk [start, start +
//                   size) of the vocabulary (start at *start_ptr, a multiple of 128), given
//                   lse_s, lse_t and row_value (the reverse KL's d, the JSD's KL_s).
constexpr int kDistillBlockN = 128;
constexpr int kPairStatsK = 7;

enum class DistillMode { kPairStats, kJsdSums, kGradReverseKl, kGradForwardKl, kGradJsd };

struct DistillArgs {
  const void* hidden_s = nullptr;
  const void* weight_s = nullptr;
  const void* hidden_t = nullptr;
  const void* weight_t = nullptr;
  int n = 0, v = 0, d_s = 0, d_t = 0;
  DType dtype = DType::kBF16;
  float temperature = 1.0f;
  float beta = 0.5f;                   // the JSD's
  const float* lse_s = nullptr;        // [N] (kJsdSums, kGrad...)
  const float* lse_t = nullptr;        // [N]
  const float* row_value = nullptr;    // [N] (kGrad...)
  const float* coef = nullptr;         // [N] (kGrad...)
  float* partials = nullptr;           // kPairStats, kJsdSums
  const int32_t* start_ptr = nullptr;  // [1] device memory (kGrad...)
  int size = 0;                        // the chunk's columns (kGrad...)
  void* out = nullptr;                 // [N, size] float16 (kGrad...)
};

// The plans: (row block, split) units over tiles of 128 columns for the statistics, and one
// tile a unit over a chunk of `size` columns for the gradient.
Plan choose_distill_plan(int n, int v, int num_sms, int force_splits = 0);
Plan choose_distill_grad_plan(int n, int size, int num_sms);

std::string launch_distill(const DistillArgs& args, DistillMode mode, const Plan& plan, cudaStream_t stream);

// Information about the build, for the Python module.
std::string build_info();

}  // namespace jaxrl_sm90
