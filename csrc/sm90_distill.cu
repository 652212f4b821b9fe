// Host launch of the distillation kernels (sm90_distill_kernel.cuh) for both 16-bit dtypes.
#include <string>

#include "sm90_distill_kernel.cuh"

namespace jaxrl_sm90 {

std::string launch_distill(const DistillArgs& args, DistillMode mode, const Plan& plan, cudaStream_t stream) {
  if (args.n == 0 || args.v == 0) return {};
  if (mode != DistillMode::kPairStats && mode != DistillMode::kJsdSums && args.size == 0) return {};
  if (args.dtype == DType::kBF16) return launch_distill_typed<cutlass::bfloat16_t>(args, mode, plan, stream);
  return launch_distill_typed<cutlass::half_t>(args, mode, plan, stream);
}

}  // namespace jaxrl_sm90
