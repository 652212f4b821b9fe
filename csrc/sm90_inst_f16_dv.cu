// The forward and grad launchers for f16 weights in the "dv" layout (sm90_instances.h).
#include "sm90_grad_kernel.cuh"
#include "sm90_instances.h"
#include "sm90_stats_kernel.cuh"

JAXRL_SM90_LAUNCHERS(f16_dv, cutlass::half_t, true)
