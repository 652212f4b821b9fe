// The forward op's XLA FFI handler, `jaxrl_kernels_sm90_linear_logprobs`
// (jaxrl_kernels/backends/ffi/linear.py: _forward_call).
//
// Operands: hidden [N, D], weight [V, D] ("vd") or [D, V] ("dv") (both bf16 or both f16),
// bias f32 [V] (ignored unless has_bias), targets s32 [N], row_valid pred [N]. Results, each
// f32 [N]: logp (0 on invalid rows, NaN for a target outside [0, V)), entropy and lse of
// every row (not masked; the backward uses them). Attributes: weight_dv, has_bias,
// temperature, splits (ffi.linear.Config.splits: the vocabulary splits of the persistent grid; 0
// lets choose_plan decide). Scratch (3 floats per row per vocabulary split) comes from the
// FFI scratch allocator. The kernels: sm90_stats_kernel.cuh and combine_kernel
// (sm90_launch.cu).
#include <cstdint>
#include <string>
#include <utility>

#include "ffi_common.h"

namespace jaxrl_ffi {
namespace {

ffi::Error LinearLogprobsImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
                              ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> bias,
                              ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::PRED> row_valid,
                              ffi::ResultBuffer<ffi::F32> logp, ffi::ResultBuffer<ffi::F32> entropy,
                              ffi::ResultBuffer<ffi::F32> lse, bool weight_dv, bool has_bias,
                              float temperature, int32_t splits) {
  jaxrl_sm90::ForwardArgs args;
  ffi::Error checked = head_args_of(hidden, weight, bias, targets, weight_dv, has_bias, temperature, args);
  if (checked.failure()) return checked;
  if (!all_rows(args.n, {targets.element_count(), row_valid.element_count(), logp->element_count(),
                         entropy->element_count(), lse->element_count()}))
    return ffi::Error::InvalidArgument("targets, row_valid and the results must all be [N]");
  if (splits < 0) return ffi::Error::InvalidArgument("splits must be >= 0 (0: automatic)");
  if (args.n == 0) return ffi::Error::Success();

  int sms = 0;
  checked = read_sm_count(device, sms);
  if (checked.failure()) return checked;
  jaxrl_sm90::Plan plan = jaxrl_sm90::choose_plan(args.n, args.v, sms, splits);
  // XLA's FFI allocator accepts alignments up to 16 bytes (its buffers are 256-aligned anyway).
  const size_t scratch_bytes = jaxrl_sm90::partials_bytes(plan, args.n);
  auto buf = scratch.Allocate(scratch_bytes, 16);
  if (!buf.has_value())
    return ffi::Error::Internal("scratch allocation of " + std::to_string(scratch_bytes) + " bytes failed");

  args.row_valid = reinterpret_cast<const uint8_t*>(row_valid.typed_data());
  args.logp = logp->typed_data();
  args.entropy = entropy->typed_data();
  args.lse = lse->typed_data();
  args.partials = static_cast<float*>(*buf);
  return launched(jaxrl_sm90::launch(args, plan, stream));
}

// stream, scratch, device; the head's operands, row_valid; logp, entropy, lse; the head's
// attributes, splits.
auto forward_binding() {
  auto operands = bind_head_operands(
      ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::ScratchAllocator>().Ctx<ffi::DeviceOrdinal>());
  auto results = std::move(operands)
                     .Arg<ffi::Buffer<ffi::PRED>>()
                     .Ret<ffi::Buffer<ffi::F32>>()
                     .Ret<ffi::Buffer<ffi::F32>>()
                     .Ret<ffi::Buffer<ffi::F32>>();
  return bind_head_attrs(std::move(results)).Attr<int32_t>("splits");
}

}  // namespace
}  // namespace jaxrl_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90LinearLogprobs, jaxrl_ffi::LinearLogprobsImpl,
                              jaxrl_ffi::forward_binding());
