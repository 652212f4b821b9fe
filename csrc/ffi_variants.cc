// XLA FFI handlers for measurement only: the package never calls them. Built only with
// JAXRL_KERNELS_MEASUREMENT_HANDLERS=ON (CMakeLists.txt; module.cc registers them then), for the
// variant benchmarks/studies/variants/ffi_xla_gemms.py (the backward's chunks as a loop of XLA GEMMs) and
// the GPU tests of tests/backends/test_ffi.py.
//
// `jaxrl_kernels_sm90_linear_logprobs_grad`: the grad kernel alone over one vocabulary chunk
// [start, start + size) (sm90_grad_kernel.cuh). Operands as the backward's first eight
// (ffi_backward.cc) plus start (s32 [1]) and w_scale (f32 [1], sigma_W); results G (f16
// [N, size]) and the chunk's weight copy f16(sigma_W W) (f16 [size, D] or [D, size]; an empty
// result: no copy). Attributes: weight_dv, has_bias, has_entropy, temperature.
#include <cstdint>

#include "ffi_common.h"

namespace jaxrl_ffi {
namespace {

ffi::Error LinearGradImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer hidden, ffi::AnyBuffer weight,
                          ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::F32> lse,
                          ffi::Buffer<ffi::F32> alpha, ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> gamma,
                          ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::F32> w_scale, ffi::ResultBuffer<ffi::F16> out,
                          ffi::ResultBuffer<ffi::F16> w16, bool weight_dv, bool has_bias, float temperature,
                          bool has_entropy) {
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

  int sms = 0;
  checked = read_sm_count(device, sms);
  if (checked.failure()) return checked;
  args.start_ptr = start.typed_data();
  args.out = out->untyped_data();
  args.w_scale = w_scale.typed_data();
  args.w16 = write_w16 ? w16->untyped_data() : nullptr;
  args.size = static_cast<int>(od[1]);
  return launched(jaxrl_sm90::launch_grad(args, jaxrl_sm90::choose_grad_plan(args.n, args.size, sms), stream));
}

// grad_args_of's operands, start, w_scale; G, the weight copy; the backward's attributes.
auto grad_binding() {
  return bind_grad_attrs(bind_grad_operands()
                             .Arg<ffi::Buffer<ffi::S32>>()
                             .Arg<ffi::Buffer<ffi::F32>>()
                             .Ret<ffi::Buffer<ffi::F16>>()
                             .Ret<ffi::Buffer<ffi::F16>>());
}

}  // namespace
}  // namespace jaxrl_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90LinearGrad, jaxrl_ffi::LinearGradImpl, jaxrl_ffi::grad_binding());
