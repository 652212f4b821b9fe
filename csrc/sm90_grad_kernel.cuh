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
// With a per-row floor (GradArgs.floor: a truncated softmax, lse and H the kept set's),
// p = 0 where u = y / T < floor; the one-hot term alpha stays wherever the target lies. The
// floor is a template parameter of the kernel: without one the kernel is the one it was
// before the floor existed (no load, no compare).
//
// The tiles come from the shared mainloop (sm90_common.cuh); every unit is one 128 x 256
// tile, so nothing is reduced across CTAs and every element is written exactly once.
#pragma once

#include <cuda_fp16.h>

#include "sm90_common.cuh"
#include "sm90_weight_absmax.cuh"

namespace jaxrl_sm90 {

// The launch's GradArgs (sm90_launch.h: the chunk, its output G and weight copy, the max |W|
// bookkeeping) with `ld` resolved (size <= ld <= vocab_tiles * 256; "dv" has ld == size),
// and what the launch derives: the unit layout (vocab = V of W; vocab_tiles = the chunk's
// tiles) and 1/T.
struct GradParams : GradArgs {
  Units units;
  float inv_t;
};

// G of one logit y (bias added) of a row with coefficients (lse, alpha, beta, gamma) and, with
// kFloor, the row's floor on u = y / T.
template <bool kEntropy, bool kFloor>
__device__ __forceinline__ float grad_of_logit(float y, float inv_t, float lse, float alpha, float beta, float gamma,
                                               float u_floor, bool is_target) {
  constexpr float kLog2e = 1.4426950408889634f;
  // ln p, kept finite so that p = 0 times the coefficients stays 0 on rows with lse = +inf
  // (and on logits below the floor, whose d is also clamped and then multiplied by p = 0)
  const float d = fmaxf(fmaf(y, inv_t, -lse), -30000.f);
  float pz = ex2(d * kLog2e);
  if constexpr (kFloor) {
    // kept where u >= floor (a NaN u or floor is not kept: jnp.where(z >= floor, p, 0))
    if (!(y * inv_t >= u_floor)) pz = 0.f;
  }
  const float v = kEntropy ? -pz * fmaf(gamma, d, beta) : -pz * beta;
  return is_target ? v + alpha : v;
}

// The per-row inputs of G for this lane's two rows (row_in_tile and row_in_tile + 8).
struct LaneRows {
  float lse[2], alpha[2], beta[2], gamma[2];
  float floor[2];  // read only by kernels with a floor
  int tgt_rel[2];  // target column - (tile's first column + 2 q): element 8 j + e is the target
};

// The epilogue: G of the tile, through store_tile_16bit (sm90_common.cuh).
template <bool kEntropy, bool kFloor, class Acc>
__device__ __forceinline__ void write_grad_tile(const Acc& acc, const float* bias_lane, bool has_bias,
                                                const LaneRows& c, float inv_t, uint16_t* stage, __half* out,
                                                int warp_row0, int n_rows, int size, int ld, int local0,
                                                bool vector_ok) {
  auto pairs = [&](int j, uint32_t (&bits)[2]) __attribute__((always_inline)) {
    float b[2] = {0.f, 0.f};
    if (has_bias) {
      float2 bb = *reinterpret_cast<const float2*>(bias_lane + 8 * j);
      b[0] = bb.x;
      b[1] = bb.y;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      float gv[2];
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 2; ++e) {
        gv[e] = grad_of_logit<kEntropy, kFloor>(acc(4 * j + 2 * r + e) + b[e], inv_t, c.lse[r], c.alpha[r], c.beta[r],
                                                c.gamma[r], kFloor ? c.floor[r] : 0.f, 8 * j + e == c.tgt_rel[r]);
      }
      const __half2 h = __floats2half2_rn(gv[0], gv[1]);
      bits[r] = reinterpret_cast<const uint32_t&>(h);
    }
  };
  store_tile_16bit(pairs, stage, reinterpret_cast<uint16_t*>(out), warp_row0, n_rows, size, ld, local0, vector_ok);
}

