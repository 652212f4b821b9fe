#include "sm90_grad_kernel.cuh"
#include "sm90_instances.h"
#include "sm90_stats_kernel.cuh"

namespace jaxrl_sm90 {
std::string launch_f16_vd(const Args& args, const Plan& plan, cudaStream_t stream) {
  return launch_typed<cutlass::half_t, false>(args, plan, stream);
}
std::string launch_grad_f16_vd(const GradArgs& args, const Plan& plan, cudaStream_t stream) {
  return launch_grad_typed<cutlass::half_t, false>(args, plan, stream);
}
}  // namespace jaxrl_sm90
