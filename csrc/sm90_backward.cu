// The linear-head backward as one launch sequence on XLA's stream (BackwardArgs in
// sm90_launch.h): per vocabulary chunk, the grad kernel (sm90_grad_kernel.cuh; before it the
// weight copy's own kernel where choose_weight_copy says so) and the two CUTLASS GEMMs
// (sm90_head_gemm.h), in order, with no host synchronisation and no copies but
// the one for a "vd" tail that TMA cannot address in place. Each chunk's float16 weight copy
// lives in the chunk's own rows (vd) or columns (dv) of d_weight, which d_hidden's GEMM reads
// before d_weight's GEMM overwrites them: d_weight has W's shape and a 16-bit type, so the
// copy costs the workspace nothing.
#include <algorithm>
#include <string>

#include <cuda_fp16.h>
#include <cutlass/numeric_types.h>

#include "sm90_head_gemm.h"
#include "sm90_launch.h"
#include "sm90_weight_absmax.cuh"

namespace jaxrl_sm90 {
namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
int round8(int x) { return (x + 7) / 8 * 8; }

// Byte offsets into the workspace.
struct Workspace {
  size_t g = 0, tail = 0, wmax = 0, inv_scale = 0, gemm = 0, total = 0;
};

int chunks_of(int v, int chunk) { return (v + chunk - 1) / chunk; }

// The chunk widths are min(chunk, V - start) for start = 0, chunk, 2 chunk, ...; G is sized
// for the widest, with rows padded to a multiple of 8 columns. In "vd", a last chunk whose
// width is not a multiple of 8 has its weight copy (padded with zero rows to 8) and then its
// d_weight rows in `tail`, copied in place at the end: TMA needs the contiguous extent in
// 16-byte units. ("dv" has V % 8 == 0, so every chunk is a multiple of 8 wide.)
Workspace workspace_of(int n, int v, int d, int chunk, bool weight_dv, DType dtype, bool split_k,
                       HiddenTiles hidden_tiles) {
  const int widest = std::min(chunk, v);
  const int last = v - (v - 1) / chunk * chunk;
  const int ld = round8(widest);
  Workspace w;
  w.g = 0;
  w.tail = w.g + align_up(2ull * n * ld);
  const bool tail = !weight_dv && last % 8 != 0;
  w.wmax = w.tail + (tail ? align_up(2ull * round8(last) * d) : 0);  // uint32 per chunk
  w.inv_scale = w.wmax + align_up(4ull * chunks_of(v, chunk));       // float per chunk
  w.gemm = w.inv_scale + align_up(4ull * chunks_of(v, chunk));
  size_t gemm = 0;
  for (int width : {widest, last}) {
    gemm = std::max(gemm, gemm_d_hidden_workspace(DType::kF16, weight_dv, n, d, round8(width), split_k, hidden_tiles));
    gemm = std::max(gemm, weight_dv ? gemm_d_weight_workspace(DType::kF16, dtype, d, width, n)
                                    : gemm_d_weight_workspace(DType::kF16, dtype, round8(width), d, n));
  }
  w.total = w.gemm + align_up(gemm);
  return w;
}

// d_b[c] = sum_n s[n] G[n, c] over the chunk's columns, every sum in a fixed order: 32
// columns a block, 8 row slices summed in order at the end.
__global__ void bias_grad_kernel(const __half* __restrict__ g, int64_t ld, const float* __restrict__ s, int n, int size,
                                 float* __restrict__ out) {
  __shared__ float part[8][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (col < size) {
    for (int r = threadIdx.y; r < n; r += 8) acc = fmaf(s[r], __half2float(g[r * ld + col]), acc);
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < size) {
    float total = 0.f;
    for (int k = 0; k < 8; ++k) total += part[k][threadIdx.x];
    out[col] = total;
  }
}

// G[n, id - start] += coef[n, k] for the ids of row n inside the chunk [start, start + size);
// atomic, as a row may list an id twice.
__global__ void add_id_grads_kernel(__half* __restrict__ g, int64_t ld, const int32_t* __restrict__ ids,
                                    const float* __restrict__ coef, int64_t count, int k, int start, int size) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const int col = ids[i] - start;
    if (col >= 0 && col < size && coef[i] != 0.f) atomicAdd(g + (i / k) * ld + col, __float2half(coef[i]));
  }
}