// The chunk's float16 weight copy  w16 = f16(sigma_W W[:, start : start + size])  for the
// d_hidden GEMM that follows, in 16-byte vectors: this thread writes vectors first, first +
// stride, ... W's columns are its rows in "vd" (one contiguous block, padded with zero rows up to
// ld) and strided rows of 8k elements in "dv". Without a given sigma_W the chunk is scaled by its
// own max |W| (sigma_W = weight_scale_of_max), and the next chunk's max |W| is folded in for the
// next launch. Two callers: the grad kernel's otherwise idle producer warps (its memory traffic
// runs under the tensor-core-bound tiles) and, where the tiles are too few to cover it,
// weight_copy_kernel on the whole GPU before them (choose_weight_copy in sm90_launch.cu).
constexpr int kCopyThreads = 96;  // the grad kernel's producer warps 1-3
constexpr int kCopyInFlight = 4;

template <class T, bool kDv>
__device__ __forceinline__ void copy_weight_chunk(const GradArgs& p, int start, int64_t first, int64_t stride) {
  const float scale = p.w_scale ? *p.w_scale : weight_scale_of_max(*p.wmax);
  if (p.inv_scale && first == 0) *p.inv_scale = 1.f / scale;  // exact: a power of two
  const int64_t depth = p.d, vocab = p.v, size = p.size, w16_ld = p.w16_ld ? p.w16_ld : size;
  const T* weight = static_cast<const T*>(p.weight);
  // "vd" walks the ld rows of the copy, the ones past size reading as 0; "dv" walks W's range
  const int64_t src_vecs = size * depth / 8;
  VectorWalk it = weight_walk<kDv>(kDv ? size : p.ld, depth, first, stride);
  while (it.more()) {
    VectorWalk at = it;        // the loads walk ahead; `it` follows with the stores
    uint4 raw[kCopyInFlight];  // compile-time indices only: the array stays in registers
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCopyInFlight; ++j, at.next()) {
      raw[j] = (at.more() && (kDv || at.col < src_vecs))
                   ? __ldg(reinterpret_cast<const uint4*>(weight + weight_offset<kDv>(at, start, depth, vocab)))
                   : make_uint4(0, 0, 0, 0);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCopyInFlight; ++j, it.next()) {
      if (!it.more()) continue;
      const T* w = reinterpret_cast<const T*>(&raw[j]);
      uint4 out;
      __half2* o = reinterpret_cast<__half2*>(&out);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; ++e) {
        o[e] = __floats2half2_rn(static_cast<float>(w[2 * e]) * scale, static_cast<float>(w[2 * e + 1]) * scale);
      }
      const int64_t dst = kDv ? it.row * w16_ld + 8 * it.col : 8 * it.col;
      *reinterpret_cast<uint4*>(static_cast<__half*>(p.w16) + dst) = out;
    }
  }
  if (p.next_wmax) {
    fold_weight_absmax<T, kDv>(weight, p.next_start, p.next_size, depth, vocab, first, stride, p.next_wmax);
  }
}

// The copy alone, every thread of the grid walking the chunk (GradArgs as the grad kernel's).
template <class T, bool kDv>
__global__ void __launch_bounds__(256) weight_copy_kernel(const __grid_constant__ GradArgs p) {
  copy_weight_chunk<T, kDv>(p, p.start, blockIdx.x * int64_t{blockDim.x} + threadIdx.x,
                            int64_t{gridDim.x} * blockDim.x);
}

