// max |W| over the columns [start, start + size) of the weight ("vd" [V, D]: rows of W;
// "dv" [D, V]: a column range of every row), for the float16 weight copy's power-of-two scale.
// Maxima travel as the bits of a non-negative float: as unsigned integers they order like
// the floats, with NaN above +inf, so an integer atomicMax merges them in any order.
#pragma once

#include <cstdint>

namespace jaxrl_sm90 {

// T: a 16-bit float type (cutlass::bfloat16_t, cutlass::half_t). This thread's share of the
// chunk is its vectors of 8 elements first, first + stride, ..., with kInFlight loads in
// flight; the result is merged into *out by one atomicMax per warp (all 32 lanes call this).
template <class T, bool kDv>
__device__ void fold_weight_absmax(const T* weight, int64_t start, int64_t size, int64_t depth, int64_t vocab,
                                   int64_t first, int64_t stride, uint32_t* out) {
  constexpr int kInFlight = 4;
  // "dv": vector i is (row i / row_vecs, column start + 8 (i % row_vecs)); the quotient and
  // remainder advance by those of the stride, with no division in the loop.
  const int64_t row_vecs = kDv ? size / 8 : size * depth / 8;
  const int64_t rows = kDv ? depth : 1;
  if (row_vecs == 0) return;  // an empty range (the same for every lane)
  const int64_t step_rows = stride / row_vecs, step_cols = stride % row_vecs;
  int64_t row = first / row_vecs, col = first % row_vecs;
  const T* base = weight + (kDv ? start : start * depth);
  const int64_t pitch = kDv ? vocab : 0;
  uint32_t m = 0;
  while (row < rows) {
    uint4 raw[kInFlight];
    int k = 0;
    for (; k < kInFlight && row < rows; ++k) {
      raw[k] = __ldg(reinterpret_cast<const uint4*>(base + row * pitch + 8 * col));
      row += step_rows;
      col += step_cols;
      if (col >= row_vecs) {
        col -= row_vecs;
        ++row;
      }
    }
    for (int j = 0; j < k; ++j) {
      const T* w = reinterpret_cast<const T*>(&raw[j]);
#pragma unroll
      for (int e = 0; e < 8; ++e) m = max(m, __float_as_uint(fabsf(static_cast<float>(w[e]))));
    }
  }
  m = __reduce_max_sync(0xffffffffu, m);
  if (threadIdx.x % 32 == 0 && m != 0) atomicMax(out, m);
}

// The power of two sigma with sigma max|W| <= 2^14 that the float16 weight copy is scaled by:
// 2^14 / (the smallest power of two >= max|W|), 2^14 where max|W| is 0 or not finite, its
// exponent kept within [-120, 120] so that sigma and 1 / sigma are normal floats.
__device__ __forceinline__ float weight_scale_of_max(uint32_t bits) {
  const float amax = __uint_as_float(bits);
  if (!(amax > 0.f) || !isfinite(amax)) return 16384.f;
  int e = 0;
  const float mant = frexpf(amax, &e);  // amax = mant 2^e, mant in [0.5, 1)
  const int p = mant == 0.5f ? e - 1 : e;
  return ldexpf(1.f, max(-120, min(120, 14 - p)));
}

template <class T, bool kDv>
__global__ void weight_absmax_kernel(const T* weight, int start, int size, int depth, int vocab, uint32_t* out) {
  fold_weight_absmax<T, kDv>(weight, start, size, depth, vocab, blockIdx.x * int64_t{blockDim.x} + threadIdx.x,
                             int64_t{gridDim.x} * blockDim.x, out);
}

}  // namespace jaxrl_sm90
