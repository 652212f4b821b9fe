// The forward op's XLA FFI handlers (jaxrl_kernels/backends/ffi/linear.py: _forward_call and
// kept_logits).
//
// `jaxrl_kernels_sm90_linear_logprobs`. Operands: hidden [N, D], weight [V, D] ("vd") or
// [D, V] ("dv") (both bf16 or both f16), bias f32 [V] (ignored unless has_bias), targets s32
// [N], row_valid pred [N]. Results, each f32 [N]: logp (0 on invalid rows, NaN for a target
// outside [0, V)), entropy and lse of every row (not masked; the backward uses them).
// Attributes: weight_dv, has_bias, temperature, splits (ffi.linear.Config.splits: the
// vocabulary splits of the persistent grid; 0 lets choose_plan decide). Scratch (3 floats per
// row per vocabulary split) comes from the FFI scratch allocator. The kernels:
// sm90_stats_kernel.cuh and combine_kernel (sm90_launch.cu).
//
// `jaxrl_kernels_sm90_linear_kept_logits`: the same with a first result, the logits
// hidden . W^T [M, V] in the head's dtype (M >= N: the rows past N zero), and the statistics
// taken from those rounded logits (ForwardArgs::logits): memory="fast"'s forward.
//
// `jaxrl_kernels_sm90_linear_kept_exp`: the same with one more operand, offsets f32 [N] (raw
// logits), and the first result E = exp((hidden . w_v - offset) / T) instead of the logits (0 on
// rows that are not valid), the statistics from the unrounded logits (ForwardArgs::exp_offsets):
// the fast mode's relative form; no bias.
#include <cstdint>
#include <string>
#include <utility>

#include "ffi_common.h"

namespace jaxrl_ffi {
namespace {

// Both handlers; `logits` null: none kept.
ffi::Error Forward(cudaStream_t stream, ffi::ScratchAllocator& scratch, int32_t device, ffi::AnyBuffer& hidden,
                   ffi::AnyBuffer& weight, ffi::Buffer<ffi::F32>& bias, ffi::Buffer<ffi::S32>& targets,
                   ffi::Buffer<ffi::PRED>& row_valid, ffi::AnyBuffer* logits, ffi::ResultBuffer<ffi::F32>& logp,
                   ffi::ResultBuffer<ffi::F32>& entropy, ffi::ResultBuffer<ffi::F32>& lse, bool weight_dv,
                   bool has_bias, float temperature, int32_t splits, const ffi::Buffer<ffi::F32>* offsets = nullptr) {
  jaxrl_sm90::ForwardArgs args;
  ffi::Error checked = head_args_of(hidden, weight, bias, targets, weight_dv, has_bias, temperature, args);
  if (checked.failure()) return checked;
  if (logits != nullptr) {
    auto ld = logits->dimensions();
    if (ld.size() != 2 || ld[0] < args.n || ld[1] != args.v || logits->element_type() != hidden.element_type())
      return ffi::Error::InvalidArgument("the kept logits must be [M >= N, V] in the head's dtype, got " +
                                         dims_str(ld));
    args.logits = logits->untyped_data();
    // Rows past N are zero: a step run on its first N rows of M (row skipping) gets its logits
    // laid out at all M rows without a padded copy.
    const size_t row_bytes = static_cast<size_t>(args.v) * ffi::ByteWidth(logits->element_type());
    if (ld[0] > args.n && cudaMemsetAsync(static_cast<char*>(args.logits) + row_bytes * args.n, 0,
                                          row_bytes * (ld[0] - args.n), stream) != cudaSuccess)
      return ffi::Error::Internal("zeroing the kept logits' rows past N failed");
  }
  if (offsets != nullptr) {
    if (!all_rows(args.n, {offsets->element_count()})) return ffi::Error::InvalidArgument("the offsets must be [N]");
    if (has_bias) return ffi::Error::InvalidArgument("the relative form takes no bias");
    args.exp_offsets = offsets->typed_data();
  }
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

ffi::Error LinearLogprobsImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device, ffi::AnyBuffer hidden,
                              ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> targets,
                              ffi::Buffer<ffi::PRED> row_valid, ffi::ResultBuffer<ffi::F32> logp,
                              ffi::ResultBuffer<ffi::F32> entropy, ffi::ResultBuffer<ffi::F32> lse, bool weight_dv,
                              bool has_bias, float temperature, int32_t splits) {
  return Forward(stream, scratch, device, hidden, weight, bias, targets, row_valid, nullptr, logp, entropy, lse,
                 weight_dv, has_bias, temperature, splits);
}

ffi::Error LinearKeptLogitsImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
                                ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> bias,
                                ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::PRED> row_valid,
                                ffi::Result<ffi::AnyBuffer> logits, ffi::ResultBuffer<ffi::F32> logp,
                                ffi::ResultBuffer<ffi::F32> entropy, ffi::ResultBuffer<ffi::F32> lse, bool weight_dv,
                                bool has_bias, float temperature, int32_t splits) {
  return Forward(stream, scratch, device, hidden, weight, bias, targets, row_valid, &*logits, logp, entropy, lse,
                 weight_dv, has_bias, temperature, splits);
}

ffi::Error LinearKeptExpImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device, ffi::AnyBuffer hidden,
                             ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> targets,
                             ffi::Buffer<ffi::PRED> row_valid, ffi::Buffer<ffi::F32> offsets,
                             ffi::Result<ffi::AnyBuffer> exps, ffi::ResultBuffer<ffi::F32> logp,
                             ffi::ResultBuffer<ffi::F32> entropy, ffi::ResultBuffer<ffi::F32> lse, bool weight_dv,
                             bool has_bias, float temperature, int32_t splits) {
  return Forward(stream, scratch, device, hidden, weight, bias, targets, row_valid, &*exps, logp, entropy, lse,
                 weight_dv, has_bias, temperature, splits, &offsets);
}

// stream, scratch, device; the head's operands, row_valid.
auto forward_operands() {
  return bind_head_operands(ffi::Ffi::Bind()
                                .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                .Ctx<ffi::ScratchAllocator>()
                                .Ctx<ffi::DeviceOrdinal>())
      .Arg<ffi::Buffer<ffi::PRED>>();
}

// logp, entropy, lse; the head's attributes, splits.
template <class Binding>
auto forward_results(Binding&& binding) {
  auto results = std::move(binding)
                     .template Ret<ffi::Buffer<ffi::F32>>()
                     .template Ret<ffi::Buffer<ffi::F32>>()
                     .template Ret<ffi::Buffer<ffi::F32>>();
  return bind_head_attrs(std::move(results)).template Attr<int32_t>("splits");
}

}  // namespace
}  // namespace jaxrl_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90LinearLogprobs, jaxrl_ffi::LinearLogprobsImpl,
                              jaxrl_ffi::forward_results(jaxrl_ffi::forward_operands()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90LinearKeptLogits, jaxrl_ffi::LinearKeptLogitsImpl,
                              jaxrl_ffi::forward_results(jaxrl_ffi::forward_operands().Ret<ffi::AnyBuffer>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxrlKernelsSm90LinearKeptExp, jaxrl_ffi::LinearKeptExpImpl,
    jaxrl_ffi::forward_results(jaxrl_ffi::forward_operands().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::AnyBuffer>()));
