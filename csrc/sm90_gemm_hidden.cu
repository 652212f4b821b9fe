// d_hidden's GEMM of the backward (sm90_head_gemm.h): acc = alpha G . W16 + beta acc.
#include <algorithm>

#include "sm90_head_gemm.cuh"
#include "sm90_head_gemm.h"

namespace jaxrl_sm90 {
namespace {
// A = G [n, k]: K-contiguous. B = W16 as (k, d): d-contiguous ([k, d]) or k-contiguous ([d, k]).
using HiddenVd = HeadGemm<float, float, cutlass::layout::RowMajor, cutlass::layout::RowMajor>;
using HiddenDv = HeadGemm<float, float, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
using HiddenVdSplit =
    HeadGemm<float, float, cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass::gemm::StreamKScheduler>;
using HiddenDvSplit =
    HeadGemm<float, float, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass::gemm::StreamKScheduler>;

// Narrow (128-wide) tiles for the unsplit GEMM: same per-element sums as the wide ones.
using HiddenVdNarrow = HeadGemm<float, float, cutlass::layout::RowMajor, cutlass::layout::RowMajor, void, 128>;
using HiddenDvNarrow = HeadGemm<float, float, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, void, 128>;

// bfloat16 operands (the fast mode's kept gradient and the head itself): the split kernels
// only, run with one part where K is not split.
using HiddenVdBf16 = HeadGemm<float, float, cutlass::layout::RowMajor, cutlass::layout::RowMajor,
                              cutlass::gemm::StreamKScheduler, 256, cutlass::bfloat16_t>;
using HiddenDvBf16 = HeadGemm<float, float, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor,
                              cutlass::gemm::StreamKScheduler, 256, cutlass::bfloat16_t>;

// At most this many parts per output tile, each of at least kMinSplitK columns of K: short
// parts would spend more of their time filling the pipeline and in the reduction, long ones
// leave small N's GEMMs too few CTAs (docs/performance.md, "Kernel constants").
constexpr int kMaxSplits = 8;
constexpr int kMinSplitK = 2048;

// Beyond one wave, K is split only where that takes at most this fraction of the unsplit
// GEMM's rounds, in parts of at least kMultiWaveMinK columns: each part adds its partial tile
// to the others' (a float32 tile through L2) and fills its own pipeline. Measured on one H100
// (docs/performance.md, "Kernel constants"): at [2560, 2048], V = 131072 in 4 parts of 32768
// took the fast mode's two GEMMs from 4.64 to 4.16 ms, while lean's 8192-column chunks in 4
// parts of 2048 were no faster than unsplit (2.74 against 2.68 ms over the vocabulary), and
// the split's workspace (a float32 tile per output tile, [N, D] in all) is lean's to avoid.
constexpr double kMultiWaveSplitGain = 0.9;
constexpr int64_t kMultiWaveMinK = 16384;

// Rounds of kSplitTargetCtas CTAs that `units` work units take.
int64_t rounds(int64_t units) { return (units + kSplitTargetCtas - 1) / kSplitTargetCtas; }

}  // namespace

// K's parts where split_k and the unsplit output tiles fit one wave of kSplitTargetCtas CTAs:
// as many as keep tiles × parts within that wave (a second, partial wave would cost a whole
// part's time). Where they take more than one wave, the last is often mostly idle (160 tiles
// of [2560, 2048] take two rounds of 132 CTAs for 1.21 rounds of work); there the parts are
// the count whose rounds take the least time, rounds(tiles · parts) / parts of an unsplit
// round (the fewest parts among equals), each of at least kMultiWaveMinK columns, where that is
// at most kMultiWaveSplitGain of the unsplit rounds: [2560, 2048] over V = 131072 in 4 parts
// takes 5 rounds of a quarter each, 1.25 against 2.
// None without `split_k`. Unsplit, float16 tiles are halved in width where that still fits
// one wave: a batch-invariant backward (split_k false) must not let the sums' order follow n,
// but the tile's width leaves each sum as it is. Halved tiles also replace a split in two parts,
// which makes no more CTAs than they do and adds the parts' reduction (measured:
// docs/performance.md, "Kernel constants"). The tiles are counted as the scheduler does, the M
// extent rounded up to whole clusters. `pinned` other than kAuto runs the float16 GEMM unsplit
// in tiles of that width. A function of its arguments only, shared by the workspace size and the
// launch.
HiddenPlan hidden_plan(DType operands, int n, int d, int k, bool split_k, HiddenTiles pinned) {
  using Tile = HiddenVd::TileShape;
  constexpr int tm = cute::size<0>(Tile{}), tn = cute::size<1>(Tile{});
  constexpr int cm = cute::size<0>(HiddenVd::ClusterShape{});
  const int64_t tiles_m = ((n + tm - 1) / tm + cm - 1) / cm * cm;
  const int64_t tiles = std::max<int64_t>(tiles_m * ((d + tn - 1) / tn), 1);
  HiddenPlan plan;
  if (operands == DType::kF16 && pinned != HiddenTiles::kAuto) {
    plan.narrow = pinned == HiddenTiles::kNarrow;
    return plan;
  }
  const int64_t most = std::min<int64_t>(kMaxSplits, k / kMinSplitK);
  if (split_k && tiles <= kSplitTargetCtas) {
    plan.splits = static_cast<int>(std::max<int64_t>(std::min<int64_t>(kSplitTargetCtas / tiles, most), 1));
  } else if (split_k) {
    const double unsplit = static_cast<double>(rounds(tiles));
    double best = unsplit;
    for (int64_t parts = 2; parts <= std::min<int64_t>(most, k / kMultiWaveMinK); ++parts) {
      const double cost = static_cast<double>(rounds(tiles * parts)) / parts;
      if (cost < best) {
        best = cost;
        plan.splits = static_cast<int>(parts);
      }
    }
    if (best > kMultiWaveSplitGain * unsplit) plan.splits = 1;
  }
  if (operands == DType::kF16 && plan.splits <= 2 && 2 * tiles <= kSplitTargetCtas) {
    plan.splits = 1;
    plan.narrow = true;
  }
  return plan;
}

std::string gemm_d_hidden(DType operands, bool w16_dv, int n, int d, int k, const void* g, int64_t ldg, const void* w16,
                          int64_t ldw, float* acc, const float* alpha, const float* beta, void* workspace, int sm_count,
                          cudaStream_t stream, bool split_k, HiddenTiles tiles) {
  const HiddenPlan plan = hidden_plan(operands, n, d, k, split_k, tiles);
  const auto run = [&](auto gemm) {
    return run_head_gemm<decltype(gemm)>(n, d, k, g, ldg, w16, ldw, acc, acc, d, alpha, beta, workspace, sm_count,
                                         stream, plan.splits);
  };
  cutlass::Status st;
  if (operands == DType::kBF16) {
    st = w16_dv ? run(HiddenDvBf16{}) : run(HiddenVdBf16{});
  } else if (plan.splits > 1) {
    st = w16_dv ? run(HiddenDvSplit{}) : run(HiddenVdSplit{});
  } else if (plan.narrow) {
    st = w16_dv ? run(HiddenDvNarrow{}) : run(HiddenVdNarrow{});
  } else {
    st = w16_dv ? run(HiddenDv{}) : run(HiddenVd{});
  }
  if (st != cutlass::Status::kSuccess) return std::string("d_hidden GEMM: ") + cutlassGetStatusString(st);
  return {};
}

size_t gemm_d_hidden_workspace(DType operands, bool w16_dv, int n, int d, int k, bool split_k, HiddenTiles tiles) {
  const HiddenPlan plan = hidden_plan(operands, n, d, k, split_k, tiles);
  if (operands == DType::kBF16)
    return w16_dv ? head_gemm_workspace<HiddenDvBf16>(n, d, k, plan.splits)
                  : head_gemm_workspace<HiddenVdBf16>(n, d, k, plan.splits);
  if (plan.splits > 1)
    return w16_dv ? head_gemm_workspace<HiddenDvSplit>(n, d, k, plan.splits)
                  : head_gemm_workspace<HiddenVdSplit>(n, d, k, plan.splits);
  if (plan.narrow)
    return w16_dv ? head_gemm_workspace<HiddenDvNarrow>(n, d, k) : head_gemm_workspace<HiddenVdNarrow>(n, d, k);
  return w16_dv ? head_gemm_workspace<HiddenDv>(n, d, k) : head_gemm_workspace<HiddenVd>(n, d, k);
}

}  // namespace jaxrl_sm90
