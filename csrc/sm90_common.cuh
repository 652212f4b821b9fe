// What the SM90 kernels share: the tile configuration, the TMA producer and the wgmma
// mainloop that computes one 128 x 256 logit tile  y = hidden[rows] . W[cols]^T  in fp32
// registers, and the bias tile loader.
//
// A CTA is 3 warpgroups: warpgroup 0 issues TMA loads (one elected thread), warpgroups 1
// and 2 each own 64 rows of the tile and multiply with wgmma m64n256k16. A consumer
// thread's 128 accumulators acc(i) hold
//   row    = 64 cwg + 16 warp + lane / 4 + 8 ((i >> 1) & 1),
//   column = 8 (i >> 2) + 2 (lane % 4) + (i & 1).
// The kernels differ only in what they do with a finished tile (their epilogue): run_tile_kernel
// is the rest.
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
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---- compile-time configuration -----------------------------------------------------

// kBN: the vocabulary tile (256 for the log-prob kernels, kDistillBlockN for distillation).
template <class T, bool kDv, int kBN = kBlockN>
struct Config {
  using Element = T;
  static constexpr bool kWeightDv = kDv;
  using BM = Int<kBlockM>;
  using BN = Int<kBN>;
  using BK = Int<kBlockK>;
  static constexpr GMMA::Major kMajorB = kDv ? GMMA::Major::MN : GMMA::Major::K;

  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, make_shape(BM{}, BK{}, Int<kStages>{})));
  using SmemAtomB = conditional_t<kDv, GMMA::Layout_MN_SW128_Atom<T>, GMMA::Layout_K_SW128_Atom<T>>;
  using SmemLayoutB = decltype(tile_to_shape(SmemAtomB{}, make_shape(BN{}, BK{}, Int<kStages>{})));

  using MmaOp = decltype(GMMA::ss_op_selector<T, T, float, Shape<_64, BN, BK>, GMMA::Major::K, kMajorB>());
  using TiledMma = decltype(make_tiled_mma(MmaOp{}, Layout<Shape<_2, _1, _1>>{}));

  static constexpr uint32_t kTmaBytes = (kBlockM + kBN) * kBlockK * sizeof(T);

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
    alignas(16) float bias[2][2][kBN];  // [consumer warpgroup][tile parity][column]
    typename Pipeline::SharedStorage pipe;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage) + 1024;  // + manual 1 KiB alignment
};

// The work of one launch: units (row block, range of vocabulary tiles) dealt round-robin to
// the persistent CTAs; weight tile vt is read at column tile vt + vt_offset of W.
struct Units {
  int n_rows, vocab, depth;
  int row_blocks, splits, vocab_tiles, group_rows, num_units;
};

// The kernel's shared storage (Cfg::SharedStorage first) at the 1 KiB-aligned start of the
// dynamic shared memory.
template <class Storage>
__device__ __forceinline__ Storage& aligned_shared(char* raw) {
  return *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~static_cast<uintptr_t>(1023));
}
template <class Cfg>
__device__ __forceinline__ typename Cfg::SharedStorage& shared_storage(char* raw) {
  return aligned_shared<typename Cfg::SharedStorage>(raw);
}

template <class Cfg>
__device__ __forceinline__ typename Cfg::Pipeline make_pipeline(typename Cfg::SharedStorage& smem, int warp_group,
                                                                int warp_idx, int lane_predicate) {
  using Pipeline = typename Cfg::Pipeline;
  typename Pipeline::Params pp;
  pp.transaction_bytes = Cfg::kTmaBytes;
  pp.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = (warp_idx == 0 && lane_predicate) ? 1 : 0;
  pp.num_consumers = kConsumerThreads;
  return Pipeline(smem.pipe, pp, Shape<_1, _1, _1>{});
}