// Folds max |W| over the columns [start, start + size) into *out (check with cuda_error).
void launch_weight_absmax(DType dtype, bool weight_dv, const void* weight, int start, int size, int d, int v,
                          uint32_t* out, int sm_count, cudaStream_t stream) {
  const dim3 grid(4 * sm_count), block(256);
  if (dtype == DType::kBF16) {
    auto w = static_cast<const cutlass::bfloat16_t*>(weight);
    if (weight_dv) {
      weight_absmax_kernel<cutlass::bfloat16_t, true><<<grid, block, 0, stream>>>(w, start, size, d, v, out);
    } else {
      weight_absmax_kernel<cutlass::bfloat16_t, false><<<grid, block, 0, stream>>>(w, start, size, d, v, out);
    }
  } else {
    auto w = static_cast<const cutlass::half_t*>(weight);
    if (weight_dv) {
      weight_absmax_kernel<cutlass::half_t, true><<<grid, block, 0, stream>>>(w, start, size, d, v, out);
    } else {
      weight_absmax_kernel<cutlass::half_t, false><<<grid, block, 0, stream>>>(w, start, size, d, v, out);
    }
  }
}

std::string cuda_error(const char* what) {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(what) + ": " + cudaGetErrorString(err);
}

}  // namespace

size_t backward_workspace_bytes(int n, int v, int d, int chunk, bool weight_dv, DType dtype, bool split_k,
                                HiddenTiles hidden_tiles) {
  return workspace_of(n, v, d, chunk, weight_dv, dtype, split_k, hidden_tiles).total;
}

