// The backward op's XLA FFI handler, `jaxrl_kernels_sm90_linear_logprobs_backward`
// (jaxrl_kernels/backends/ffi/linear.py: linear_backward): the whole backward of the head in one
// call, launch_backward (sm90_backward.cu, BackwardArgs in sm90_launch.h).
//
// Operands: hidden, weight, bias, targets as the forward's; lse, alpha, beta, gamma (f32 [N];
// gamma [0] without has_entropy: head_grad.RowGrad); h16 (f16 [N, D]), the row bound s
// (f32 [N]), scalars (f32 [2]: d_weight's scale, 1), and K ids per row with their terms of G
// (s32 and f32 [N, K]; both [0] for one target per row: BackwardArgs.ids), and the truncated
// softmax's per-row floor on u = z / T (f32 [N]: p = 0 below it, lse and entropy the kept set's;
// [0]: no floor, the kernel without it: GradArgs.floor). Results: the float32 d_hidden
// accumulator [N, D] (d_hidden / s), d_weight (W's shape and dtype), d_bias (f32 [V], or [0]
// without has_bias) and the workspace (u8, of backward_workspace_bytes). Attributes:
// weight_dv, has_bias, has_entropy, temperature, chunk (columns per chunk, a multiple of 256),
// weight_copy (jaxrl_sm90::WeightCopy: 0 auto, 1 in the grad kernel, 2 apart), split_k (false:
// d_hidden's GEMM keeps one CTA per tile, for a batch-invariant backward), hidden_tiles
// (jaxrl_sm90::HiddenTiles: 0 auto, 1 wide, 2 narrow: the unsplit d_hidden GEMM's tile width).
#include <cstdint>
#include <string>
#include <utility>

#include "ffi_common.h"

