// XLA FFI handler for the SM90 linear log-prob forward.
//
// Operands: hidden [N, D], weight [V, D] ("vd") or [D, V] ("dv") (both bf16 or
// both f16), bias f32 [V] (ignored unless has_bias), targets s32 [N], row_valid
// pred [N]. Results, each f32 [N]: logp (0 on invalid rows, NaN for a target
// outside [0, V)), entropy and lse of every row (not masked; the backward uses
// them). Attributes: weight_dv, has_bias, temperature. Scratch (3 floats per row
// per vocabulary split) comes from the FFI scratch allocator; the handler only
// enqueues kernels on XLA's stream: no device allocation, no synchronisation.
// JAXRL_KERNELS_SM90_SPLITS=S forces the split count (tuning only).
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"

#include "sm90_launch.h"

namespace ffi = xla::ffi;

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoi(v) : fallback;
}

// Multiprocessor count per device ordinal, read once.
int sm_count(int device) {
  static std::mutex mu;
  static int cache[64] = {0};
  if (device < 0 || device >= 64) return 0;
  std::lock_guard<std::mutex> lock(mu);
  if (cache[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
    cache[device] = n;
  }
  return cache[device];
}

std::string dims_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// The head's shapes and dtype, checked as both kernels need them.
struct Head {
  int64_t n = 0, d = 0, v = 0;
  jaxrl_sm90::DType dtype = jaxrl_sm90::DType::kBF16;
};

ffi::Error check_head(ffi::AnyBuffer& hidden, ffi::AnyBuffer& weight, ffi::Buffer<ffi::F32>& bias, bool weight_dv,
                      bool has_bias, float temperature, Head& head) {
  using jaxrl_sm90::DType;
  auto hd = hidden.dimensions();
  auto wd = weight.dimensions();
  if (hd.size() != 2) return ffi::Error::InvalidArgument("hidden must be [N, D], got " + dims_str(hd));
  if (wd.size() != 2) return ffi::Error::InvalidArgument("weight must be rank 2, got " + dims_str(wd));
  const int64_t n = hd[0], d = hd[1];
  const int64_t v = weight_dv ? wd[1] : wd[0];
  const int64_t wdepth = weight_dv ? wd[0] : wd[1];
  if (wdepth != d)
    return ffi::Error::InvalidArgument("weight " + dims_str(wd) + " does not match hidden " + dims_str(hd) +
                                       (weight_dv ? " (layout dv: [D, V])" : " (layout vd: [V, D])"));
  if (hidden.element_type() != weight.element_type())
    return ffi::Error::InvalidArgument("hidden and weight must have the same dtype");
  if (hidden.element_type() == ffi::DataType::BF16) {
    head.dtype = DType::kBF16;
  } else if (hidden.element_type() == ffi::DataType::F16) {
    head.dtype = DType::kF16;
  } else {
    return ffi::Error::InvalidArgument("hidden/weight must be bfloat16 or float16");
  }
  if (n >= (int64_t{1} << 31) || v >= (int64_t{1} << 31) || d >= (int64_t{1} << 31))
    return ffi::Error::InvalidArgument("N, V and D must be < 2^31");
  if (d <= 0 || v <= 0) return ffi::Error::InvalidArgument("D and V must be positive");
  if (d % 8 != 0) return ffi::Error::InvalidArgument("D must be a multiple of 8 (16-byte TMA row stride)");
  if (weight_dv && v % 8 != 0)
    return ffi::Error::InvalidArgument("V must be a multiple of 8 for the dv layout (16-byte TMA row stride)");
  if (has_bias && static_cast<int64_t>(bias.element_count()) != v)
    return ffi::Error::InvalidArgument("bias must be [V]");
  if (!(temperature > 0.f)) return ffi::Error::InvalidArgument("temperature must be > 0");
  head.n = n;
  head.d = d;
  head.v = v;
  return ffi::Error::Success();
}

bool all_rows(int64_t n, std::initializer_list<size_t> counts) {
  for (size_t c : counts)
    if (static_cast<int64_t>(c) != n) return false;
  return true;
}

ffi::Error LinearLogprobsImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
                              ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> bias,
                              ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::PRED> row_valid,
                              ffi::ResultBuffer<ffi::F32> logp, ffi::ResultBuffer<ffi::F32> entropy,
                              ffi::ResultBuffer<ffi::F32> lse, bool weight_dv, bool has_bias,
                              float temperature) {
  Head head;
  ffi::Error checked = check_head(hidden, weight, bias, weight_dv, has_bias, temperature, head);
  if (checked.failure()) return checked;
  const int64_t n = head.n;
  if (!all_rows(n, {targets.element_count(), row_valid.element_count(), logp->element_count(),
                    entropy->element_count(), lse->element_count()}))
    return ffi::Error::InvalidArgument("targets, row_valid and the results must all be [N]");
  if (n == 0) return ffi::Error::Success();

  const int sms = sm_count(device);
  if (sms <= 0) return ffi::Error::Internal("could not read the multiprocessor count of the device");
  jaxrl_sm90::Plan plan = jaxrl_sm90::choose_plan(static_cast<int>(n), static_cast<int>(head.v), sms,
                                                  env_int("JAXRL_KERNELS_SM90_SPLITS", 0));
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
  std::string why = jaxrl_sm90::launch(args, plan, stream);
  if (!why.empty()) return ffi::Error::Internal(why);
  return ffi::Error::Success();
}

