// The forward op's XLA FFI handler, `jaxrl_kernels_sm90_linear_logprobs`
// (jaxrl_kernels/backends/ffi.py: _forward_call).
//
// Operands: hidden [N, D], weight [V, D] ("vd") or [D, V] ("dv") (both bf16 or both f16),
// bias f32 [V] (ignored unless has_bias), targets s32 [N], row_valid pred [N]. Results, each
// f32 [N]: logp (0 on invalid rows, NaN for a target outside [0, V)), entropy and lse of
// every row (not masked; the backward uses them). Attributes: weight_dv, has_bias,
// temperature, splits (ffi.Config.splits: the vocabulary splits of the persistent grid; 0
// lets choose_plan decide). Scratch (3 floats per row per vocabulary split) comes from the
// FFI scratch allocator. The kernels: sm90_stats_kernel.cuh and combine_kernel
// (sm90_launch.cu).
#include <cstdint>
#include <string>

#include "ffi_common.h"

namespace jaxrl_ffi {
namespace {

ffi::Error LinearLogprobsImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
                              ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> bias,
                              ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::PRED> row_valid,
                              ffi::ResultBuffer<ffi::F32> logp, ffi::ResultBuffer<ffi::F32> entropy,
                              ffi::ResultBuffer<ffi::F32> lse, bool weight_dv, bool has_bias,
                              float temperature, int32_t splits) {
  Head head;
  ffi::Error checked = check_head(hidden, weight, bias, weight_dv, has_bias, temperature, head);
  if (checked.failure()) return checked;
  const int64_t n = head.n;
  if (!all_rows(n, {targets.element_count(), row_valid.element_count(), logp->element_count(),
                    entropy->element_count(), lse->element_count()}))
    return ffi::Error::InvalidArgument("targets, row_valid and the results must all be [N]");
  if (splits < 0) return ffi::Error::InvalidArgument("splits must be >= 0 (0: automatic)");
  if (n == 0) return ffi::Error::Success();

  const int sms = sm_count(device);
  if (sms <= 0) return ffi::Error::Internal("could not read the multiprocessor count of the device");
  jaxrl_sm90::Plan plan = jaxrl_sm90::choose_plan(static_cast<int>(n), static_cast<int>(head.v), sms, splits);
  // XLA's FFI allocator accepts alignments up to 16 bytes (its buffers are 256-aligned anyway).
  const size_t scratch_bytes = jaxrl_sm90::partials_bytes(plan, static_cast<int>(n));
  auto buf = scratch.Allocate(scratch_bytes, 16);
  if (!buf.has_value())
    return ffi::Error::Internal("scratch allocation of " + std::to_string(scratch_bytes) + " bytes failed");

  jaxrl_sm90::ForwardArgs args;
  args.hidden = hidden.untyped_data();
  args.weight = weight.untyped_data();
  args.bias = has_bias ? bias.typed_data() : nullptr;
  args.targets = targets.typed_data();
  args.row_valid = reinterpret_cast<const uint8_t*>(row_valid.typed_data());
  args.logp = logp->typed_data();
  args.entropy = entropy->typed_data();
  args.lse = lse->typed_data();
  args.partials = static_cast<float*>(*buf);
  args.n = static_cast<int>(n);
  args.v = static_cast<int>(head.v);
  args.d = static_cast<int>(head.d);
  args.dtype = head.dtype;
  args.weight_dv = weight_dv;
  args.temperature = temperature;
  return launched(jaxrl_sm90::launch(args, plan, stream));
}

}  // namespace
}  // namespace jaxrl_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90LinearLogprobs, jaxrl_ffi::LinearLogprobsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("weight_dv")
                                  .Attr<bool>("has_bias")
                                  .Attr<float>("temperature")
                                  .Attr<int32_t>("splits"));