// Producer warpgroup: one elected thread streams, for every unit of this CTA and every
// vocabulary tile of it, the K tiles of hidden and weight into the pipeline.
template <class Cfg, class SA, class SB>
__device__ __forceinline__ void produce_tiles(typename Cfg::Pipeline& pipeline, const typename Cfg::TmaA& tma_a,
                                              const typename Cfg::TmaB& tma_b, SA& sA, SB& sB, const Units& g,
                                              int vt_offset, int warp_idx, int lane_predicate) {
  using Pipeline = typename Cfg::Pipeline;
  cutlass::arch::warpgroup_reg_dealloc<40>();
  if (!(warp_idx == 0 && lane_predicate)) return;
  const int k_tiles = (g.depth + kBlockK - 1) / kBlockK;
  Tensor mA = tma_a.get_tma_tensor(make_shape(g.n_rows, g.depth));
  Tensor mB = tma_b.get_tma_tensor(make_shape(g.vocab, g.depth));
  Tensor gA = local_tile(mA, make_shape(typename Cfg::BM{}, typename Cfg::BK{}), make_coord(_, _));
  Tensor gB = local_tile(mB, make_shape(typename Cfg::BN{}, typename Cfg::BK{}), make_coord(_, _));
  auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
  auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
  auto wstate = cutlass::make_producer_start_state<Pipeline>();
  for (int u = blockIdx.x; u < g.num_units; u += gridDim.x) {
    Unit w = decode_unit(u, g.row_blocks, g.splits, g.group_rows, g.vocab_tiles);
    for (int vt = w.vt_begin; vt < w.vt_end; ++vt) {
      for (int kt = 0; kt < k_tiles; ++kt) {
        pipeline.producer_acquire(wstate);
        auto* bar = pipeline.producer_get_barrier(wstate);
        copy(tma_a.with(*bar), tAgA(_, w.row_block, kt), tAsA(_, wstate.index()));
        copy(tma_b.with(*bar), tBgB(_, vt + vt_offset, kt), tBsB(_, wstate.index()));
        ++wstate;
      }
    }
  }
}

// Consumers: acc = hidden tile . weight tile over all of D, releasing each stage as soon as
// the wgmma that read it has retired.
template <class Cfg, class Mma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void mma_tile(typename Cfg::Pipeline& pipeline, cutlass::PipelineState<kStages>& rstate,
                                         Mma& mma, FragA& tCrA, FragB& tCrB, Acc& acc, int k_tiles) {
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
}

// Starts the asynchronous copy of bias[col0, col0 + 256) into `tile` (columns past V read
// as 0); 64 threads of the consumer warpgroup copy 16 bytes each. Wait with
// `bias_tile_wait`.
__device__ __forceinline__ void bias_tile_start(float* tile, const float* bias, int col0, int vocab, int ct) {
  int t = ct % 128;
  if (t < kBlockN / 4) {
    int col = col0 + 4 * t;
    int avail = max(0, min(4, vocab - col));
    const float* src = avail > 0 ? bias + col : bias;
    cp_async_16(tile + 4 * t, src, 4 * avail);
  }
  cp_async_commit();
}
__device__ __forceinline__ void bias_tile_wait(int cwg) {
  cp_async_wait_all();
  named_sync(8 + cwg, 128);
}

// The raw accumulator of column offset `rel` (0 <= rel < 256) of row half r, read with
// compile-time register indices (the caller checks that this thread holds it).
template <class Acc>
__device__ __forceinline__ float acc_at(const Acc& acc, int r, int rel) {
  const int jt = rel >> 3;
  float v = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kBlockN / 8; ++j) {
    if (j == jt) v = (rel & 1) ? acc(4 * j + 2 * r + 1) : acc(4 * j + 2 * r);
  }
  return v;
}

// Where a consumer thread's accumulators sit in the tile (see the top of this file).
struct ConsumerLane {
  int ct;           // 0..255 among the consumers
  int cwg;          // consumer warpgroup: rows [64 cwg, 64 cwg + 64) of the tile
  int q;            // lane % 4: the column pair within each group of 8
  int row_in_tile;  // its first row; the second is + 8
};

__device__ __forceinline__ ConsumerLane consumer_lane() {
  const int ct = threadIdx.x - 128;
  const int lane = threadIdx.x % 32;
  return {ct, ct / 128, lane % 4, (ct / 128) * 64 + ((ct / 32) % 4) * 16 + lane / 4};
}

