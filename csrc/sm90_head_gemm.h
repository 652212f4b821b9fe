// The backward's two GEMMs (sm90_head_gemm.cuh), as plain functions for the host code; each
// kind lives in its own translation unit so the heavy templates compile in parallel.
// Operands are 16-bit (`operands`: float16 for lean's scaled chunks, bfloat16 for the fast
// mode's kept gradient, which only d_weight's bfloat16 result takes), accumulation float32,
// every matrix row-major with a leading dimension (elements, a multiple of 8; base pointers
// 16-byte aligned). alpha and beta point to device memory (alpha null: 1). An empty string
// means success, else the reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "sm90_launch.h"

namespace jaxrl_sm90 {

// How d_hidden's GEMM covers [n, d] (sm90_gemm_hidden.cu, which states the rule): K in `splits`
// parts (1: not split), and tiles 128 wide rather than 256 (`narrow`). A function of the shape,
// the operands' type, `split_k` and `tiles` only.
struct HiddenPlan {
  int splits = 1;
  bool narrow = false;
};
HiddenPlan hidden_plan(DType operands, int n, int d, int k, bool split_k, HiddenTiles pinned);

// acc[n, d] = alpha (g[n, :k] . w16) + beta acc, float32 (beta null: acc is only written);
// w16 is [k, d] (w16_dv false) or [d, k] (true). Where [n, d]'s output tiles fill the GPU's CTAs poorly (too few
// for one wave, or a last wave mostly idle) and `split_k`, K is split over several CTAs per tile
// (sm90_head_gemm.cuh), by hidden_plan's count, which depends on (n, d, k) only, as does the workspace size; split_k
// false keeps one CTA per tile whatever n is (a batch-invariant backward: each row's sums then do not depend on n), its
// tiles half as wide where that fills the GPU better. Tiles half as wide also replace a split of K in two parts (as
// many CTAs, no reduction of the parts); bfloat16 operands keep the split (their kernels are the split ones only,
// fewer instances to compile). `tiles` other than kAuto runs the float16 GEMM unsplit in tiles of that width
// (HiddenTiles); the workspace size takes the same value.
std::string gemm_d_hidden(DType operands, bool w16_dv, int n, int d, int k, const void* g, int64_t ldg, const void* w16,
                          int64_t ldw, float* acc, const float* alpha, const float* beta, void* workspace, int sm_count,
                          cudaStream_t stream, bool split_k = true, HiddenTiles tiles = HiddenTiles::kAuto);
size_t gemm_d_hidden_workspace(DType operands, bool w16_dv, int n, int d, int k, bool split_k = true,
                               HiddenTiles tiles = HiddenTiles::kAuto);

// out[m, n] = alpha (x[:k, :m]^T . y[:k, :n]) in `out_dtype` (row stride ldo); bfloat16
// operands give bfloat16 only.
std::string gemm_d_weight(DType operands, DType out_dtype, int m, int n, int k, const void* x, int64_t ldx,
                          const void* y, int64_t ldy, void* out, int64_t ldo, const float* alpha, void* workspace,
                          int sm_count, cudaStream_t stream);
size_t gemm_d_weight_workspace(DType operands, DType out_dtype, int m, int n, int k);

// Bytes of the workspace of the fast mode's two GEMMs on S rows (ffi_kept_gemms.cc), at least 1.
size_t kept_gemms_workspace_bytes(int s, int v, int d, bool weight_dv, DType dtype);

}  // namespace jaxrl_sm90
