// SM90 (Hopper) distillation kernels: both heads' logit tiles of the same rows and columns,
// z_s = hidden_s . W_s^T / T and z_t = hidden_t . W_t^T / T, in registers side by side, and
// per element what the divergence needs of them (jaxrl_kernels/formulas/divergence_math.py has the
// math; the names here are its names). A CTA tile is 128 rows x 128 columns: each consumer
// warpgroup holds 64 rows of both tiles (two m64n128 float32 accumulators, 64 registers
// each). The producer warp streams, for every tile, the student's K tiles and then the
// teacher's through one TMA pipeline of kStages stages, and the consumers run both GEMMs back
// to back with the mainloop of sm90_common.cuh (mma_tile).
//
// Three epilogues (DistillMode, sm90_launch.h):
//   kPairStats  per (row block, vocabulary split) unit and row, the online statistics
//               (m_s, s_s, A_s, m_t, s_t, A_t) of divergence_math.pair_stats_update and the
//               row's smallest teacher logit, to partials [splits][7][N];
//   kJsdSums    given lse_s, lse_t: the sums KL_t, KL_s of jsd_tile_sums, to partials
//               [splits][2][N];
//   kGrad*      one unit per tile of a vocabulary chunk [start, start + size): the student's
//               logit gradient times the row coefficient c_n, G = c_n dd/dz_s, as float16
//               [N, size] (student_grad_tile; c_n = g_n / (T s_n) with s_n a bound of the
//               row's |dd/dz_s|, so |G| <= 1).
// An accumulator acc(i) of a consumer thread, i < 64, holds row 64 cwg + 16 warp + lane / 4 +
// 8 ((i >> 1) & 1) and column 8 (i >> 2) + 2 (lane % 4) + (i & 1) of the tile.
#pragma once

#include <cuda_fp16.h>

#include "sm90_common.cuh"

namespace jaxrl_sm90 {

// Both heads' weights "vd" (K-major), tiles of 128 columns; the bias tiles of Config's shared
// storage go unused.
template <class T>
using DistillConfig = Config<T, false, kDistillBlockN>;

// The TMA descriptors of both heads.
template <class Cfg>
struct HeadPair {
  typename Cfg::TmaA hs;
  typename Cfg::TmaB ws;
  typename Cfg::TmaA ht;
  typename Cfg::TmaB wt;
};

// The launch's DistillArgs, the unit layout and what the launch derives.
struct DistillParams : DistillArgs {
  Units units;  // depth unused: d_s and d_t are DistillArgs's
  float inv_t, log_beta, log_1mbeta;
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2f = 0.6931471805599453f;

__device__ __forceinline__ float exp_e(float x) { return ex2(x * kLog2e); }

// One head's K tiles of one vocabulary tile into the pipeline.
template <class Cfg, class TA, class TB, class GA, class SA, class GB, class SB>
__device__ __forceinline__ void produce_head(typename Cfg::Pipeline& pipeline, cutlass::PipelineState<kStages>& wstate,
                                             const TA& tma_a, const TB& tma_b, GA& tAgA, SA& tAsA, GB& tBgB, SB& tBsB,
                                             int row_block, int col_tile, int k_tiles) {
  for (int kt = 0; kt < k_tiles; ++kt) {
    pipeline.producer_acquire(wstate);
    auto* bar = pipeline.producer_get_barrier(wstate);
    copy(tma_a.with(*bar), tAgA(_, row_block, kt), tAsA(_, wstate.index()));
    copy(tma_b.with(*bar), tBgB(_, col_tile, kt), tBsB(_, wstate.index()));
    ++wstate;
  }
}

// Producer warpgroup: one elected thread streams, for every unit of this CTA and every
// vocabulary tile of it, the student's K tiles, then the teacher's.
template <class Cfg, class SA, class SB>
__device__ __forceinline__ void produce_pairs(typename Cfg::Pipeline& pipeline, const HeadPair<Cfg>& tma, SA& sA,
                                              SB& sB, const DistillParams& p, int vt_offset, int warp_idx,
                                              int lane_predicate) {
  using Pipeline = typename Cfg::Pipeline;
  cutlass::arch::warpgroup_reg_dealloc<40>();
  if (!(warp_idx == 0 && lane_predicate)) return;
  const Units& g = p.units;
  const auto tile_a = make_shape(typename Cfg::BM{}, typename Cfg::BK{});
  const auto tile_b = make_shape(typename Cfg::BN{}, typename Cfg::BK{});
  Tensor gAs = local_tile(tma.hs.get_tma_tensor(make_shape(p.n, p.d_s)), tile_a, make_coord(_, _));
  Tensor gBs = local_tile(tma.ws.get_tma_tensor(make_shape(p.v, p.d_s)), tile_b, make_coord(_, _));
  Tensor gAt = local_tile(tma.ht.get_tma_tensor(make_shape(p.n, p.d_t)), tile_a, make_coord(_, _));
  Tensor gBt = local_tile(tma.wt.get_tma_tensor(make_shape(p.v, p.d_t)), tile_b, make_coord(_, _));
  auto [tAgAs, tAsAs] = tma_partition(tma.hs, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gAs));
  auto [tBgBs, tBsBs] = tma_partition(tma.ws, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gBs));
  auto [tAgAt, tAsAt] = tma_partition(tma.ht, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gAt));
  auto [tBgBt, tBsBt] = tma_partition(tma.wt, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gBt));
  const int kts = (p.d_s + kBlockK - 1) / kBlockK, ktt = (p.d_t + kBlockK - 1) / kBlockK;
  auto wstate = cutlass::make_producer_start_state<Pipeline>();
  for (int u = blockIdx.x; u < g.num_units; u += gridDim.x) {
    Unit w = decode_unit(u, g.row_blocks, g.splits, g.group_rows, g.vocab_tiles);
    for (int vt = w.vt_begin; vt < w.vt_end; ++vt) {
      produce_head<Cfg>(pipeline, wstate, tma.hs, tma.ws, tAgAs, tAsAs, tBgBs, tBsBs, w.row_block, vt + vt_offset, kts);
      produce_head<Cfg>(pipeline, wstate, tma.ht, tma.wt, tAgAt, tAsAt, tBgBt, tBsBt, w.row_block, vt + vt_offset, ktt);
    }
  }
}

