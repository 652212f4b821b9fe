// What the XLA FFI handlers (ffi_forward.cc, ffi_backward.cc, ffi_variants.cc) share: the
// checks of the head's operands, their copy into the launchers' argument structs
// (sm90_launch.h), the device's SM count, and the binding of the operands both backward
// handlers start with. Handlers only enqueue work on XLA's stream: no device allocation, no
// synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include <cuda_runtime_api.h>

#include "xla/ffi/api/ffi.h"

#include "sm90_launch.h"

namespace ffi = xla::ffi;

namespace jaxrl_ffi {

// "[d0, d1, ...]" for error messages.
std::string dims_str(ffi::Span<const int64_t> dims);

// Multiprocessor count of a device ordinal, read once (0 if it cannot be read).
int sm_count(int device);

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

// The binding both backward handlers start with: stream, device, then hidden, weight, bias,
// targets, lse, alpha, beta and gamma (grad_args_of's operands).
inline auto bind_grad_operands() {
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

}  // namespace jaxrl_ffi
