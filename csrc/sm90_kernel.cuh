// SM90 (Hopper) fused linear log-prob forward: TMA -> shared memory -> wgmma,
// with the softmax statistics reduced in registers so logits never leave the SM.
//
// One CTA = 3 warpgroups: warpgroup 0 issues TMA loads (one elected thread),
// warpgroups 1 and 2 each own 64 rows of a 128 x 256 logit tile and multiply
// with wgmma m64n256k16 (fp32 accumulators). For every row a consumer thread
// keeps, for the raw logits y = hidden . w_v + b_v (z = y / T) of its own 64
// columns of each tile, with c1 = log2(e) / T and d = (y - m) c1 (base-2 units):
//   m = running max of y,   s = sum 2^d,   a = sum 2^d d.
// At the end of a unit (row block, vocabulary split) the four lanes that share a
// row merge their statistics and lane 0 writes (m, s, a) to
// `partials[split][0..2][row]`; `combine_kernel` merges the splits into (M, S, A):
//   lse = M / T + ln S,  entropy = ln2 (log2 S - A / S),  logp = (y_t - M) / T - ln S.
// The raw target logit y_t is picked out of the accumulators by the one thread
// that holds it and stored in the logp output, which the combine kernel rewrites.
#pragma once

#include <cstdint>
#include <string>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "sm90_launch.h"
#include "sm90_plan.h"

namespace jaxrl_sm90 {

using namespace cute;

constexpr int kBlockK = 64;

constexpr int kThreads = 384;
constexpr int kConsumerThreads = 256;

struct KernelParams {
  const float* bias;
  const int32_t* targets;
  const uint8_t* row_valid;
  float* target_logit;  // the logp output, holding the raw target logit until combine_kernel runs
  float* partials;
  int n_rows, vocab, depth;
  int row_blocks, splits, vocab_tiles, group_rows, num_units;
  float c1;
};

// ---- small PTX helpers -------------------------------------------------------------

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// 16-byte asynchronous global->shared copy; bytes beyond `src_bytes` are zero-filled.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---- compile-time configuration -----------------------------------------------------

template <class T, bool kDv>
struct Config {
  using Element = T;
  using BM = Int<kBlockM>;
  using BN = Int<kBlockN>;
  using BK = Int<kBlockK>;
  static constexpr GMMA::Major kMajorB = kDv ? GMMA::Major::MN : GMMA::Major::K;

  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                             make_shape(BM{}, BK{}, Int<kStages>{})));
  using SmemAtomB = conditional_t<kDv, GMMA::Layout_MN_SW128_Atom<T>, GMMA::Layout_K_SW128_Atom<T>>;
  using SmemLayoutB = decltype(tile_to_shape(SmemAtomB{}, make_shape(BN{}, BK{}, Int<kStages>{})));

  using MmaOp = decltype(GMMA::ss_op_selector<T, T, float, Shape<_64, BN, BK>, GMMA::Major::K, kMajorB>());
  using TiledMma = decltype(make_tiled_mma(MmaOp{}, Layout<Shape<_2, _1, _1>>{}));

  static constexpr uint32_t kTmaBytes = (kBlockM + kBlockN) * kBlockK * sizeof(T);

  // Global tensors as TMA sees them: hidden (N, D) K-major; weight as (V, D).
  static auto gmem_a(const T* p, int n, int d) {
    return make_tensor(make_gmem_ptr(p), make_shape(n, d), make_stride(static_cast<int64_t>(d), _1{}));
  }
  static auto gmem_b(const T* p, int v, int d) {
    if constexpr (kDv) {
      return make_tensor(make_gmem_ptr(p), make_shape(v, d), make_stride(_1{}, static_cast<int64_t>(v)));
    } else {
      return make_tensor(make_gmem_ptr(p), make_shape(v, d), make_stride(static_cast<int64_t>(d), _1{}));
    }
  }
  static auto make_tma_a(const T* p, int n, int d) {
    return make_tma_atom(SM90_TMA_LOAD{}, gmem_a(p, n, d), SmemLayoutA{}(_, _, 0), make_shape(BM{}, BK{}));
  }
  static auto make_tma_b(const T* p, int v, int d) {
    return make_tma_atom(SM90_TMA_LOAD{}, gmem_b(p, v, d), SmemLayoutB{}(_, _, 0), make_shape(BN{}, BK{}));
  }
  using TmaA = decltype(make_tma_a(nullptr, 1, 8));
  using TmaB = decltype(make_tma_b(nullptr, 8, 8));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<T, cosize_v<SmemLayoutA>, 1024> a;
    alignas(1024) cute::array_aligned<T, cosize_v<SmemLayoutB>, 1024> b;
    alignas(16) float bias[2][2][kBlockN];  // [consumer warpgroup][tile parity][column]
    typename Pipeline::SharedStorage pipe;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage) + 1024;  // + manual 1 KiB alignment
};

