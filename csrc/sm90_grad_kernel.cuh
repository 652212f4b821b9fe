// SM90 (Hopper) linear log-prob backward, first stage: the gradient with respect to the
// logits of one vocabulary chunk, recomputed from hidden and W and written as float16.
//
// For the columns [start, start + size) of z = (hidden . W^T + b) / T, with the saved
// lse and the per-row coefficients prepared by the caller (s is a per-row bound of |dz|):
//   d = z - lse = ln p,   p = exp(d)
//   G = dz / s = alpha [v == target] - p (beta + gamma d)
// where alpha = g / (s T), beta = (g + g_ent H) / (s T), gamma = g_ent / (s T) (0 without
// an entropy cotangent). G lies in [-1, 1], so float16 keeps 11 significant bits of it.
// Rows that get no gradient have lse = +inf and alpha = beta = gamma = 0: G = 0 there.
//
// The tiles come from the shared mainloop (sm90_common.cuh); every unit is one 128 x 256
// tile, so nothing is reduced across CTAs and every element is written exactly once.
#pragma once

#include <cuda_fp16.h>

#include "sm90_common.cuh"

namespace jaxrl_sm90 {

struct GradParams {
  const float* bias;      // [V] or null
  const int32_t* targets; // [N]; ids outside [0, V) add no one-hot term
  const float* lse;       // [N]
  const float* alpha;     // [N]
  const float* beta;      // [N]
  const float* gamma;     // [N] or null
  const int32_t* start;   // device scalar: the chunk's first column, a multiple of 256
  __half* out;            // [N, size]
  Units units;            // vocab = V of W; vocab_tiles = the chunk's tiles
  int size;
  float inv_t;
};

// G for one row half r of a finished tile, stored to out_row[8 j + e] (this lane's columns
// of the tile, 2 q already added) where 8 j + e < col_limit.
template <bool kEntropy, class Acc>
__device__ __forceinline__ void write_grad_row(const Acc& acc, int r, const float* bias_lane, bool has_bias,
                                               float lse, float alpha, float beta, float gamma, int tgt_rel,
                                               float inv_t, __half* out_row, int col_limit, bool paired) {
  constexpr float kLog2e = 1.4426950408889634f;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kBlockN / 8; ++j) {
    float b0 = 0.f, b1 = 0.f;
    if (has_bias) {
      float2 b = *reinterpret_cast<const float2*>(bias_lane + 8 * j);
      b0 = b.x;
      b1 = b.y;
    }
    float gv[2];
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 2; ++e) {
      float y = acc(4 * j + 2 * r + e) + (e ? b1 : b0);
      // ln p, kept finite so that p = 0 times the coefficients stays 0 on rows with lse = +inf
      float d = fmaxf(fmaf(y, inv_t, -lse), -30000.f);
      float pz = ex2(d * kLog2e);
      float v = kEntropy ? -pz * fmaf(gamma, d, beta) : -pz * beta;
      gv[e] = (8 * j + e == tgt_rel) ? v + alpha : v;
    }
    const int c = 8 * j;
    if (paired && c + 1 < col_limit) {
      *reinterpret_cast<__half2*>(out_row + c) = __floats2half2_rn(gv[0], gv[1]);
    } else {
      if (c < col_limit) out_row[c] = __float2half_rn(gv[0]);
      if (c + 1 < col_limit) out_row[c + 1] = __float2half_rn(gv[1]);
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    linear_grad_kernel(const __grid_constant__ GradParams p, const __grid_constant__ typename Cfg::TmaA tma_a,
                       const __grid_constant__ typename Cfg::TmaB tma_b) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  auto& smem = shared_storage<Cfg>(smem_raw);
  const Units& g = p.units;
  const int start = *p.start;

  const int warp_group = threadIdx.x / 128;
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  const int lane_predicate = cute::elect_one_sync();
  prefetch_tma<Cfg>(tma_a, tma_b, warp_idx, lane_predicate);
  auto pipeline = make_pipeline<Cfg>(smem, warp_group, warp_idx, lane_predicate);
  __syncthreads();

  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Cfg::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Cfg::SmemLayoutB{});