// ---- the epilogues' per-row state -------------------------------------------------------

// Online statistics of one row as one lane sees it (its 32 columns of each tile).
struct PairStats {
  float m_s = -INFINITY, s_s = 0.f, a_s = 0.f, m_t = -INFINITY, s_t = 0.f, a_t = 0.f, min_t = INFINITY;
};

__device__ __forceinline__ float rescale_of(float m_old, float m_new) {
  return m_old == -INFINITY ? 0.f : exp_e(m_old - m_new);
}

// Merge another lane's statistics of the same row into `a`.
__device__ __forceinline__ void merge_pair(PairStats& a, const PairStats& b) {
  float ms = fmaxf(a.m_s, b.m_s), mt = fmaxf(a.m_t, b.m_t);
  float ws1 = rescale_of(a.m_s, ms), ws2 = rescale_of(b.m_s, ms);
  float wt1 = rescale_of(a.m_t, mt), wt2 = rescale_of(b.m_t, mt);
  a.s_s = ws1 * a.s_s + ws2 * b.s_s;
  a.a_s = ws1 * a.a_s + ws2 * b.a_s;
  a.s_t = wt1 * a.s_t + wt2 * b.s_t;
  a.a_t = wt1 * a.a_t + wt2 * b.a_t;
  a.m_s = ms;
  a.m_t = mt;
  a.min_t = fminf(a.min_t, b.min_t);
}

__device__ __forceinline__ PairStats shfl_pair(const PairStats& x, int off) {
  PairStats y;
  y.m_s = __shfl_xor_sync(0xffffffffu, x.m_s, off);
  y.s_s = __shfl_xor_sync(0xffffffffu, x.s_s, off);
  y.a_s = __shfl_xor_sync(0xffffffffu, x.a_s, off);
  y.m_t = __shfl_xor_sync(0xffffffffu, x.m_t, off);
  y.s_t = __shfl_xor_sync(0xffffffffu, x.s_t, off);
  y.a_t = __shfl_xor_sync(0xffffffffu, x.a_t, off);
  y.min_t = __shfl_xor_sync(0xffffffffu, x.min_t, off);
  return y;
}

constexpr int kTileJ = kDistillBlockN / 8;  // column groups of 8 per tile

// f(i) for the accumulator index i = 4 j + 2 r + e of each of this lane's columns 8 j + e of
// row r, those below col_limit only when kMasked (fully unrolled: i is a compile-time
// register index).
template <bool kMasked, class F>
__device__ __forceinline__ void each_lane_column(int r, int col_limit, F&& f) {
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kTileJ; ++j) {
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 2; ++e) {
      if (kMasked && 8 * j + e >= col_limit) continue;
      f(4 * j + 2 * r + e);
    }
  }
}