// A tile's 16-bit values from the accumulator layout to global memory: each consumer warp
// writes its 16 rows through a 16 x 64 slice of shared memory (TileStage), a quarter of the
// tile's columns at a time. Its 16-byte chunks are XOR-swizzled by row (chunk k of row r sits
// at k ^ (r % 8)), so that both the writes in the accumulator layout (4 bytes a lane) and the
// row reads (16 bytes a lane) are free of bank conflicts; each global store then writes 128
// contiguous bytes of four rows, where stores straight from the accumulator layout (4 bytes a
// lane) write a 32-byte sector in two (docs/performance.md, "Kernel constants").
constexpr int kStageCols = 64;
constexpr int kConsumerWarps = kConsumerThreads / 32;

struct TileStage {
  alignas(128) uint16_t slice[kConsumerWarps][16 * kStageCols];
};

// The shared memory of a kernel that stores tiles through store_tile_16bit: the mainloop's
// storage first (shared_storage<Cfg> finds it at the same address), then the stage.
template <class Cfg>
struct StagedStorage {
  typename Cfg::SharedStorage main;
  TileStage stage;
};

// The dynamic shared memory of a kernel on StagedStorage<Cfg> (as Cfg::kSmemBytes for the
// mainloop's storage alone): + 1 KiB for the manual alignment.
template <class Cfg>
constexpr int kStagedSmemBytes = sizeof(StagedStorage<Cfg>) + 1024;

// `pairs(j, bits)` gives this lane's two 16-bit values of columns 8 j + 2 q and + 1 as one
// 32-bit word for each row half r (bits[r]). They are stored to `out` (row stride ld) at rows
// warp_row0 + [0, 16) below n_rows and columns local0 + [0, 256) below ld, and 0 at the columns
// in [size, ld) (a padded chunk); 16 bytes a store where `vector_ok` (ld a multiple of 8, out
// 16-byte aligned) and all 8 columns lie below size.
template <class Pairs>
__device__ __forceinline__ void store_tile_16bit(Pairs&& pairs, uint16_t* stage, uint16_t* out, int warp_row0,
                                                 int n_rows, int size, int ld, int local0, bool vector_ok) {
  const int lane = threadIdx.x % 32;
  const int q = lane % 4, row_w = lane / 4;  // this lane's rows: row_w and row_w + 8
  CUTLASS_PRAGMA_UNROLL
  for (int quarter = 0; quarter < kBlockN / kStageCols; ++quarter) {
    CUTLASS_PRAGMA_UNROLL
    for (int jj = 0; jj < kStageCols / 8; ++jj) {
      uint32_t bits[2];
      pairs(quarter * (kStageCols / 8) + jj, bits);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        uint16_t* slot = stage + (row_w + 8 * r) * kStageCols + (jj ^ row_w) * 8 + 2 * q;
        *reinterpret_cast<uint32_t*>(slot) = bits[r];
      }
    }
    __syncwarp();
    CUTLASS_PRAGMA_UNROLL
    for (int it = 0; it < 4; ++it) {
      const int row = 4 * it + lane / 8, k = lane % 8;
      const uint4 v = *reinterpret_cast<const uint4*>(stage + row * kStageCols + (k ^ (row % 8)) * 8);
      const int col = local0 + quarter * kStageCols + 8 * k;
      if (warp_row0 + row < n_rows && col < ld) {
        uint16_t* dst = out + static_cast<size_t>(warp_row0 + row) * ld + col;
        if (vector_ok && col + 8 <= size) {
          *reinterpret_cast<uint4*>(dst) = v;
        } else {  // a ragged end; padding columns up to ld get 0
          const uint16_t* h = reinterpret_cast<const uint16_t*>(&v);
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < 8; ++e) {
            if (col + e < ld) dst[e] = col + e < size ? h[e] : uint16_t{0};
          }
        }
      }
    }
    __syncwarp();
  }
}

template <class Cfg>
__device__ __forceinline__ void prefetch_tma(const typename Cfg::TmaA& tma_a, const typename Cfg::TmaB& tma_b,
                                             int warp_idx, int lane_predicate) {
  if (warp_idx == 0 && lane_predicate) {
    cute::prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_b.get_tma_descriptor());
  }
}