// kFloor: p.floor is set (a truncated softmax), read per row; false: p.floor is not read.
template <class Cfg, bool kFloor>
__global__ void __launch_bounds__(kThreads, 1)
    linear_grad_kernel(const __grid_constant__ GradParams p, const __grid_constant__ typename Cfg::TmaA tma_a,
                       const __grid_constant__ typename Cfg::TmaB tma_b) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  auto& storage = aligned_shared<StagedStorage<Cfg>>(smem_raw);
  const Units& g = p.units;
  const int start = p.start_ptr ? *p.start_ptr : p.start;
  auto copy_weight = [&](int warp_idx) {
    if (warp_idx > 0 && p.w16 != nullptr) {
      copy_weight_chunk<typename Cfg::Element, Cfg::kWeightDv>(
          p, start, blockIdx.x * int64_t{kCopyThreads} + (threadIdx.x - 32), int64_t{gridDim.x} * kCopyThreads);
    }
  };
  run_tile_kernel<Cfg>(storage.main, tma_a, tma_b, g, start / kBlockN, p.bias, copy_weight,
                       [&](const ConsumerLane& lane, auto& acc, auto& compute_tile) __attribute__((always_inline)) {
    const auto [ct, cwg, q, row_in_tile] = lane;
    const bool has_bias = p.bias != nullptr;
    __half* const out = static_cast<__half*>(p.out);
    const bool vector_ok = (p.ld % 8) == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
    uint16_t* stage = storage.stage.slice[ct / 32];

    for (int u = blockIdx.x; u < g.num_units; u += gridDim.x) {
      Unit w = decode_unit(u, g.row_blocks, g.splits, g.group_rows, g.vocab_tiles);
      const int rows[2] = {w.row_block * kBlockM + row_in_tile, w.row_block * kBlockM + row_in_tile + 8};
      LaneRows c;
      int tgt[2];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const bool in = rows[r] < g.n_rows;
        c.lse[r] = in ? p.lse[rows[r]] : INFINITY;
        c.alpha[r] = in ? p.alpha[rows[r]] : 0.f;
        c.beta[r] = in ? p.beta[rows[r]] : 0.f;
        c.gamma[r] = (p.gamma && in) ? p.gamma[rows[r]] : 0.f;
        c.floor[r] = (kFloor && in) ? p.floor[rows[r]] : 0.f;  // rows past N: lse = +inf, p = 0
        tgt[r] = in ? p.targets[rows[r]] : -1;
      }

      for (int vt = w.vt_begin; vt < w.vt_end; ++vt) {
        const int local0 = vt * kBlockN;
        const int col0 = start + local0;
        const float* bias_lane = compute_tile(vt, col0) + 2 * q;
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) c.tgt_rel[r] = tgt[r] - col0 - 2 * q;
        const int warp_row0 = rows[0] - (threadIdx.x % 32) / 4;
        if (p.gamma) {
          write_grad_tile<true, kFloor>(acc, bias_lane, has_bias, c, p.inv_t, stage, out, warp_row0, g.n_rows, p.size,
                                        p.ld, local0, vector_ok);
        } else {
          write_grad_tile<false, kFloor>(acc, bias_lane, has_bias, c, p.inv_t, stage, out, warp_row0, g.n_rows, p.size,
                                         p.ld, local0, vector_ok);
        }
      }
    }
  });
#endif
}

template <class T, bool kDv>
std::string launch_grad_typed(const GradArgs& args, const Plan& plan, cudaStream_t stream) {
  using Cfg = Config<T, kDv>;
  GradParams p = tile_params<GradParams>(args, plan);
  p.ld = args.ld > 0 ? args.ld : args.size;
  p.inv_t = 1.0f / args.temperature;
  if (args.floor) {
    return launch_tiles<Cfg>(&linear_grad_kernel<Cfg, true>, p, plan.grid, stream, "linear_grad_kernel (floor)",
                             kStagedSmemBytes<Cfg>);
  }
  return launch_tiles<Cfg>(&linear_grad_kernel<Cfg, false>, p, plan.grid, stream, "linear_grad_kernel",
                           kStagedSmemBytes<Cfg>);
}

template <class T, bool kDv>
std::string launch_weight_copy_typed(const GradArgs& args, int sm_count, cudaStream_t stream) {
  weight_copy_kernel<T, kDv><<<8 * sm_count, 256, 0, stream>>>(args);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string("weight_copy_kernel launch: ") + cudaGetErrorString(err);
}

}  // namespace jaxrl_sm90