// Fold row r of both tiles (columns < col_limit of this lane's, see fold_tile in
// sm90_stats_kernel.cuh) into `st`.
template <bool kMasked, class Acc>
__device__ __forceinline__ void fold_pair(const Acc& acc_s, const Acc& acc_t, int r, int col_limit, float inv_t,
                                          PairStats& st) {
  float mx_s = -INFINITY, mx_t = -INFINITY, mn_t = INFINITY;
  each_lane_column<kMasked>(r, col_limit, [&](int i) __attribute__((always_inline)) {
    const float zs = acc_s(i) * inv_t, zt = acc_t(i) * inv_t;
    mx_s = fmaxf(mx_s, zs);
    mx_t = fmaxf(mx_t, zt);
    mn_t = fminf(mn_t, zt);
  });
  if (mx_s == -INFINITY) return;  // no column of this lane is in the vocabulary
  const float ms = fmaxf(st.m_s, mx_s), mt = fmaxf(st.m_t, mx_t);
  const float ws = rescale_of(st.m_s, ms), wt = rescale_of(st.m_t, mt);
  float s_s = 0.f, a_s = 0.f, s_t = 0.f, a_t = 0.f;
  each_lane_column<kMasked>(r, col_limit, [&](int i) __attribute__((always_inline)) {
    const float zs = acc_s(i) * inv_t, zt = acc_t(i) * inv_t;
    const float es = exp_e(zs - ms), et = exp_e(zt - mt), diff = zs - zt;
    s_s += es;
    a_s = fmaf(es, diff, a_s);
    s_t += et;
    a_t = fmaf(-et, diff, a_t);
  });
  st.s_s = fmaf(ws, st.s_s, s_s);
  st.a_s = fmaf(ws, st.a_s, a_s);
  st.s_t = fmaf(wt, st.s_t, s_t);
  st.a_t = fmaf(wt, st.a_t, a_t);
  st.m_s = ms;
  st.m_t = mt;
  st.min_t = fminf(st.min_t, mn_t);
}

// log(e^x + e^y) as divergence_math._logaddexp.
__device__ __forceinline__ float logaddexp(float x, float y) {
  return fmaxf(x, y) + __logf(1.f + exp_e(-fabsf(x - y)));
}

// The JSD's per-element terms of row r, summed into kl_t, kl_s.
template <bool kMasked, class Acc>
__device__ __forceinline__ void fold_jsd(const Acc& acc_s, const Acc& acc_t, int r, int col_limit, float inv_t,
                                         float lse_s, float lse_t, float log_b, float log_1mb, float& kl_t,
                                         float& kl_s) {
  each_lane_column<kMasked>(r, col_limit, [&](int i) __attribute__((always_inline)) {
    const float ls = fmaf(acc_s(i), inv_t, -lse_s);
    const float lt = fmaf(acc_t(i), inv_t, -lse_t);
    const float lm = logaddexp(log_b + lt, log_1mb + ls);
    const float pt = exp_e(lt), ps = exp_e(ls);
    if (pt > 0.f) kl_t = fmaf(pt, lt - lm, kl_t);
    if (ps > 0.f) kl_s = fmaf(ps, ls - lm, kl_s);
  });
}

// dd/dz_s of one element (divergence_math.student_grad_tile without g / T).
template <DistillMode kMode>
__device__ __forceinline__ float student_grad(float ls, float lt, float row_value, float beta_c, float log_b,
                                              float log_1mb) {
  const float ps = exp_e(ls);
  if constexpr (kMode == DistillMode::kGradReverseKl) {
    return ps * ((ls - lt) - row_value);  // row_value: d
  } else if constexpr (kMode == DistillMode::kGradForwardKl) {
    return ps - exp_e(lt);
  } else {
    const float lm = logaddexp(log_b + lt, log_1mb + ls);
    return beta_c * ps * ((ls - lm) - row_value);  // beta_c = 1 - beta, row_value: KL_s
  }
}

// ---- the kernel ---------------------------------------------------------------------------

