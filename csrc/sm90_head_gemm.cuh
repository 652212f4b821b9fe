// The two GEMMs of the linear-head backward (16-bit operands, float32 accumulation), as
// CUTLASS SM90 kernels: TMA loads, wgmma, a persistent warp-specialized
// cooperative schedule and a TMA epilogue, built from CUTLASS's collective builders.
//
//   d_hidden:  acc = G . W16 + beta acc        float32 [N, D], updated in place (beta 0 on the
//                                               first chunk, so acc is never zero-filled)
//   d_weight:  out = scale (A . B)             W's dtype, written in place into the chunk's
//                                               rows ("vd") or columns ("dv") of d_weight
//
// Each output tile is one CTA's work, except in d_hidden when its [N, D] tiles fill the GPU
// poorly (small N: 32 tiles at N = 512, D = 2048, against 132 SMs; or a last wave mostly idle:
// 160 tiles at N = 2560) while K, the chunk width or V, is long: then K is split over `splits`
// CTAs per tile (CUTLASS's stream-K scheduler in split-K mode; the count: hidden_plan in
// sm90_gemm_hidden.cu): each part adds its partial sum into a float32 workspace tile in the
// order of the K ranges (so the bits do not vary run to run), and the last part adds that to
// its own and runs the epilogue. d_weight, whose tiles cover the chunk's columns by D (hundreds of tiles at
// the usual chunk widths) and whose K is N, keeps one CTA per tile.
//
// Row-major names: D[M, N] = A[M, K] . B[K, N]. CUTLASS's layout tags say which extent is
// contiguous: A RowMajor is K-contiguous, B ColumnMajor is K-contiguous, D RowMajor is
// N-contiguous. Strides are passed with their leading dimensions, so d_weight's chunk is
// addressed in place inside the whole [V, D] or [D, V] array.
#pragma once

#include <cstdint>
#include <string>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