// ---- statistics helpers --------------------------------------------------------------

// Merge two (m, s, a) triples: m raw logits (before 1/T), s and a in base-2 units
// relative to m c1. m == -inf marks "nothing seen".
__device__ __forceinline__ void merge_stats(float& m, float& s, float& a, float m2, float s2, float a2,
                                            float c1) {
  float mx = fmaxf(m, m2);
  float d1 = (m - mx) * c1, d2 = (m2 - mx) * c1;
  float w1 = (m == -INFINITY) ? 0.f : ex2(d1);
  float w2 = (m2 == -INFINITY) ? 0.f : ex2(d2);
  float t1 = (m == -INFINITY) ? 0.f : w1 * (a + s * d1);
  float t2 = (m2 == -INFINITY) ? 0.f : w2 * (a2 + s2 * d2);
  s = w1 * s + w2 * s2;
  a = t1 + t2;
  m = mx;
}

// Fold one 64-row x 256-column accumulator tile into this thread's row statistics.
// acc(i): row = base + 8 * ((i >> 1) & 1), column = 8 * (i >> 2) + 2 * (lane % 4) + (i & 1).
template <bool kMasked, class Acc>
__device__ __forceinline__ void fold_tile(Acc& acc, const float* bias_s, bool has_bias, int col_limit,
                                          float c1, bool first, float (&m)[2], float (&s)[2],
                                          float (&a)[2]) {
  constexpr int kJ = kBlockN / 8;
  if (has_bias) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kJ; ++j) {
      float2 b = *reinterpret_cast<const float2*>(bias_s + 8 * j);
      acc(4 * j + 0) += b.x;
      acc(4 * j + 1) += b.y;
      acc(4 * j + 2) += b.x;
      acc(4 * j + 3) += b.y;
    }
  }
  // col_limit = V - (first column this lane holds); column offset 8j + e is valid iff < col_limit.
  if constexpr (kMasked) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kJ; ++j) {
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 2; ++e) {
        if (8 * j + e >= col_limit) {
          acc(4 * j + e) = -INFINITY;
          acc(4 * j + 2 + e) = -INFINITY;
        }
      }
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 2; ++r) {
    float mx0 = -INFINITY, mx1 = -INFINITY, mx2 = -INFINITY, mx3 = -INFINITY;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kJ; j += 2) {
      mx0 = fmaxf(mx0, acc(4 * j + 2 * r));
      mx1 = fmaxf(mx1, acc(4 * j + 2 * r + 1));
      mx2 = fmaxf(mx2, acc(4 * j + 4 + 2 * r));
      mx3 = fmaxf(mx3, acc(4 * j + 4 + 2 * r + 1));
    }
    float tmax = fmaxf(fmaxf(mx0, mx1), fmaxf(mx2, mx3));
    float m_new = fmaxf(m[r], tmax);
    if (first) {
      s[r] = 0.f;
      a[r] = 0.f;
    } else {
      float delta = (m[r] - m_new) * c1;  // <= 0
      float scale = ex2(delta);
      a[r] = scale * (a[r] + s[r] * delta);
      s[r] = scale * s[r];
    }
    m[r] = m_new;
    float mc = m_new * c1;
    float s0 = 0.f, s1 = 0.f, a0 = 0.f, a1 = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kJ; ++j) {
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 2; ++e) {
        float d = fmaf(acc(4 * j + 2 * r + e), c1, -mc);
        float pz = ex2(d);
        if constexpr (kMasked) {
          bool valid = 8 * j + e < col_limit;
          pz = valid ? pz : 0.f;
          d = valid ? d : 0.f;
        }
        if (e == 0) {
          s0 += pz;
          a0 = fmaf(pz, d, a0);
        } else {
          s1 += pz;
          a1 = fmaf(pz, d, a1);
        }
      }
    }
    s[r] += s0 + s1;
    a[r] += a0 + a1;
  }
}

