// d_hidden's GEMM of the backward (sm90_head_gemm.h): acc = alpha G . W16 + beta acc.
#include "sm90_head_gemm.cuh"
#include "sm90_head_gemm.h"

namespace jaxrl_sm90 {
namespace {
// A = G [n, k]: K-contiguous. B = W16 as (k, d): d-contiguous ([k, d]) or k-contiguous ([d, k]).
using HiddenVd = HeadGemm<float, float, cutlass::layout::RowMajor, cutlass::layout::RowMajor>;
using HiddenDv = HeadGemm<float, float, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
}  // namespace

std::string gemm_d_hidden(bool w16_dv, int n, int d, int k, const void* g, int64_t ldg, const void* w16,
                          int64_t ldw, float* acc, const float* alpha, const float* beta, void* workspace,
                          int sm_count, cudaStream_t stream) {
  cutlass::Status st = w16_dv ? run_head_gemm<HiddenDv>(n, d, k, g, ldg, w16, ldw, acc, acc, d, alpha, beta,
                                                        workspace, sm_count, stream)
                              : run_head_gemm<HiddenVd>(n, d, k, g, ldg, w16, ldw, acc, acc, d, alpha, beta,
                                                        workspace, sm_count, stream);
  if (st != cutlass::Status::kSuccess) return std::string("d_hidden GEMM: ") + cutlassGetStatusString(st);
  return {};
}

size_t gemm_d_hidden_workspace(bool w16_dv, int n, int d, int k) {
  return w16_dv ? head_gemm_workspace<HiddenDv>(n, d, k) : head_gemm_workspace<HiddenVd>(n, d, k);
}

}  // namespace jaxrl_sm90