namespace jaxrl_sm90 {

// ElementC void: no source operand (D = alpha acc). 128 x 256 tiles on clusters of two CTAs
// along M that share each B tile through TMA multicast, in the cooperative schedule (against
// one-CTA clusters and ping-pong: docs/performance.md, "Kernel constants"). Scheduler: void,
// CUTLASS's default persistent scheduler (one CTA per output tile), or
// cutlass::gemm::StreamKScheduler for split-K. TileN: 128 for
// d_hidden where 256-wide tiles are too few to fill the GPU and K is not split (each output
// element is the same sum of the same wgmma steps whatever the tile's width). ElementAB: the
// operands' type, float16 (lean's scaled chunks) or bfloat16 (the fast mode's kept gradient).
template <class ElementD, class ElementC, class LayoutA, class LayoutB, class Scheduler = void, int TileN = 256,
          class ElementAB = cutlass::half_t>
struct HeadGemm {
  using LayoutD = cutlass::layout::RowMajor;
  using TileShape = cute::Shape<cute::_128, cute::Int<TileN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  static constexpr int kAlignC = 16 / sizeof(cute::conditional_t<cute::is_void_v<ElementC>, ElementD, ElementC>);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD, kAlignC, ElementD, LayoutD,
      16 / sizeof(ElementD), cutlass::epilogue::TmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, 8, ElementAB, LayoutB, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;
  static constexpr bool kSplitK = cute::is_same_v<Scheduler, cutlass::gemm::StreamKScheduler>;
};

// The SM count split-K sizes its decomposition for: an H100's or H200's (SXM). A constant rather
// than the device's, so that the split count, and with it the workspace size that the caller
// allocates before the launch, is a function of the problem shape alone (and is computed where
// there is no GPU).
constexpr int kSplitTargetCtas = 132;

// The scheduler arguments of a split-K GEMM in `splits` parts (plain K-splitting, partial sums
// added in the order of their K ranges, so the result bits depend on the shape only).
template <class G, class Arguments>
void set_splits(Arguments& args, int splits) {
  if constexpr (G::kSplitK) {
    args.scheduler.splits = splits;
    args.scheduler.decomposition_mode = cutlass::gemm::kernel::detail::DecompositionMode::SplitK;
    args.scheduler.reduction_mode = cutlass::gemm::kernel::detail::ReductionMode::Deterministic;
  }
}

// Sets the leading dimension of an (M or N, K, L) operand stride: its first mode when that is
// dynamic (K-contiguous), else its second (the static 1 is the contiguous mode).
template <class Stride>
void set_leading_dim(Stride& stride, int64_t ld) {
  if constexpr (cute::is_same_v<cute::remove_cvref_t<decltype(cute::get<0>(stride))>, int64_t>) {
    cute::get<0>(stride) = ld;
  } else {
    cute::get<1>(stride) = ld;
  }
}

// One GEMM of M x N x K with leading dimensions lda, ldb, ldd (elements); c may alias d (same
// layout). alpha, beta: device scalars; beta null means 0 and c is not read (nor is it
// without a source type). splits > 1 (split-K kernels only) divides K into that many parts.
// The workspace is the caller's, of at least `head_gemm_workspace<G>(m, n, k, splits)` bytes.
//
// c aliasing d stays correct under split-K: only the CTA of a tile's last K range loads C and
// stores D, and the other parts add into the workspace, never into D
// (PersistentTileSchedulerSm90StreamK::fixup and compute_epilogue, and their use in
// sm90_gemm_tma_warpspecialized_cooperative.hpp, CUTLASS 4.2).
template <class G>
cutlass::Status run_head_gemm(int m, int n, int k, const void* a, int64_t lda, const void* b, int64_t ldb,
                              const void* c, void* d, int64_t ldd, const float* alpha, const float* beta,
                              void* workspace, int sm_count, cudaStream_t stream, int splits = 1) {
  if (splits > 1 && !G::kSplitK) return cutlass::Status::kErrorInvalidProblem;
  using Kernel = typename G::Kernel;
  using ElementA = typename Kernel::ElementA;
  using ElementB = typename Kernel::ElementB;
  using ElementC = typename Kernel::ElementC;
  using ElementD = typename Kernel::ElementD;
  // Strides are (M, K, L) for A, (N, K, L) for B, (M, N, L) for C and D (row-major: the
  // leading dimension is the first mode).
  typename G::StrideA sa{};
  typename G::StrideB sb{};
  typename G::StrideC sc{};
  typename G::StrideD sd{};
  set_leading_dim(sa, lda);
  set_leading_dim(sb, ldb);
  set_leading_dim(sc, ldd);
  set_leading_dim(sd, ldd);

  typename Kernel::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {m, n, k, 1},
                                  {static_cast<const ElementA*>(a), sa, static_cast<const ElementB*>(b), sb},
                                  {{}, static_cast<const ElementC*>(c), sc, static_cast<ElementD*>(d), sd}};
  args.epilogue.thread.alpha_ptr = alpha;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.thread.beta_ptr = beta;
  args.hw_info.sm_count = sm_count;
  set_splits<G>(args, splits);
  // The tile scheduler keeps CUTLASS's defaults (heuristic raster order, no swizzle): no other
  // order or swizzle was faster (docs/performance.md, "Kernel constants").

  typename G::Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) return status;
  status = gemm.initialize(args, workspace, stream);
  if (status != cutlass::Status::kSuccess) return status;
  return gemm.run(stream);
}

// The SM count is set so that CUTLASS does not query a device: the size must be computable
// without a GPU. A split-K workspace holds one float32 partial tile and one lock per output
// tile and CTA warp group, whatever the split count and SM count.
template <class G>
size_t head_gemm_workspace(int m, int n, int k, int splits = 1) {
  typename G::Kernel::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {m, n, k, 1};
  args.hw_info.sm_count = kSplitTargetCtas;
  set_splits<G>(args, splits);
  return G::Gemm::get_workspace_size(args);
}

}  // namespace jaxrl_sm90
