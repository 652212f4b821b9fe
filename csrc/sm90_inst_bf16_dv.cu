#include "sm90_grad_kernel.cuh"
#include "sm90_instances.h"
#include "sm90_stats_kernel.cuh"

namespace jaxrl_sm90 {
std::string launch_bf16_dv(const Args& args, const Plan& plan, cudaStream_t stream) {
  return launch_typed<cutlass::bfloat16_t, true>(args, plan, stream);
}
std::string launch_grad_bf16_dv(const GradArgs& args, const Plan& plan, cudaStream_t stream) {
  return launch_grad_typed<cutlass::bfloat16_t, true>(args, plan, stream);
}
}  // namespace jaxrl_sm90