template <class Cfg, DistillMode kMode>
__global__ void __launch_bounds__(kThreads, 1)
    distill_kernel(const __grid_constant__ DistillParams p, const __grid_constant__ HeadPair<Cfg> tma) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kGrad = kMode != DistillMode::kPairStats && kMode != DistillMode::kJsdSums;
  extern __shared__ char smem_raw[];
  auto& smem = shared_storage<Cfg>(smem_raw);
  const Units& g = p.units;
  const int warp_group = threadIdx.x / 128;
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  const int lane_predicate = cute::elect_one_sync();
  if (warp_idx == 0 && lane_predicate) {
    cute::prefetch_tma_descriptor(tma.hs.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma.ws.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma.ht.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma.wt.get_tma_descriptor());
  }
  auto pipeline = make_pipeline<Cfg>(smem, warp_group, warp_idx, lane_predicate);
  __syncthreads();

  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Cfg::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Cfg::SmemLayoutB{});
  const int start = kGrad ? *p.start_ptr : 0;  // the chunk's first column (a multiple of 128)
  if (warp_group == 0) {
    produce_pairs<Cfg>(pipeline, tma, sA, sB, p, start / kDistillBlockN, warp_idx, lane_predicate);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<232>();
  const ConsumerLane lane = consumer_lane();
  const int q = lane.q;
  const int kts = (p.d_s + kBlockK - 1) / kBlockK, ktt = (p.d_t + kBlockK - 1) / kBlockK;

  typename Cfg::TiledMma mma;
  auto thr = mma.get_slice(lane.ct);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc_s = partition_fragment_C(mma, make_shape(typename Cfg::BM{}, typename Cfg::BN{}));
  Tensor acc_t = partition_fragment_C(mma, make_shape(typename Cfg::BM{}, typename Cfg::BN{}));
  static_assert(decltype(size(acc_s))::value == 64, "one m64n128 accumulator per head and thread");
  cutlass::PipelineState<kStages> rstate;

  for (int u = blockIdx.x; u < g.num_units; u += gridDim.x) {
    Unit w = decode_unit(u, g.row_blocks, g.splits, g.group_rows, g.vocab_tiles);
    const int rows[2] = {w.row_block * kBlockM + lane.row_in_tile, w.row_block * kBlockM + lane.row_in_tile + 8};
    PairStats st[2];
    float lse_s[2], lse_t[2], row_value[2], coef[2], kl_t[2] = {0.f, 0.f}, kl_s[2] = {0.f, 0.f};
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      const bool in = rows[r] < p.n;
      lse_s[r] = (kMode != DistillMode::kPairStats && in) ? p.lse_s[rows[r]] : 0.f;
      lse_t[r] = (kMode != DistillMode::kPairStats && in) ? p.lse_t[rows[r]] : 0.f;
      row_value[r] = (kGrad && in) ? p.row_value[rows[r]] : 0.f;
      coef[r] = (kGrad && in) ? p.coef[rows[r]] : 0.f;
    }
    for (int vt = w.vt_begin; vt < w.vt_end; ++vt) {
      mma_tile<Cfg>(pipeline, rstate, mma, tCrA, tCrB, acc_s, kts);
      mma_tile<Cfg>(pipeline, rstate, mma, tCrA, tCrB, acc_t, ktt);
      const int local0 = vt * kDistillBlockN;  // first column of the tile within the chunk
      const int col0 = start + local0;
      const int limit = (kGrad ? p.size - local0 : p.v - col0) - 2 * q;  // valid lane columns: 8 j + e < limit
      const bool masked = limit < kDistillBlockN;
      if constexpr (kMode == DistillMode::kPairStats) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          if (masked) fold_pair<true>(acc_s, acc_t, r, limit, p.inv_t, st[r]);
          else fold_pair<false>(acc_s, acc_t, r, limit, p.inv_t, st[r]);
        }
      } else if constexpr (kMode == DistillMode::kJsdSums) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          if (masked) {
            fold_jsd<true>(acc_s, acc_t, r, limit, p.inv_t, lse_s[r], lse_t[r], p.log_beta, p.log_1mbeta, kl_t[r],
                           kl_s[r]);
          } else {
            fold_jsd<false>(acc_s, acc_t, r, limit, p.inv_t, lse_s[r], lse_t[r], p.log_beta, p.log_1mbeta, kl_t[r],
                            kl_s[r]);
          }
        }
      } else {
        __half* out = static_cast<__half*>(p.out);
        const bool pairs = (p.size % 2) == 0;  // 4-byte aligned __half2 stores
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          if (rows[r] >= p.n) continue;
          __half* row_out = out + static_cast<size_t>(rows[r]) * p.size + local0 + 2 * q;
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kTileJ; ++j) {
            float gv[2];
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < 2; ++e) {
              const float ls = fmaf(acc_s(4 * j + 2 * r + e), p.inv_t, -lse_s[r]);
              const float lt = fmaf(acc_t(4 * j + 2 * r + e), p.inv_t, -lse_t[r]);
              gv[e] = coef[r] * student_grad<kMode>(ls, lt, row_value[r], 1.f - p.beta, p.log_beta, p.log_1mbeta);
            }
            if (8 * j + 1 < limit && pairs) {
              *reinterpret_cast<__half2*>(row_out + 8 * j) = __floats2half2_rn(gv[0], gv[1]);
            } else {
              if (8 * j < limit) row_out[8 * j] = __float2half_rn(gv[0]);
              if (8 * j + 1 < limit) row_out[8 * j + 1] = __float2half_rn(gv[1]);
            }
          }
        }
      }
    }
    if constexpr (kMode == DistillMode::kPairStats) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        PairStats x = st[r];
        merge_pair(x, shfl_pair(x, 1));
        merge_pair(x, shfl_pair(x, 2));
        if (q == 0 && rows[r] < p.n) {
          const float vals[kPairStatsK] = {x.m_s, x.s_s, x.a_s, x.m_t, x.s_t, x.a_t, x.min_t};
          float* base = p.partials + static_cast<size_t>(w.split) * kPairStatsK * p.n + rows[r];
          CUTLASS_PRAGMA_UNROLL
          for (int k = 0; k < kPairStatsK; ++k) base[static_cast<size_t>(k) * p.n] = vals[k];
        }
      }
    } else if constexpr (kMode == DistillMode::kJsdSums) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        float t = kl_t[r], s = kl_s[r];
        t += __shfl_xor_sync(0xffffffffu, t, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        t += __shfl_xor_sync(0xffffffffu, t, 2);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (q == 0 && rows[r] < p.n) {
          float* base = p.partials + static_cast<size_t>(w.split) * 2 * p.n + rows[r];
          base[0] = t;
          base[p.n] = s;
        }
      }
    }
  }
