// d_weight's GEMM of the backward (sm90_head_gemm.h): out = alpha x^T . y in W's dtype.
#include "sm90_head_gemm.cuh"
#include "sm90_head_gemm.h"

namespace jaxrl_sm90 {
namespace {
// A = x^T: x is [k, m], so A is m-contiguous; B = y [k, n]: n-contiguous. No source operand.
template <class Out, class Operands = cutlass::half_t>
using Weight = HeadGemm<Out, void, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, void, 256, Operands>;
using WeightBf16 = Weight<cutlass::bfloat16_t, cutlass::bfloat16_t>;
}  // namespace

std::string gemm_d_weight(DType operands, DType out_dtype, int m, int n, int k, const void* x, int64_t ldx,
                          const void* y, int64_t ldy, void* out, int64_t ldo, const float* alpha, void* workspace,
                          int sm_count, cudaStream_t stream) {
  if (operands == DType::kBF16) {
    if (out_dtype != DType::kBF16) return "d_weight GEMM: bfloat16 operands give bfloat16 only";
    const cutlass::Status st = run_head_gemm<WeightBf16>(m, n, k, x, ldx, y, ldy, nullptr, out, ldo, alpha, nullptr,
                                                         workspace, sm_count, stream);
    if (st != cutlass::Status::kSuccess) return std::string("d_weight GEMM: ") + cutlassGetStatusString(st);
    return {};
  }
  cutlass::Status st = out_dtype == DType::kBF16
                           ? run_head_gemm<Weight<cutlass::bfloat16_t>>(m, n, k, x, ldx, y, ldy, nullptr, out, ldo,
                                                                        alpha, nullptr, workspace, sm_count, stream)
                           : run_head_gemm<Weight<cutlass::half_t>>(m, n, k, x, ldx, y, ldy, nullptr, out, ldo, alpha,
                                                                    nullptr, workspace, sm_count, stream);
  if (st != cutlass::Status::kSuccess) return std::string("d_weight GEMM: ") + cutlassGetStatusString(st);
  return {};
}

size_t gemm_d_weight_workspace(DType operands, DType out_dtype, int m, int n, int k) {
  if (operands == DType::kBF16) return head_gemm_workspace<WeightBf16>(m, n, k);
  return out_dtype == DType::kBF16 ? head_gemm_workspace<Weight<cutlass::bfloat16_t>>(m, n, k)
                                   : head_gemm_workspace<Weight<cutlass::half_t>>(m, n, k);
}

}  // namespace jaxrl_sm90