// ---- the main kernel -----------------------------------------------------------------

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    linear_lse_kernel(const __grid_constant__ KernelParams p, const __grid_constant__ typename Cfg::TmaA tma_a,
                      const __grid_constant__ typename Cfg::TmaB tma_b) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename Cfg::Element;
  using Pipeline = typename Cfg::Pipeline;
  using Storage = typename Cfg::SharedStorage;
  using BM = typename Cfg::BM;
  using BN = typename Cfg::BN;
  using BK = typename Cfg::BK;

  extern __shared__ char smem_raw[];
  Storage& smem = *reinterpret_cast<Storage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));

  const int warp_group = threadIdx.x / 128;
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  const int lane_predicate = cute::elect_one_sync();

  if (warp_idx == 0 && lane_predicate) {
    cute::prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_b.get_tma_descriptor());
  }

  typename Pipeline::Params pp;
  pp.transaction_bytes = Cfg::kTmaBytes;
  pp.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = (warp_idx == 0 && lane_predicate) ? 1 : 0;
  pp.num_consumers = kConsumerThreads;
  Pipeline pipeline(smem.pipe, pp, Shape<_1, _1, _1>{});
  __syncthreads();

  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Cfg::SmemLayoutA{});  // (BM, BK, PIPE)
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Cfg::SmemLayoutB{});  // (BN, BK, PIPE)
  const int k_tiles = (p.depth + kBlockK - 1) / kBlockK;

  if (warp_group == 0) {
    // ---------------- producer ----------------
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp_idx == 0 && lane_predicate) {
      Tensor mA = tma_a.get_tma_tensor(make_shape(p.n_rows, p.depth));
      Tensor mB = tma_b.get_tma_tensor(make_shape(p.vocab, p.depth));
      Tensor gA = local_tile(mA, make_shape(BM{}, BK{}), make_coord(_, _));  // (BM, BK, m, k)
      Tensor gB = local_tile(mB, make_shape(BN{}, BK{}), make_coord(_, _));  // (BN, BK, n, k)
      auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
      auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
      auto wstate = cutlass::make_producer_start_state<Pipeline>();
      for (int u = blockIdx.x; u < p.num_units; u += gridDim.x) {
        Unit w = decode_unit(u, p.row_blocks, p.splits, p.group_rows, p.vocab_tiles);
        for (int vt = w.vt_begin; vt < w.vt_end; ++vt) {
          for (int kt = 0; kt < k_tiles; ++kt) {
            pipeline.producer_acquire(wstate);
            auto* bar = pipeline.producer_get_barrier(wstate);
            copy(tma_a.with(*bar), tAgA(_, w.row_block, kt), tAsA(_, wstate.index()));
            copy(tma_b.with(*bar), tBgB(_, vt, kt), tBsB(_, wstate.index()));
            ++wstate;
          }
        }
      }
    }
  } else {
    // ---------------- consumers ----------------
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int ct = threadIdx.x - 128;  // 0..255
    const int cwg = ct / 128;          // consumer warpgroup 0/1: rows [64 cwg, 64 cwg + 64)
    const int lane = threadIdx.x % 32;
    const int q = lane % 4;
    const int row_in_tile = cwg * 64 + ((ct / 32) % 4) * 16 + lane / 4;  // and + 8

    typename Cfg::TiledMma mma;
    auto thr = mma.get_slice(ct);
    Tensor tCsA = thr.partition_A(sA);
    Tensor tCsB = thr.partition_B(sB);
    Tensor tCrA = thr.make_fragment_A(tCsA);  // (MMA, MMA_M, MMA_K, PIPE) descriptors
    Tensor tCrB = thr.make_fragment_B(tCsB);
    Tensor acc = partition_fragment_C(mma, make_shape(BM{}, BN{}));  // 128 fp32 per thread
    static_assert(decltype(size(acc))::value == 128, "one m64n256 accumulator per thread");

    cutlass::PipelineState<kStages> rstate;
    const bool has_bias = p.bias != nullptr;
    const float c1 = p.c1;

    for (int u = blockIdx.x; u < p.num_units; u += gridDim.x) {
      Unit w = decode_unit(u, p.row_blocks, p.splits, p.group_rows, p.vocab_tiles);
      int rows[2] = {w.row_block * kBlockM + row_in_tile, w.row_block * kBlockM + row_in_tile + 8};
      int tgt[2];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        int t = -1;
        if (rows[r] < p.n_rows && p.row_valid[rows[r]]) {
          t = p.targets[rows[r]];
          if (t < 0 || t >= p.vocab) t = -1;
        }
        tgt[r] = t;
      }
      float m[2] = {-INFINITY, -INFINITY}, s[2] = {0.f, 0.f}, a[2] = {0.f, 0.f};

      for (int vt = w.vt_begin; vt < w.vt_end; ++vt) {
        const int col0 = vt * kBlockN;
        float* bias_tile = smem.bias[cwg][vt & 1];
        if (has_bias) {
          // 64 threads x 16 bytes = 256 floats; columns past V are zero-filled.
          int t = ct % 128;
          if (t < kBlockN / 4) {
            int col = col0 + 4 * t;
            int avail = max(0, min(4, p.vocab - col));
            const float* src = avail > 0 ? p.bias + col : p.bias;
            cp_async_16(bias_tile + 4 * t, src, 4 * avail);
          }
          cp_async_commit();
        }

        // ---- mainloop: acc = hidden tile . weight tile over all of D ----
        pipeline.consumer_wait(rstate);
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        mma.accumulate_ = GMMA::ScaleOut::Zero;
        CUTLASS_PRAGMA_UNROLL
        for (int kb = 0; kb < size<2>(tCrA); ++kb) {
          cute::gemm(mma, tCrA(_, _, kb, rstate.index()), tCrB(_, _, kb, rstate.index()), acc);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        auto release = rstate;
        ++rstate;
        for (int kt = 1; kt < k_tiles; ++kt) {
          pipeline.consumer_wait(rstate);
          warpgroup_fence_operand(acc);
          warpgroup_arrive();
          cute::gemm(mma, tCrA(_, _, _, rstate.index()), tCrB(_, _, _, rstate.index()), acc);
          warpgroup_commit_batch();
          warpgroup_wait<1>();
          warpgroup_fence_operand(acc);
          pipeline.consumer_release(release);
          ++release;
          ++rstate;
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc);
        pipeline.consumer_release(release);

        if (has_bias) {
          cp_async_wait_all();
          named_sync(8 + cwg, 128);
        }

        // ---- the target logit, held by exactly one thread of one tile ----
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          int rel = tgt[r] - col0;
          if (rel >= 0 && rel < kBlockN && ((rel >> 1) & 3) == q) {
            int jt = rel >> 3;
            float v = 0.f;
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kBlockN / 8; ++j) {
              if (j == jt) v = (rel & 1) ? acc(4 * j + 2 * r + 1) : acc(4 * j + 2 * r);
            }
            if (has_bias) v += bias_tile[rel];
            p.target_logit[rows[r]] = v;
          }
        }

        // ---- fold the tile into the running statistics ----
        const float* bias_lane = bias_tile + 2 * q;
        const int col_limit = p.vocab - col0 - 2 * q;
        const bool first = (vt == w.vt_begin);
        if (col0 + kBlockN > p.vocab) {
          fold_tile<true>(acc, bias_lane, has_bias, col_limit, c1, first, m, s, a);
        } else {
          fold_tile<false>(acc, bias_lane, has_bias, col_limit, c1, first, m, s, a);
        }
      }

      // ---- merge the four lanes of each row and write this unit's partials ----
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        float mm = m[r], ss = s[r], aa = a[r];
        CUTLASS_PRAGMA_UNROLL
        for (int off = 1; off <= 2; off <<= 1) {
          float m2 = __shfl_xor_sync(0xffffffffu, mm, off);
          float s2 = __shfl_xor_sync(0xffffffffu, ss, off);
          float a2 = __shfl_xor_sync(0xffffffffu, aa, off);
          merge_stats(mm, ss, aa, m2, s2, a2, c1);
        }
        if (q == 0 && rows[r] < p.n_rows) {
          size_t base = static_cast<size_t>(w.split) * 3 * p.n_rows + rows[r];
          p.partials[base] = mm;
          p.partials[base + p.n_rows] = ss;
          p.partials[base + 2 * static_cast<size_t>(p.n_rows)] = aa;
        }
      }
    }
  }
