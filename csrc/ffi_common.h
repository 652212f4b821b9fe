// What the XLA FFI handlers (ffi_forward.cc, ffi_backward.cc, ffi_variants.cc) share: the
// checks of the head's operands and their copy into the launchers' argument structs
// (sm90_launch.h), the device's SM count, and the bindings of the operands and attributes
// the handlers have in common. Handlers only enqueue work on XLA's stream: no
// device allocation, no synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"

#include "sm90_launch.h"

namespace ffi = xla::ffi;

namespace jaxrl_ffi {

// "[d0, d1, ...]" for error messages.
std::string dims_str(ffi::Span<const int64_t> dims);

// The multiprocessor count of a device ordinal, read once per device, into `sms`.
ffi::Error read_sm_count(int device, int& sms);

// True if every count equals n.
bool all_rows(int64_t n, std::initializer_list<size_t> counts);

// The head's shapes and dtype, checked as every kernel needs them.
struct Head {
  int64_t n = 0, d = 0, v = 0;
  jaxrl_sm90::DType dtype = jaxrl_sm90::DType::kBF16;
};

// hidden [N, D], weight [V, D] ("vd") or [D, V] (weight_dv), both bf16 or both f16, D a
// multiple of 8 (and V in "dv": 16-byte TMA row strides), N, V, D < 2^31, bias [V] if
// has_bias, temperature > 0.
ffi::Error check_head(ffi::AnyBuffer& hidden, ffi::AnyBuffer& weight, ffi::Buffer<ffi::F32>& bias, bool weight_dv,
                      bool has_bias, float temperature, Head& head);

// check_head without a bias.
ffi::Error check_head_shapes(ffi::AnyBuffer& hidden, ffi::AnyBuffer& weight, bool weight_dv, float temperature,
                             Head& head);

// The head's operands checked (check_head) and copied, with the targets, into a launcher's
// arguments: ForwardArgs or GradArgs, which name the head's fields alike. The targets are
// checked by each handler with its other [N] operands.
template <class Args>
ffi::Error head_args_of(ffi::AnyBuffer& hidden, ffi::AnyBuffer& weight, ffi::Buffer<ffi::F32>& bias,
                        ffi::Buffer<ffi::S32>& targets, bool weight_dv, bool has_bias, float temperature, Args& args) {
  Head head;
  ffi::Error checked = check_head(hidden, weight, bias, weight_dv, has_bias, temperature, head);
  if (checked.failure()) return checked;
  args.hidden = hidden.untyped_data();
  args.weight = weight.untyped_data();
  args.bias = has_bias ? bias.typed_data() : nullptr;
  args.targets = targets.typed_data();
  args.n = static_cast<int>(head.n);
  args.v = static_cast<int>(head.v);
  args.d = static_cast<int>(head.d);
  args.dtype = head.dtype;
  args.weight_dv = weight_dv;
  args.temperature = temperature;
  return ffi::Error::Success();
}

// The operands both backward handlers take after the head's: targets, lse, alpha, beta and
// gamma ([N] each; gamma [0] without has_entropy), checked with the head and copied into
// `args` with everything but the chunk's own fields.
ffi::Error grad_args_of(ffi::AnyBuffer& hidden, ffi::AnyBuffer& weight, ffi::Buffer<ffi::F32>& bias,
                        ffi::Buffer<ffi::S32>& targets, ffi::Buffer<ffi::F32>& lse, ffi::Buffer<ffi::F32>& alpha,
                        ffi::Buffer<ffi::F32>& beta, ffi::Buffer<ffi::F32>& gamma, bool weight_dv, bool has_bias,
                        bool has_entropy, float temperature, jaxrl_sm90::GradArgs& args);

// An empty string is success; anything else is the launcher's reason, as an internal error.
inline ffi::Error launched(const std::string& why) {
  return why.empty() ? ffi::Error::Success() : ffi::Error::Internal(why);
}

// `binding` followed by the head's operands, as head_args_of takes them: hidden, weight,
// bias, targets.
template <class Binding>
auto bind_head_operands(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>();
}

// The binding both backward handlers start with: stream, device, then the head's operands,
// lse, alpha, beta and gamma (grad_args_of's operands).
inline auto bind_grad_operands() {
  return bind_head_operands(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>())
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

// `binding` followed by the attributes of the head every handler takes (XLA matches
// attributes by name, in any order): weight_dv, has_bias, temperature.
template <class Binding>
auto bind_head_attrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<bool>("weight_dv")
      .template Attr<bool>("has_bias")
      .template Attr<float>("temperature");
}

// The head's attributes and has_entropy, as both backward handlers take them.
template <class Binding>
auto bind_grad_attrs(Binding&& binding) {
  return bind_head_attrs(std::move(binding)).template Attr<bool>("has_entropy");
}

}  // namespace jaxrl_ffi
