// SM90 (Hopper) fused linear log-prob forward: TMA -> shared memory -> wgmma,
// with the softmax statistics reduced in registers so logits never leave the SM (unless the
// caller keeps them: ForwardArgs::logits, memory="fast").
//
// The tiles come from the shared mainloop (sm90_common.cuh). For every row a consumer
// thread keeps, for the raw logits y = hidden . w_v + b_v (z = y / T) of its own 64
// columns of each tile, with c1 = log2(e) / T and d = (y - m) c1 (base-2 units):
//   m = running max of y,   s = sum 2^d,   a = sum 2^d d.
// At the end of a unit (row block, vocabulary split) the four lanes that share a
// row merge their statistics and lane 0 writes (m, s, a) to
// `partials[split][0..2][row]`; `combine_kernel` merges the splits into (M, S, A):
//   lse = M / T + ln S,  entropy = ln2 (log2 S - A / S),  logp = (y_t - M) / T - ln S.
// The raw target logit y_t is picked out of the accumulators by the one thread
// that holds it and stored in the logp output, which the combine kernel rewrites.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "sm90_common.cuh"

namespace jaxrl_sm90 {

// ---- statistics helpers --------------------------------------------------------------

// Merge two (m, s, a) triples: m raw logits (before 1/T), s and a in base-2 units
// relative to m c1. m == -inf marks "nothing seen".
__device__ __forceinline__ void merge_stats(float& m, float& s, float& a, float m2, float s2, float a2, float c1) {
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
__device__ __forceinline__ void fold_tile(Acc& acc, const float* bias_s, bool has_bias, int col_limit, float c1,
                                          bool first, float (&m)[2], float (&s)[2], float (&a)[2]) {
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

// Rounds this thread's accumulators of a tile to T (round to nearest even) in place and
// stores the tile to `logits` [n_rows, vocab] at columns col0 + [0, 256).
template <class T, class Acc>
__device__ __forceinline__ void keep_rounded_tile(Acc& acc, uint16_t* stage, T* logits, int warp_row0, int n_rows,
                                                  int vocab, int col0, bool vector_ok) {
  auto pairs = [&](int j, uint32_t (&bits)[2]) __attribute__((always_inline)) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      float& lo = acc(4 * j + 2 * r);
      float& hi = acc(4 * j + 2 * r + 1);
      const auto pair = [&] {
        if constexpr (cute::is_same_v<T, cutlass::half_t>) {
          return __floats2half2_rn(lo, hi);
        } else {
          return __floats2bfloat162_rn(lo, hi);
        }
      }();
      lo = __low2float(pair);
      hi = __high2float(pair);
      bits[r] = reinterpret_cast<const uint32_t&>(pair);
    }
  };
  store_tile_16bit(pairs, stage, reinterpret_cast<uint16_t*>(logits), warp_row0, n_rows, vocab, vocab, col0, vector_ok);
}

// Stores this thread's E = 2^((y - offset) c1) of a tile, rounded to T, to `out` [n_rows, vocab]
// at columns col0 + [0, 256): `off_c1[r]` is offset * c1 for row half r, `live[r]` false
// writes 0 there. The accumulators are left unrounded (the statistics fold them as they are).
template <class T, class Acc>
__device__ __forceinline__ void keep_exp_tile(Acc& acc, const float (&off_c1)[2], const bool (&live)[2], float c1,
                                              uint16_t* stage, T* out, int warp_row0, int n_rows, int vocab, int col0,
                                              bool vector_ok) {
  auto pairs = [&](int j, uint32_t (&bits)[2]) __attribute__((always_inline)) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      const float lo = live[r] ? ex2(fmaf(acc(4 * j + 2 * r), c1, -off_c1[r])) : 0.f;
      const float hi = live[r] ? ex2(fmaf(acc(4 * j + 2 * r + 1), c1, -off_c1[r])) : 0.f;
      const auto pair = [&] {
        if constexpr (cute::is_same_v<T, cutlass::half_t>) {
          return __floats2half2_rn(lo, hi);
        } else {
          return __floats2bfloat162_rn(lo, hi);
        }
      }();
      bits[r] = reinterpret_cast<const uint32_t&>(pair);
    }
  };
  store_tile_16bit(pairs, stage, reinterpret_cast<uint16_t*>(out), warp_row0, n_rows, vocab, vocab, col0, vector_ok);
}

// ---- the kernel ------------------------------------------------------------------------

// The launch's ForwardArgs (the kernel reads bias, targets, row_valid, logp and partials)
// and what the launch derives from them. `logp` holds the raw target logit until
// combine_kernel runs.
struct StatsParams : ForwardArgs {
  Units units;
  float c1;  // log2(e) / T
};

