// `jaxrl_kernels_uninitialized` (jaxrl_kernels/backends/ffi/extension.py: uninitialized_like): a
// result buffer left as the allocator gave it, for a loop carry the loop overwrites in full (zeros
// first would cost a pass over it), as the distillation backward's d_weight.
#include "ffi_common.h"

namespace jaxrl_ffi {
namespace {

ffi::Error UninitializedImpl(ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

}  // namespace
}  // namespace jaxrl_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsUninitialized, jaxrl_ffi::UninitializedImpl,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