// The body of every tile kernel. Warpgroup 0 streams the tiles of this CTA's units
// (produce_tiles; weight tile vt is read at column tile vt + vt_offset), then each of its
// threads runs `producer_rest(warp_idx)`. Each consumer thread runs
// `consume(lane, acc, compute_tile)`: `compute_tile(vt, col0)` computes the next tile of its
// units into `acc` (this thread's accumulators, laid out as at the top of this file) with
// bias[col0, col0 + 256) loaded alongside, and returns that bias tile in shared memory (not
// loaded when `bias` is null). `consume` and compute_tile are always inlined (a lambda with
// `__attribute__((always_inline))`): compiled apart first, the mainloop came out unrolled
// differently from the same code written in the kernel.
template <class Cfg, class ProducerRest, class Consume>
__device__ __forceinline__ void run_tile_kernel(typename Cfg::SharedStorage& smem, const typename Cfg::TmaA& tma_a,
                                                const typename Cfg::TmaB& tma_b, const Units& g, int vt_offset,
                                                const float* bias, ProducerRest&& producer_rest, Consume&& consume) {
  const int warp_group = threadIdx.x / 128;
  const int warp_idx = cutlass::canonical_warp_idx_sync();
  const int lane_predicate = cute::elect_one_sync();
  prefetch_tma<Cfg>(tma_a, tma_b, warp_idx, lane_predicate);
  auto pipeline = make_pipeline<Cfg>(smem, warp_group, warp_idx, lane_predicate);
  __syncthreads();

  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Cfg::SmemLayoutA{});  // (BM, BK, PIPE)
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Cfg::SmemLayoutB{});  // (BN, BK, PIPE)

  if (warp_group == 0) {
    produce_tiles<Cfg>(pipeline, tma_a, tma_b, sA, sB, g, vt_offset, warp_idx, lane_predicate);
    producer_rest(warp_idx);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<232>();
  const ConsumerLane lane = consumer_lane();
  const int k_tiles = (g.depth + kBlockK - 1) / kBlockK;

  typename Cfg::TiledMma mma;
  auto thr = mma.get_slice(lane.ct);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE) descriptors
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, make_shape(typename Cfg::BM{}, typename Cfg::BN{}));
  static_assert(decltype(size(acc))::value == 128, "one m64n256 accumulator per thread");

  cutlass::PipelineState<kStages> rstate;
  const bool has_bias = bias != nullptr;
  auto compute_tile = [&](int vt, int col0) __attribute__((always_inline)) -> const float* {
    float* bias_tile = smem.bias[lane.cwg][vt & 1];
    if (has_bias) bias_tile_start(bias_tile, bias, col0, g.vocab, lane.ct);
    mma_tile<Cfg>(pipeline, rstate, mma, tCrA, tCrB, acc, k_tiles);
    if (has_bias) bias_tile_wait(lane.cwg);
    return bias_tile;
  };
  consume(lane, acc, compute_tile);
}

inline Units units_of(const Plan& plan, int n, int v, int d) {
  return {n, v, d, plan.row_blocks, plan.splits, plan.vocab_tiles, plan.group_rows, plan.row_blocks * plan.splits};
}

// The kernel parameters `Params`, which extend the launch's `Args` (ForwardArgs or GradArgs),
// with the plan's unit layout; the fields of the kernel's own are the caller's to set.
template <class Params, class Args>
Params tile_params(const Args& args, const Plan& plan) {
  Params p;
  static_cast<Args&>(p) = args;
  p.units = units_of(plan, args.n, args.v, args.d);
  return p;
}

// Host side shared by the kernels: raise the shared-memory limit, build the TMA descriptors of
// hidden [n, d] and the weight (as (v, d)) from the head of `p`, launch `kernel` on the
// persistent grid with `smem_bytes` of dynamic shared memory.
template <class Cfg, class Params>
std::string launch_tiles(void (*kernel)(Params, typename Cfg::TmaA, typename Cfg::TmaB), const Params& p, int grid,
                         cudaStream_t stream, const char* name, int smem_bytes = Cfg::kSmemBytes) {
  using T = typename Cfg::Element;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(err);
  auto tma_a = Cfg::make_tma_a(static_cast<const T*>(p.hidden), p.n, p.d);
  auto tma_b = Cfg::make_tma_b(static_cast<const T*>(p.weight), p.v, p.d);
  kernel<<<grid, kThreads, smem_bytes, stream>>>(p, tma_a, tma_b);
  err = cudaGetLastError();
  if (err != cudaSuccess) return std::string(name) + " launch: " + cudaGetErrorString(err);
  return {};
}

}  // namespace jaxrl_sm90
