// Forward and backward launchers per (dtype, weight layout); each pair lives in its own translation unit
// so the four heavy template instantiations compile in parallel.
#pragma once

#include <string>

#include "sm90_launch.h"

namespace jaxrl_sm90 {
std::string launch_bf16_vd(const Args& args, const Plan& plan, cudaStream_t stream);
std::string launch_bf16_dv(const Args& args, const Plan& plan, cudaStream_t stream);
std::string launch_f16_vd(const Args& args, const Plan& plan, cudaStream_t stream);
std::string launch_f16_dv(const Args& args, const Plan& plan, cudaStream_t stream);
std::string launch_grad_bf16_vd(const GradArgs& args, const Plan& plan, cudaStream_t stream);
std::string launch_grad_bf16_dv(const GradArgs& args, const Plan& plan, cudaStream_t stream);
std::string launch_grad_f16_vd(const GradArgs& args, const Plan& plan, cudaStream_t stream);
std::string launch_grad_f16_dv(const GradArgs& args, const Plan& plan, cudaStream_t stream);
}  // namespace jaxrl_sm90