template <class Cfg>
__global__ void __launch_bounds__(kThreads, 1)
    linear_lse_kernel(const __grid_constant__ StatsParams p, const __grid_constant__ typename Cfg::TmaA tma_a,
                      const __grid_constant__ typename Cfg::TmaB tma_b) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  auto& storage = aligned_shared<StagedStorage<Cfg>>(smem_raw);  // the stage only where logits are kept
  const Units& g = p.units;
  auto no_producer_rest = [](int) {};
  run_tile_kernel<Cfg>(storage.main, tma_a, tma_b, g, 0, p.bias, no_producer_rest,
                       [&](const ConsumerLane& lane, auto& acc, auto& compute_tile) __attribute__((always_inline)) {
    const auto [ct, cwg, q, row_in_tile] = lane;
    const bool has_bias = p.bias != nullptr;
    const float c1 = p.c1;
    using T = typename Cfg::Element;
    T* const logits = static_cast<T*>(p.logits);
    const bool vector_ok = g.vocab % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
    uint16_t* const stage = storage.stage.slice[ct / 32];

    for (int u = blockIdx.x; u < g.num_units; u += gridDim.x) {
      Unit w = decode_unit(u, g.row_blocks, g.splits, g.group_rows, g.vocab_tiles);
      int rows[2] = {w.row_block * kBlockM + row_in_tile, w.row_block * kBlockM + row_in_tile + 8};
      int tgt[2];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        int t = -1;
        if (rows[r] < g.n_rows && p.row_valid[rows[r]]) {
          t = p.targets[rows[r]];
          if (t < 0 || t >= g.vocab) t = -1;
        }
        tgt[r] = t;
      }
      float m[2] = {-INFINITY, -INFINITY}, s[2] = {0.f, 0.f}, a[2] = {0.f, 0.f};
      // the relative form's offsets (ForwardArgs::exp_offsets), in base-2 units
      float off_c1[2] = {0.f, 0.f};
      bool live[2] = {false, false};
      if (p.exp_offsets != nullptr) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          live[r] = tgt[r] >= 0;
          off_c1[r] = live[r] ? p.exp_offsets[rows[r]] * c1 : 0.f;
        }
      }

      for (int vt = w.vt_begin; vt < w.vt_end; ++vt) {
        const int col0 = vt * kBlockN;
        const float* bias_tile = compute_tile(vt, col0);

        // ---- the target logit, held by exactly one thread of one tile ----
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          int rel = tgt[r] - col0;
          if (rel >= 0 && rel < kBlockN && ((rel >> 1) & 3) == q) {
            float v = acc_at(acc, r, rel);
            if (has_bias) v += bias_tile[rel];
            p.logp[rows[r]] = v;  // the raw target logit, finished by combine_kernel
          }
        }

        // ---- the kept logits, rounded (the statistics then fold the rounded values), or E ----
        if (logits != nullptr) {
          const int warp_row0 = rows[0] - (threadIdx.x % 32) / 4;
          if (p.exp_offsets != nullptr) {
            keep_exp_tile(acc, off_c1, live, c1, stage, logits, warp_row0, g.n_rows, g.vocab, col0, vector_ok);
          } else {
            keep_rounded_tile(acc, stage, logits, warp_row0, g.n_rows, g.vocab, col0, vector_ok);
          }
        }

        // ---- fold the tile into the running statistics ----
        const float* bias_lane = bias_tile + 2 * q;
        const int col_limit = g.vocab - col0 - 2 * q;
        const bool first = (vt == w.vt_begin);
        if (col0 + kBlockN > g.vocab) {
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
        if (q == 0 && rows[r] < g.n_rows) {
          size_t base = static_cast<size_t>(w.split) * 3 * g.n_rows + rows[r];
          p.partials[base] = mm;
          p.partials[base + g.n_rows] = ss;
          p.partials[base + 2 * static_cast<size_t>(g.n_rows)] = aa;
        }
      }
    }
  });
#endif
}

// ---- host launch of one instantiation --------------------------------------------------

template <class T, bool kDv>
std::string launch_typed(const ForwardArgs& args, const Plan& plan, cudaStream_t stream) {
  using Cfg = Config<T, kDv>;
  StatsParams p = tile_params<StatsParams>(args, plan);
  p.c1 = static_cast<float>(1.4426950408889634 / static_cast<double>(args.temperature));
  const int smem_bytes = args.logits ? kStagedSmemBytes<Cfg> : Cfg::kSmemBytes;
  return launch_tiles<Cfg>(&linear_lse_kernel<Cfg>, p, plan.grid, stream, "linear_lse_kernel", smem_bytes);
}

}  // namespace jaxrl_sm90
