// The checks and conversions the XLA FFI handlers share (ffi_common.h).
#include "ffi_common.h"

#include <mutex>

namespace jaxrl_ffi {

std::string dims_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

namespace {

// Multiprocessor count of a device ordinal, read once (0 if it cannot be read).
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

}  // namespace

ffi::Error read_sm_count(int device, int& sms) {
  sms = sm_count(device);
  if (sms <= 0) return ffi::Error::Internal("could not read the multiprocessor count of the device");
  return ffi::Error::Success();
}

bool all_rows(int64_t n, std::initializer_list<size_t> counts) {
  for (size_t c : counts)
    if (static_cast<int64_t>(c) != n) return false;
  return true;
}

ffi::Error check_head_shapes(ffi::AnyBuffer& hidden, ffi::AnyBuffer& weight, bool weight_dv, float temperature,
                             Head& head) {
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
  if (!(temperature > 0.f)) return ffi::Error::InvalidArgument("temperature must be > 0");
  head.n = n;
  head.d = d;
  head.v = v;
  return ffi::Error::Success();
}

ffi::Error check_head(ffi::AnyBuffer& hidden, ffi::AnyBuffer& weight, ffi::Buffer<ffi::F32>& bias, bool weight_dv,
                      bool has_bias, float temperature, Head& head) {
  ffi::Error checked = check_head_shapes(hidden, weight, weight_dv, temperature, head);
  if (checked.failure()) return checked;
  if (has_bias && static_cast<int64_t>(bias.element_count()) != head.v)
    return ffi::Error::InvalidArgument("bias must be [V]");
  return ffi::Error::Success();
}

ffi::Error grad_args_of(ffi::AnyBuffer& hidden, ffi::AnyBuffer& weight, ffi::Buffer<ffi::F32>& bias,
                        ffi::Buffer<ffi::S32>& targets, ffi::Buffer<ffi::F32>& lse, ffi::Buffer<ffi::F32>& alpha,
                        ffi::Buffer<ffi::F32>& beta, ffi::Buffer<ffi::F32>& gamma, bool weight_dv, bool has_bias,
                        bool has_entropy, float temperature, jaxrl_sm90::GradArgs& args) {
  ffi::Error checked = head_args_of(hidden, weight, bias, targets, weight_dv, has_bias, temperature, args);
  if (checked.failure()) return checked;
  if (!all_rows(args.n, {targets.element_count(), lse.element_count(), alpha.element_count(), beta.element_count()}))
    return ffi::Error::InvalidArgument("targets, lse, alpha and beta must all be [N]");
  if (has_entropy && static_cast<int64_t>(gamma.element_count()) != args.n)
    return ffi::Error::InvalidArgument("gamma must be [N]");
  args.lse = lse.typed_data();
  args.alpha = alpha.typed_data();
  args.beta = beta.typed_data();
  args.gamma = has_entropy ? gamma.typed_data() : nullptr;
  return ffi::Error::Success();
}

}  // namespace jaxrl_ffi