namespace jaxrl_ffi {
namespace {

ffi::Error LinearBackwardImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer hidden, ffi::AnyBuffer weight,
                              ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::F32> lse,
                              ffi::Buffer<ffi::F32> alpha, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> gamma,
                              ffi::Buffer<ffi::F16> h16, ffi::Buffer<ffi::F32> row_scale, ffi::Buffer<ffi::F32> scalars,
                              ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> id_coef, ffi::Buffer<ffi::F32> floor,
                              ffi::ResultBuffer<ffi::F32> acc, ffi::Result<ffi::AnyBuffer> d_weight,
                              ffi::ResultBuffer<ffi::F32> d_bias, ffi::ResultBuffer<ffi::U8> workspace, bool weight_dv,
                              bool has_bias, float temperature, bool has_entropy, int64_t chunk, int64_t weight_copy,
                              bool split_k, int64_t hidden_tiles) {
  jaxrl_sm90::BackwardArgs args;
  jaxrl_sm90::GradArgs& g = args.grad;
  ffi::Error checked = grad_args_of(hidden, weight, bias, targets, lse, alpha, beta, gamma, weight_dv, has_bias,
                                    has_entropy, temperature, g);
  if (checked.failure()) return checked;
  if (static_cast<int64_t>(row_scale.element_count()) != g.n)
    return ffi::Error::InvalidArgument("the row scale must be [N]");
  if (scalars.element_count() != 2) return ffi::Error::InvalidArgument("scalars must hold 2 elements");
  if (h16.element_count() != static_cast<size_t>(g.n) * g.d || acc->element_count() != h16.element_count())
    return ffi::Error::InvalidArgument("h16 and the d_hidden accumulator must be [N, D]");
  if (d_weight->element_type() != weight.element_type() || d_weight->element_count() != weight.element_count())
    return ffi::Error::InvalidArgument("d_weight must have the weight's shape and dtype");
  if (has_bias && static_cast<int64_t>(d_bias->element_count()) != g.v)
    return ffi::Error::InvalidArgument("d_bias must be [V]");
  if (chunk <= 0 || chunk % jaxrl_sm90::kBlockN != 0 || chunk >= (int64_t{1} << 31))
    return ffi::Error::InvalidArgument("chunk must be a positive multiple of 256");
  if (hidden_tiles < 0 || hidden_tiles > 2)
    return ffi::Error::InvalidArgument("hidden_tiles must be 0 (auto), 1 (wide) or 2 (narrow)");
  const auto tiles = static_cast<jaxrl_sm90::HiddenTiles>(hidden_tiles);
  const size_t need =
      jaxrl_sm90::backward_workspace_bytes(g.n, g.v, g.d, static_cast<int>(chunk), weight_dv, g.dtype, split_k, tiles);
  if (workspace->element_count() < need)
    return ffi::Error::InvalidArgument("the workspace needs " + std::to_string(need) + " bytes, got " +
                                       std::to_string(workspace->element_count()));
  if (ids.element_count() != id_coef.element_count() ||
      (g.n > 0 && ids.element_count() % static_cast<size_t>(g.n) != 0) || (g.n == 0 && ids.element_count() != 0))
    return ffi::Error::InvalidArgument("ids and id_coef must both be [N, K] (or both [0])");
  if (ids.element_count() > 0) {
    const int64_t k = static_cast<int64_t>(ids.element_count()) / g.n;
    if (k >= (int64_t{1} << 31)) return ffi::Error::InvalidArgument("K must be below 2**31");
    args.ids = ids.typed_data();
    args.id_coef = id_coef.typed_data();
    args.id_k = static_cast<int>(k);
  }
  if (floor.element_count() != 0) {
    if (static_cast<int64_t>(floor.element_count()) != g.n)
      return ffi::Error::InvalidArgument("floor must be [N] (or [0]: no floor)");
    g.floor = floor.typed_data();
  }
  if (weight_copy < 0 || weight_copy > 2)
    return ffi::Error::InvalidArgument("weight_copy must be 0 (auto), 1 (in the grad kernel) or 2 (apart)");
  args.weight_copy = static_cast<jaxrl_sm90::WeightCopy>(weight_copy);
  args.split_k = split_k;
  args.hidden_tiles = tiles;
  checked = read_sm_count(device, args.sm_count);
  if (checked.failure()) return checked;

  args.h16 = h16.typed_data();
  args.row_scale = row_scale.typed_data();
  args.scalars = scalars.typed_data();
  args.acc = acc->typed_data();
  args.d_weight = d_weight->untyped_data();
  args.d_bias = has_bias ? d_bias->typed_data() : nullptr;
  args.workspace = workspace->untyped_data();
  args.chunk = static_cast<int>(chunk);
  return launched(jaxrl_sm90::launch_backward(args, stream));
}

// grad_args_of's operands, h16, row_scale, scalars, ids, id_coef, floor; acc, d_weight, d_bias, workspace; the
// backward's attributes, chunk, weight_copy, split_k, hidden_tiles.
auto backward_binding() {
  auto results = bind_grad_operands()
                     .Arg<ffi::Buffer<ffi::F16>>()
                     .Arg<ffi::Buffer<ffi::F32>>()
                     .Arg<ffi::Buffer<ffi::F32>>()
                     .Arg<ffi::Buffer<ffi::S32>>()
                     .Arg<ffi::Buffer<ffi::F32>>()
                     .Arg<ffi::Buffer<ffi::F32>>()
                     .Ret<ffi::Buffer<ffi::F32>>()
                     .Ret<ffi::AnyBuffer>()
                     .Ret<ffi::Buffer<ffi::F32>>()
                     .Ret<ffi::Buffer<ffi::U8>>();
  return bind_grad_attrs(std::move(results))
      .Attr<int64_t>("chunk")
      .Attr<int64_t>("weight_copy")
      .Attr<bool>("split_k")
      .Attr<int64_t>("hidden_tiles");
}

}  // namespace
}  // namespace jaxrl_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90LinearBackward, jaxrl_ffi::LinearBackwardImpl,
                              jaxrl_ffi::backward_binding());