// The operands both backward handlers take after the head's: targets, lse, alpha, beta and
// gamma ([N] each; gamma [0] without has_entropy), checked with the head and copied into
// `args` with everything but the chunk's own fields.
ffi::Error grad_args_of(ffi::AnyBuffer& hidden, ffi::AnyBuffer& weight, ffi::Buffer<ffi::F32>& bias,
                        ffi::Buffer<ffi::S32>& targets, ffi::Buffer<ffi::F32>& lse, ffi::Buffer<ffi::F32>& alpha,
                        ffi::Buffer<ffi::F32>& beta, ffi::Buffer<ffi::F32>& gamma, bool weight_dv, bool has_bias,
                        bool has_entropy, float temperature, jaxrl_sm90::GradArgs& args) {
  Head head;
  ffi::Error checked = check_head(hidden, weight, bias, weight_dv, has_bias, temperature, head);
  if (checked.failure()) return checked;
  if (!all_rows(head.n, {targets.element_count(), lse.element_count(), alpha.element_count(), beta.element_count()}))
    return ffi::Error::InvalidArgument("targets, lse, alpha and beta must all be [N]");
  if (has_entropy && static_cast<int64_t>(gamma.element_count()) != head.n)
    return ffi::Error::InvalidArgument("gamma must be [N]");
  args.hidden = hidden.untyped_data();
  args.weight = weight.untyped_data();
  args.bias = has_bias ? bias.typed_data() : nullptr;
  args.targets = targets.typed_data();
  args.lse = lse.typed_data();
  args.alpha = alpha.typed_data();
  args.beta = beta.typed_data();
  args.gamma = has_entropy ? gamma.typed_data() : nullptr;
  args.n = static_cast<int>(head.n);
  args.v = static_cast<int>(head.v);
  args.d = static_cast<int>(head.d);
  args.dtype = head.dtype;
  args.weight_dv = weight_dv;
  args.temperature = temperature;
  return ffi::Error::Success();
}

// The backward's first stage for one vocabulary chunk [start, start + size): operands as the
// forward's plus lse, alpha, beta, gamma (f32 [N]; gamma [0] without has_entropy), start (s32
// [1]) and w_scale (f32 [1], sigma_W); results G (f16 [N, size]) and the chunk's weight copy
// f16(sigma_W W) (f16 [size, D] or [D, size]). See sm90_grad_kernel.cuh.
ffi::Error LinearGradImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer hidden, ffi::AnyBuffer weight,
                          ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::F32> lse,
                          ffi::Buffer<ffi::F32> alpha, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> gamma,
                          ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::F32> w_scale,
                          ffi::ResultBuffer<ffi::F16> out, ffi::ResultBuffer<ffi::F16> w16, bool weight_dv,
                          bool has_bias, bool has_entropy, float temperature) {
  jaxrl_sm90::GradArgs args;
  ffi::Error checked = grad_args_of(hidden, weight, bias, targets, lse, alpha, beta, gamma, weight_dv, has_bias,
                                    has_entropy, temperature, args);
  if (checked.failure()) return checked;
  if (start.element_count() != 1 || w_scale.element_count() != 1)
    return ffi::Error::InvalidArgument("start and w_scale must hold one element each");
  auto od = out->dimensions();
  if (od.size() != 2 || od[0] != args.n || od[1] > args.v)
    return ffi::Error::InvalidArgument("the result must be [N, size] with size <= V, got " + dims_str(od));
  auto wd16 = w16->dimensions();
  const int64_t w16_size = weight_dv ? (wd16.size() == 2 ? wd16[1] : -1) : (wd16.size() == 2 ? wd16[0] : -1);
  const int64_t w16_depth = weight_dv ? (wd16.size() == 2 ? wd16[0] : -1) : (wd16.size() == 2 ? wd16[1] : -1);
  const bool write_w16 = w16->element_count() != 0;  // an empty result: no weight copy wanted
  if (write_w16 && (w16_size != od[1] || w16_depth != args.d))
    return ffi::Error::InvalidArgument("the weight copy must be [size, D] (vd) or [D, size] (dv), got " +
                                       dims_str(wd16));
  // With no rows the kernel does not run and the weight copy stays unwritten: the GEMMs that
  // read it contract over zero rows.
  if (args.n == 0 || od[1] == 0) return ffi::Error::Success();

  const int sms = sm_count(device);
  if (sms <= 0) return ffi::Error::Internal("could not read the multiprocessor count of the device");
  args.start_ptr = start.typed_data();
  args.out = out->untyped_data();
  args.w_scale = w_scale.typed_data();
  args.w16 = write_w16 ? w16->untyped_data() : nullptr;
  args.size = static_cast<int>(od[1]);
  jaxrl_sm90::Plan plan = jaxrl_sm90::choose_grad_plan(args.n, args.size, sms);
  std::string why = jaxrl_sm90::launch_grad(args, plan, stream);
  if (!why.empty()) return ffi::Error::Internal(why);
  return ffi::Error::Success();
}