  if (warp_group == 0) {
    produce_tiles<Cfg>(pipeline, tma_a, tma_b, sA, sB, g, start / kBlockN, warp_idx, lane_predicate);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<232>();
  const auto [ct, cwg, q, row_in_tile] = consumer_lane();
  const int k_tiles = (g.depth + kBlockK - 1) / kBlockK;

  typename Cfg::TiledMma mma;
  auto thr = mma.get_slice(ct);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, make_shape(typename Cfg::BM{}, typename Cfg::BN{}));

  cutlass::PipelineState<kStages> rstate;
  const bool has_bias = p.bias != nullptr;
  const bool paired = (p.size % 2) == 0;  // 4-byte aligned column pairs

  for (int u = blockIdx.x; u < g.num_units; u += gridDim.x) {
    Unit w = decode_unit(u, g.row_blocks, g.splits, g.group_rows, g.vocab_tiles);
    int rows[2] = {w.row_block * kBlockM + row_in_tile, w.row_block * kBlockM + row_in_tile + 8};
    float lse[2], alpha[2], beta[2], gamma[2];
    int tgt[2];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      const bool in = rows[r] < g.n_rows;
      lse[r] = in ? p.lse[rows[r]] : INFINITY;
      alpha[r] = in ? p.alpha[rows[r]] : 0.f;
      beta[r] = in ? p.beta[rows[r]] : 0.f;
      gamma[r] = (in && p.gamma) ? p.gamma[rows[r]] : 0.f;
      tgt[r] = in ? p.targets[rows[r]] : -1;
    }

    for (int vt = w.vt_begin; vt < w.vt_end; ++vt) {
      const int local0 = vt * kBlockN;
      const int col0 = start + local0;
      float* bias_tile = smem.bias[cwg][vt & 1];
      if (has_bias) bias_tile_start(bias_tile, p.bias, col0, g.vocab, ct);
      mma_tile<Cfg>(pipeline, rstate, mma, tCrA, tCrB, acc, k_tiles);
      if (has_bias) bias_tile_wait(cwg);

      const float* bias_lane = bias_tile + 2 * q;
      const int col_limit = p.size - local0 - 2 * q;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        if (rows[r] >= g.n_rows) continue;
        __half* out_row = p.out + static_cast<size_t>(rows[r]) * p.size + local0 + 2 * q;
        const int tgt_rel = tgt[r] - col0 - 2 * q;  // the target is element 8 j + e == tgt_rel
        if (p.gamma) {
          write_grad_row<true>(acc, r, bias_lane, has_bias, lse[r], alpha[r], beta[r], gamma[r], tgt_rel,
                               p.inv_t, out_row, col_limit, paired);
        } else {
          write_grad_row<false>(acc, r, bias_lane, has_bias, lse[r], alpha[r], beta[r], 0.f, tgt_rel,
                                p.inv_t, out_row, col_limit, paired);
        }
      }
    }
  }
#endif
}

template <class T, bool kDv>
std::string launch_grad_typed(const GradArgs& args, const Plan& plan, cudaStream_t stream) {
  using Cfg = Config<T, kDv>;
  GradParams p;
  p.bias = args.bias;
  p.targets = args.targets;
  p.lse = args.lse;
  p.alpha = args.alpha;
  p.beta = args.beta;
  p.gamma = args.gamma;
  p.start = args.start;
  p.out = static_cast<__half*>(args.out);
  p.units = units_of(plan, args.n, args.v, args.d);
  p.size = args.size;
  p.inv_t = 1.0f / args.temperature;
  return launch_tiles<Cfg>(&linear_grad_kernel<Cfg>, p, args.hidden, args.weight, args.n, args.v, args.d,
                           plan.grid, stream, "linear_grad_kernel");
}

}  // namespace jaxrl_sm90
