// Forward and backward launchers per (dtype, weight layout); each pair lives in its own
// translation unit (sm90_inst_<dtype>_<layout>.cu, one JAXRL_SM90_LAUNCHERS line each) so the
// four heavy template instantiations compile in parallel.
#pragma once

#include <string>

#include "sm90_launch.h"

namespace jaxrl_sm90 {
std::string launch_bf16_vd(const ForwardArgs& args, const Plan& plan, cudaStream_t stream);
std::string launch_bf16_dv(const ForwardArgs& args, const Plan& plan, cudaStream_t stream);
std::string launch_f16_vd(const ForwardArgs& args, const Plan& plan, cudaStream_t stream);
std::string launch_f16_dv(const ForwardArgs& args, const Plan& plan, cudaStream_t stream);
std::string launch_grad_bf16_vd(const GradArgs& args, const Plan& plan, cudaStream_t stream);
std::string launch_grad_bf16_dv(const GradArgs& args, const Plan& plan, cudaStream_t stream);
std::string launch_grad_f16_vd(const GradArgs& args, const Plan& plan, cudaStream_t stream);
std::string launch_grad_f16_dv(const GradArgs& args, const Plan& plan, cudaStream_t stream);
std::string launch_weight_copy_bf16_vd(const GradArgs& args, int sm_count, cudaStream_t stream);
std::string launch_weight_copy_bf16_dv(const GradArgs& args, int sm_count, cudaStream_t stream);
std::string launch_weight_copy_f16_vd(const GradArgs& args, int sm_count, cudaStream_t stream);
std::string launch_weight_copy_f16_dv(const GradArgs& args, int sm_count, cudaStream_t stream);
}  // namespace jaxrl_sm90

// Defines launch_<suffix>, launch_grad_<suffix> and launch_weight_copy_<suffix> for element
// type T and layout kDv ("dv" when true); include sm90_stats_kernel.cuh and sm90_grad_kernel.cuh first.
#define JAXRL_SM90_LAUNCHERS(suffix, T, kDv)                                                         \
  namespace jaxrl_sm90 {                                                                             \
  std::string launch_##suffix(const ForwardArgs& args, const Plan& plan, cudaStream_t stream) {      \
    return launch_typed<T, kDv>(args, plan, stream);                                                 \
  }                                                                                                  \
  std::string launch_grad_##suffix(const GradArgs& args, const Plan& plan, cudaStream_t stream) {    \
    return launch_grad_typed<T, kDv>(args, plan, stream);                                            \
  }                                                                                                  \
  std::string launch_weight_copy_##suffix(const GradArgs& args, int sm_count, cudaStream_t stream) { \
    return launch_weight_copy_typed<T, kDv>(args, sm_count, stream);                                 \
  }                                                                                                  \
  }  // namespace jaxrl_sm90
