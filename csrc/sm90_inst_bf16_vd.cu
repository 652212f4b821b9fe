#include "sm90_instances.h"
#include "sm90_kernel.cuh"

namespace jaxrl_sm90 {
std::string launch_bf16_vd(const Args& args, const Plan& plan, cudaStream_t stream) {
  return launch_typed<cutlass::bfloat16_t, false>(args, plan, stream);
}
}  // namespace jaxrl_sm90