// The whole backward (BackwardArgs in sm90_launch.h): operands as the grad call's (no start or
// w_scale: each chunk's weight copy is scaled by its own max |W|) plus h16 (f16 [N, D]), the
// row bound s (f32 [N]) and scalars (f32 [2]: d_weight's scale, 1); results the float32
// d_hidden accumulator [N, D] (d_hidden / s), d_weight (W's
// shape and dtype), d_bias (f32 [V], or [0] without has_bias) and the workspace (u8, of
// backward_workspace_bytes); attribute chunk, the columns per chunk.
ffi::Error LinearBackwardImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer hidden, ffi::AnyBuffer weight,
                              ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::F32> lse,
                              ffi::Buffer<ffi::F32> alpha, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> gamma,
                              ffi::Buffer<ffi::F16> h16, ffi::Buffer<ffi::F32> row_scale,
                              ffi::Buffer<ffi::F32> scalars, ffi::ResultBuffer<ffi::F32> acc,
                              ffi::Result<ffi::AnyBuffer> d_weight, ffi::ResultBuffer<ffi::F32> d_bias,
                              ffi::ResultBuffer<ffi::U8> workspace, bool weight_dv, bool has_bias, bool has_entropy,
                              float temperature, int64_t chunk) {
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
  const size_t need = jaxrl_sm90::backward_workspace_bytes(g.n, g.v, g.d, static_cast<int>(chunk), weight_dv, g.dtype);
  if (workspace->element_count() < need)
    return ffi::Error::InvalidArgument("the workspace needs " + std::to_string(need) + " bytes, got " +
                                       std::to_string(workspace->element_count()));
  const int sms = sm_count(device);
  if (sms <= 0) return ffi::Error::Internal("could not read the multiprocessor count of the device");

  args.h16 = h16.typed_data();
  args.row_scale = row_scale.typed_data();
  args.scalars = scalars.typed_data();
  args.acc = acc->typed_data();
  args.d_weight = d_weight->untyped_data();
  args.d_bias = has_bias ? d_bias->typed_data() : nullptr;
  args.workspace = workspace->untyped_data();
  args.chunk = static_cast<int>(chunk);
  args.sm_count = sms;
  std::string why = jaxrl_sm90::launch_backward(args, stream);
  if (!why.empty()) return ffi::Error::Internal(why);
  return ffi::Error::Success();
}

// The backward's d_weight before its chunk loop: a result buffer left as the allocator gave
// it, since the loop writes every element (zeros first would cost a pass over all of W).
ffi::Error UninitializedImpl(ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

// The binding both backward handlers start with: stream, device, then hidden, weight, bias,
// targets, lse, alpha, beta and gamma.
auto bind_grad_operands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsUninitialized, UninitializedImpl,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90LinearLogprobs, LinearLogprobsImpl,
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
                                  .Attr<float>("temperature"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90LinearBackward, LinearBackwardImpl,
                              bind_grad_operands()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<bool>("weight_dv")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("has_entropy")
                                  .Attr<float>("temperature")
                                  .Attr<int64_t>("chunk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90LinearGrad, LinearGradImpl,
                              bind_grad_operands()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F16>>()
                                  .Attr<bool>("weight_dv")
                                  .Attr<bool>("has_bias")
                                  .Attr<bool>("has_entropy")
                                  .Attr<float>("temperature"));