std::string launch_backward(const BackwardArgs& a, cudaStream_t stream) {
  const GradArgs& base = a.grad;
  const int n = base.n, v = base.v, d = base.d;
  if (n == 0) {  // no rows: every gradient is 0 (acc is empty)
    if (cudaMemsetAsync(a.d_weight, 0, 2ull * v * d, stream) != cudaSuccess) return cuda_error("memset d_weight");
    if (a.d_bias && cudaMemsetAsync(a.d_bias, 0, sizeof(float) * v, stream) != cudaSuccess)
      return cuda_error("memset d_bias");
    return {};
  }
  if (a.chunk <= 0 || a.chunk % kBlockN != 0) return "chunk must be a positive multiple of 256";
  const Workspace w = workspace_of(n, v, d, a.chunk, base.weight_dv, base.dtype, a.split_k, a.hidden_tiles);
  char* ws = static_cast<char*>(a.workspace);
  __half* g = reinterpret_cast<__half*>(ws + w.g);
  char* d_weight = static_cast<char*>(a.d_weight);
  uint32_t* wmax = reinterpret_cast<uint32_t*>(ws + w.wmax);
  float* inv_scale = reinterpret_cast<float*>(ws + w.inv_scale);
  const float* dw_scale = a.scalars;
  const float* one = a.scalars + 1;

  // max |W| of the first chunk here; each grad kernel folds in the next chunk's
  const int chunks = chunks_of(v, a.chunk);
  if (cudaMemsetAsync(wmax, 0, sizeof(uint32_t) * chunks, stream) != cudaSuccess) return cuda_error("memset wmax");
  launch_weight_absmax(base.dtype, base.weight_dv, base.weight, 0, std::min(a.chunk, v), d, v, wmax, a.sm_count,
                       stream);
  std::string why = cuda_error("weight_absmax_kernel launch");
  if (!why.empty()) return why;
  for (int c = 0, start = 0; start < v; ++c, start += a.chunk) {
    const int size = std::min(a.chunk, v - start);
    const int ld = round8(size);
    GradArgs grad = base;
    grad.start_ptr = nullptr;
    grad.start = start;
    grad.size = size;
    grad.ld = ld;
    grad.out = g;
    // The chunk's part of d_weight: its rows (vd) or columns (dv, row stride V). It holds the
    // chunk's weight copy until d_weight's GEMM overwrites it; a "vd" last chunk that is not a
    // multiple of 8 wide goes through `tail` instead, both its copy (zero rows fill it to ld)
    // and its d_weight rows.
    char* const dw_chunk = d_weight + 2ull * start * (base.weight_dv ? 1 : d);
    const bool in_tail = !base.weight_dv && size % 8 != 0;
    void* w16 = in_tail ? static_cast<void*>(ws + w.tail) : static_cast<void*>(dw_chunk);
    const int64_t ldw = base.weight_dv ? v : d;
    grad.w16 = w16;
    grad.w16_ld = base.weight_dv ? ldw : 0;
    grad.w_scale = nullptr;
    grad.wmax = wmax + c;
    grad.inv_scale = inv_scale + c;
    if (c + 1 < chunks) {
      grad.next_wmax = wmax + c + 1;
      grad.next_start = start + a.chunk;
      grad.next_size = std::min(a.chunk, v - grad.next_start);
    }
    const Plan plan = choose_grad_plan(n, size, a.sm_count);
    const WeightCopy copy = a.weight_copy == WeightCopy::kAuto ? choose_weight_copy(plan) : a.weight_copy;
    if (copy == WeightCopy::kApart) {
      why = launch_weight_copy(grad, a.sm_count, stream);
      if (!why.empty()) return why;
      grad.w16 = nullptr;  // written: the grad kernel leaves it, and the next max |W|, alone
      grad.next_wmax = nullptr;
    }
    why = launch_grad(grad, plan, stream);
    if (!why.empty()) return why;
    if (a.id_k > 0) {
      const int64_t count = int64_t{n} * a.id_k;
      const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, 8ll * a.sm_count));
      add_id_grads_kernel<<<blocks, 256, 0, stream>>>(g, ld, a.ids, a.id_coef, count, a.id_k, start, size);
      why = cuda_error("add_id_grads_kernel launch");
      if (!why.empty()) return why;
    }

    // acc (+)= G[:, :ld] . W16 / sigma_c: the padding columns of G and rows of W16 are 0.
    why = gemm_d_hidden(DType::kF16, base.weight_dv, n, d, ld, g, ld, w16, ldw, a.acc, inv_scale + c,
                        start == 0 ? nullptr : one, ws + w.gemm, a.sm_count, stream, a.split_k, a.hidden_tiles);
    if (!why.empty()) return why;

    if (base.weight_dv) {  // d_weight[:, start : start + size] = dw_scale h16^T . G
      why = gemm_d_weight(DType::kF16, base.dtype, d, size, n, a.h16, d, g, ld, dw_chunk, v, dw_scale, ws + w.gemm,
                          a.sm_count, stream);
    } else if (!in_tail) {  // d_weight[start : start + size] = dw_scale G^T . h16
      why = gemm_d_weight(DType::kF16, base.dtype, size, d, n, g, ld, a.h16, d, dw_chunk, d, dw_scale, ws + w.gemm,
                          a.sm_count, stream);
    } else {
      why = gemm_d_weight(DType::kF16, base.dtype, ld, d, n, g, ld, a.h16, d, ws + w.tail, d, dw_scale, ws + w.gemm,
                          a.sm_count, stream);
      if (why.empty() &&
          cudaMemcpyAsync(dw_chunk, ws + w.tail, 2ull * size * d, cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
        why = cuda_error("copy of the d_weight tail");
    }
    if (!why.empty()) return why;

    if (a.d_bias) {
      bias_grad_kernel<<<(size + 31) / 32, dim3(32, 8), 0, stream>>>(g, ld, a.row_scale, n, size, a.d_bias + start);
      why = cuda_error("bias_grad_kernel launch");
      if (!why.empty()) return why;
    }
  }
  return {};
}

}  // namespace jaxrl_sm90