#endif
}

// ---- host launch of one instantiation --------------------------------------------------

template <class T, bool kDv>
std::string launch_typed(const Args& args, const Plan& plan, cudaStream_t stream) {
  using Cfg = Config<T, kDv>;
  auto kernel = &linear_lse_kernel<Cfg>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(err);

  auto tma_a = Cfg::make_tma_a(static_cast<const T*>(args.hidden), args.n, args.d);
  auto tma_b = Cfg::make_tma_b(static_cast<const T*>(args.weight), args.v, args.d);

  KernelParams p;
  p.bias = args.bias;
  p.targets = args.targets;
  p.row_valid = args.row_valid;
  p.target_logit = args.logp;
  p.partials = args.partials;
  p.n_rows = args.n;
  p.vocab = args.v;
  p.depth = args.d;
  p.row_blocks = plan.row_blocks;
  p.splits = plan.splits;
  p.vocab_tiles = plan.vocab_tiles;
  p.group_rows = plan.group_rows;
  p.num_units = plan.row_blocks * plan.splits;
  p.c1 = static_cast<float>(1.4426950408889634 / static_cast<double>(args.temperature));

  kernel<<<plan.grid, kThreads, Cfg::kSmemBytes, stream>>>(p, tma_a, tma_b);
  err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("linear_lse_kernel launch: ") + cudaGetErrorString(err);
  return {};
}

}  // namespace jaxrl_sm90
