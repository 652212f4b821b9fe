// d_weight's GEMM of the backward (sm90_head_gemm.h): out = alpha x^T . y in W's dtype.
#include "sm90_head_gemm.cuh"
#include "sm90_head_gemm.h"

namespace jaxrl_sm90 {
namespace {
// A = x^T: x is [k, m], so A is m-contiguous; B = y [k, n]: n-contiguous. No source operand.
template <class Out>
using Weight = HeadGemm<Out, void, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
}  // namespace

std::string gemm_d_weight(DType out_dtype, int m, int n, int k, const void* x, int64_t ldx, const void* y, int64_t ldy,
                          void* out, int64_t ldo, const float* alpha, void* workspace, int sm_count,
                          cudaStream_t stream) {
  cutlass::Status st = out_dtype == DType::kBF16
                           ? run_head_gemm<Weight<cutlass::bfloat16_t>>(m, n, k, x, ldx, y, ldy, nullptr, out, ldo,
                                                                        alpha, nullptr, workspace, sm_count, stream)
                           : run_head_gemm<Weight<cutlass::half_t>>(m, n, k, x, ldx, y, ldy, nullptr, out, ldo, alpha,
                                                                    nullptr, workspace, sm_count, stream);
  if (st != cutlass::Status::kSuccess) return std::string("d_weight GEMM: ") + cutlassGetStatusString(st);
  return {};
}

size_t gemm_d_weight_workspace(DType out_dtype, int m, int n, int k) {
  return out_dtype == DType::kBF16 ? head_gemm_workspace<Weight<cutlass::bfloat16_t>>(m, n, k)
                                   : head_gemm_workspace<Weight<cutlass::half_t>>(m, n, k);
}

}  // namespace jaxrl_sm90