#endif
}

// ---- host launch of one instantiation ----------------------------------------------------

template <class T, DistillMode kMode>
std::string launch_distill_mode(const DistillParams& p, const Plan& plan, cudaStream_t stream) {
  using Cfg = DistillConfig<T>;
  auto kernel = &distill_kernel<Cfg, kMode>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(err);
  HeadPair<Cfg> tma{Cfg::make_tma_a(static_cast<const T*>(p.hidden_s), p.n, p.d_s),
                    Cfg::make_tma_b(static_cast<const T*>(p.weight_s), p.v, p.d_s),
                    Cfg::make_tma_a(static_cast<const T*>(p.hidden_t), p.n, p.d_t),
                    Cfg::make_tma_b(static_cast<const T*>(p.weight_t), p.v, p.d_t)};
  kernel<<<plan.grid, kThreads, Cfg::kSmemBytes, stream>>>(p, tma);
  err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("distill_kernel launch: ") + cudaGetErrorString(err);
  return {};
}

template <class T>
std::string launch_distill_typed(const DistillArgs& args, DistillMode mode, const Plan& plan, cudaStream_t stream) {
  DistillParams p;
  static_cast<DistillArgs&>(p) = args;
  p.units = units_of(plan, args.n, args.v, 0);
  p.inv_t = 1.0f / args.temperature;
  p.log_beta = logf(args.beta);
  p.log_1mbeta = log1pf(-args.beta);
  switch (mode) {
    case DistillMode::kPairStats: return launch_distill_mode<T, DistillMode::kPairStats>(p, plan, stream);
    case DistillMode::kJsdSums: return launch_distill_mode<T, DistillMode::kJsdSums>(p, plan, stream);
    case DistillMode::kGradReverseKl: return launch_distill_mode<T, DistillMode::kGradReverseKl>(p, plan, stream);
    case DistillMode::kGradForwardKl: return launch_distill_mode<T, DistillMode::kGradForwardKl>(p, plan, stream);
    case DistillMode::kGradJsd: return launch_distill_mode<T, DistillMode::kGradJsd>(p, plan, stream);
  }
  return "unknown distill mode";
}

}  // namespace jaxrl_sm90
