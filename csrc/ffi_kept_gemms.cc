// `jaxrl_kernels_sm90_kept_grad_gemms` (jaxrl_kernels/backends/ffi/kept_gemms.py): the fast
// mode's two backward GEMMs from the logits' gradient kept in the head's dtype, reading its
// first S rows in place.
//
//   d_hidden = scale · dz[:S]·W          float32 [S, D]
//   d_weight = scale · dz[:S]ᵀ·hidden    W's shape and dtype, rounded once from float32
//
// Operands: dz [R, V] with R ≥ S (the kept-first rows of row skipping: a branch of S rows reads
// the first S of the whole buffer, so XLA need not copy them out for a GEMM of its own),
// hidden [S, D], weight [V, D] ("vd") or [D, V] (weight_dv), all three bfloat16 or all float16,
// scale (f32 [1]). Results: d_hidden, d_weight, the GEMMs' workspace (u8, of
// kept_gemms_workspace_bytes). Attribute: weight_dv. V and D multiples of 8 (16-byte TMA row
// strides).
#include <algorithm>
#include <cstdint>
#include <string>

#include "ffi_common.h"
#include "sm90_head_gemm.h"

namespace jaxrl_ffi {
namespace {

using jaxrl_sm90::DType;

ffi::Error KeptGradGemmsImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer dz, ffi::AnyBuffer hidden,
                             ffi::AnyBuffer weight, ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> d_hidden,
                             ffi::Result<ffi::AnyBuffer> d_weight, ffi::ResultBuffer<ffi::U8> workspace,
                             bool weight_dv) {
  Head head;
  ffi::Error checked = check_head_shapes(hidden, weight, weight_dv, 1.f, head);
  if (checked.failure()) return checked;
  const auto zd = dz.dimensions();
  if (dz.element_type() != hidden.element_type()) return ffi::Error::InvalidArgument("dz must have the head's dtype");
  if (zd.size() != 2 || zd[1] != head.v || zd[0] < head.n)
    return ffi::Error::InvalidArgument("dz must be [R, V] with R >= S = " + std::to_string(head.n) + ", got " +
                                       dims_str(zd));
  if (head.v % 8 != 0) return ffi::Error::InvalidArgument("V must be a multiple of 8 (16-byte TMA row stride)");
  if (scale.element_count() != 1) return ffi::Error::InvalidArgument("scale must hold 1 element");
  if (d_hidden->element_count() != static_cast<size_t>(head.n * head.d))
    return ffi::Error::InvalidArgument("d_hidden must be [S, D]");
  if (d_weight->element_type() != weight.element_type() || d_weight->element_count() != weight.element_count())
    return ffi::Error::InvalidArgument("d_weight must have the weight's shape and dtype");
  const int s = static_cast<int>(head.n), v = static_cast<int>(head.v), d = static_cast<int>(head.d);
  const size_t need = jaxrl_sm90::kept_gemms_workspace_bytes(s, v, d, weight_dv, head.dtype);
  if (workspace->element_count() < need)
    return ffi::Error::InvalidArgument("the workspace needs " + std::to_string(need) + " bytes, got " +
                                       std::to_string(workspace->element_count()));
  if (s == 0) {  // no rows: d_weight is 0 (d_hidden has no element)
    if (cudaMemsetAsync(d_weight->untyped_data(), 0, d_weight->size_bytes(), stream) != cudaSuccess)
      return ffi::Error::Internal("could not zero d_weight");
    return ffi::Error::Success();
  }
  int sms = 0;
  checked = read_sm_count(device, sms);
  if (checked.failure()) return checked;

  const float* c = scale.typed_data();
  void* ws = workspace->untyped_data();
  std::string why =
      jaxrl_sm90::gemm_d_hidden(head.dtype, weight_dv, s, d, v, dz.untyped_data(), v, weight.untyped_data(),
                                weight_dv ? v : d, d_hidden->typed_data(), c, nullptr, ws, sms, stream);
  if (why.empty()) {
    why = weight_dv
              ? jaxrl_sm90::gemm_d_weight(head.dtype, head.dtype, d, v, s, hidden.untyped_data(), d, dz.untyped_data(),
                                          v, d_weight->untyped_data(), v, c, ws, sms, stream)
              : jaxrl_sm90::gemm_d_weight(head.dtype, head.dtype, v, d, s, dz.untyped_data(), v, hidden.untyped_data(),
                                          d, d_weight->untyped_data(), d, c, ws, sms, stream);
  }
  return launched(why);
}

}  // namespace
}  // namespace jaxrl_ffi

namespace jaxrl_sm90 {
size_t kept_gemms_workspace_bytes(int s, int v, int d, bool weight_dv, DType dtype) {
  if (s == 0) return 1;
  const size_t hidden = gemm_d_hidden_workspace(dtype, weight_dv, s, d, v);
  const size_t weight =
      weight_dv ? gemm_d_weight_workspace(dtype, dtype, d, v, s) : gemm_d_weight_workspace(dtype, dtype, v, d, s);
  return std::max<size_t>({hidden, weight, 1});
}
}  // namespace jaxrl_sm90

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90KeptGradGemms, jaxrl_ffi::KeptGradGemmsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<bool>("weight_dv"));
