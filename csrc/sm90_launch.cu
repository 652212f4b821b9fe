// Host side of the SM90 kernels: plans, the forward's combine kernel, launches.
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include <cutlass/version.h>

#include "sm90_instances.h"
#include "sm90_plan.h"

namespace jaxrl_sm90 {

constexpr float kLn2 = 0.6931471805599453f;

// One thread per row: merge the splits' (m, s, a) and finish logp / entropy / lse.
// entropy is written for every row (the backward needs it); the caller masks it.
__global__ void combine_kernel(const float* __restrict__ partials, const int32_t* __restrict__ targets,
                               const uint8_t* __restrict__ row_valid, float* logp, float* __restrict__ entropy,
                               float* __restrict__ lse, int n_rows, int vocab, int splits, float c1, float inv_t) {
  int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= n_rows) return;
  const size_t stride = static_cast<size_t>(n_rows);
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, partials[3 * s * stride + n]);
  float sum = 0.f, acc = 0.f;
  for (int s = 0; s < splits; ++s) {
    float m = partials[3 * s * stride + n];
    if (m == -INFINITY) continue;  // a split that saw no column of this row
    float sv = partials[(3 * s + 1) * stride + n];
    float av = partials[(3 * s + 2) * stride + n];
    float d = (m - mx) * c1;
    float w = exp2f(d);
    sum += w * sv;
    acc += w * (av + sv * d);
  }
  float log2s = log2f(sum);
  lse[n] = mx * inv_t + kLn2 * log2s;
  entropy[n] = kLn2 * (log2s - acc / sum);
  if (!row_valid[n]) {
    logp[n] = 0.f;
    return;
  }
  int t = targets[n];
  if (t < 0 || t >= vocab) {
    logp[n] = NAN;
    return;
  }
  logp[n] = (logp[n] - mx) * inv_t - kLn2 * log2s;  // logp[n] holds the raw y_t
}

// Most 128x256 tiles any CTA computes when units are dealt round-robin.
static long long makespan(int row_blocks, int splits, int group_rows, int vocab_tiles, int grid) {
  int units = row_blocks * splits;
  long long worst = 0;
  for (int b = 0; b < grid; ++b) {
    long long total = 0;
    for (int u = b; u < units; u += grid) {
      Unit w = decode_unit(u, row_blocks, splits, group_rows, vocab_tiles);
      total += w.vt_end - w.vt_begin;
    }
    worst = std::max(worst, total);
  }
  return worst;
}

Plan choose_plan(int n, int v, int num_sms, int force_splits, int tile_cols) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int, int>, Plan> cache;
  Plan plan;
  plan.row_blocks = (n + kBlockM - 1) / kBlockM;
  plan.vocab_tiles = (v + tile_cols - 1) / tile_cols;
  // 16 row blocks of hidden (2048 rows) live at a time: at D = 4096 that is 16 MiB of L2.
  plan.group_rows = std::min(plan.row_blocks, 16);
  auto key = std::make_tuple(plan.row_blocks, plan.vocab_tiles, num_sms, force_splits);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const int P = plan.row_blocks, Vt = plan.vocab_tiles, G = std::max(1, num_sms);
  int lo = 1, hi = std::min(Vt, 2 * G);
  if (P > plan.group_rows) lo = std::min(Vt, (G + plan.group_rows - 1) / plan.group_rows);
  if (force_splits > 0) lo = hi = std::min(force_splits, Vt);
  long long best = -1;
  for (int S = lo; S <= hi; ++S) {
    int grid = static_cast<int>(std::min<long long>(G, static_cast<long long>(P) * S));
    long long ms = makespan(P, S, plan.group_rows, Vt, grid);
    if (best < 0 || ms < best) {
      best = ms;
      plan.splits = S;
      plan.grid = grid;
      plan.makespan = ms;
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = plan;
  return plan;
}

std::string launch(const ForwardArgs& args, const Plan& plan, cudaStream_t stream) {
  if (args.n == 0) return {};
  std::string why;
  if (args.dtype == DType::kBF16) {
    why = args.weight_dv ? launch_bf16_dv(args, plan, stream) : launch_bf16_vd(args, plan, stream);
  } else {
    why = args.weight_dv ? launch_f16_dv(args, plan, stream) : launch_f16_vd(args, plan, stream);
  }
  if (!why.empty()) return why;
  const int threads = 256;
  const int blocks = (args.n + threads - 1) / threads;
  combine_kernel<<<blocks, threads, 0, stream>>>(
      args.partials, args.targets, args.row_valid, args.logp, args.entropy, args.lse, args.n, args.v, plan.splits,
      static_cast<float>(1.4426950408889634 / args.temperature), 1.0f / args.temperature);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("combine_kernel launch: ") + cudaGetErrorString(err);
  return {};
}

Plan choose_grad_plan(int n, int size, int num_sms, int tile_cols) {
  Plan plan;
  plan.row_blocks = (n + kBlockM - 1) / kBlockM;
  plan.vocab_tiles = (size + tile_cols - 1) / tile_cols;
  plan.splits = plan.vocab_tiles;  // one tile a unit
  plan.group_rows = std::min(plan.row_blocks, 16);
  const long long units = static_cast<long long>(plan.row_blocks) * plan.splits;
  plan.grid = static_cast<int>(std::min<long long>(std::max(1, num_sms), units));
  plan.makespan = (units + plan.grid - 1) / plan.grid;
  return plan;
}

std::string launch_grad(const GradArgs& args, const Plan& plan, cudaStream_t stream) {
  if (args.n == 0 || args.size == 0) return {};
  if (args.dtype == DType::kBF16) {
    return args.weight_dv ? launch_grad_bf16_dv(args, plan, stream) : launch_grad_bf16_vd(args, plan, stream);
  }
  return args.weight_dv ? launch_grad_f16_dv(args, plan, stream) : launch_grad_f16_vd(args, plan, stream);
}

WeightCopy choose_weight_copy(const Plan& grad_plan) {
  return grad_plan.row_blocks < kCopyMinRowBlocks ? WeightCopy::kApart : WeightCopy::kInKernel;
}

std::string launch_weight_copy(const GradArgs& args, int sm_count, cudaStream_t stream) {
  if (args.size == 0) return {};
  if (args.dtype == DType::kBF16) {
    return args.weight_dv ? launch_weight_copy_bf16_dv(args, sm_count, stream)
                          : launch_weight_copy_bf16_vd(args, sm_count, stream);
  }
  return args.weight_dv ? launch_weight_copy_f16_dv(args, sm_count, stream)
                        : launch_weight_copy_f16_vd(args, sm_count, stream);
}

Plan choose_distill_plan(int n, int v, int num_sms, int force_splits) {
  return choose_plan(n, v, num_sms, force_splits, kDistillBlockN);
}

Plan choose_distill_grad_plan(int n, int size, int num_sms) {
  return choose_grad_plan(n, size, num_sms, kDistillBlockN);
}

std::string build_info() {
  int rt = 0;
  cudaRuntimeGetVersion(&rt);
  return "sm_90a; CUDA runtime " + std::to_string(rt / 1000) + "." + std::to_string((rt % 1000) / 10) +
         " (static); CUTLASS " + std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." +
         std::to_string(CUTLASS_PATCH) + "; tile 128x256x64, " + std::to_string(kStages) + " stages";
}

}  // namespace jaxrl_sm90
