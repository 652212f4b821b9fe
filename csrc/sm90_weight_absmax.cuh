// max |W| over the columns [start, start + size) of the weight ("vd" [V, D]: rows of W;
// "dv" [D, V]: a column range of every row), for the float16 weight copy's power-of-two scale.
// Maxima travel as the bits of a non-negative float: as unsigned integers they order like
// the floats, with NaN above +inf, so an integer atomicMax merges them in any order.
#pragma once

#include <cstdint>

namespace jaxrl_sm90 {

// Vectors first, first + stride, ... of a range of `rows` x `row_vecs` vectors of 8 elements,
// as (row, col), stepped with no division (the producer warps that walk them run on 40
// registers beside the tensor-core-bound consumers).
struct VectorWalk {
  int64_t row, col, rows, row_vecs, step_rows, step_cols;
  __device__ __forceinline__ VectorWalk(int64_t rows_, int64_t row_vecs_, int64_t first, int64_t stride)
      : row(first / row_vecs_), col(first % row_vecs_), rows(rows_), row_vecs(row_vecs_), step_rows(stride / row_vecs_),
        step_cols(stride % row_vecs_) {}
  __device__ __forceinline__ bool more() const { return row < rows; }
  __device__ __forceinline__ void next() {
    row += step_rows;
    col += step_cols;
    if (col >= row_vecs) {
      col -= row_vecs;
      ++row;
    }
  }
};

// The walk over W's columns [start, start + size) (size % 8 == 0 in "dv"): "vd" is one row of
// size D / 8 vectors from W + start D; "dv" is D rows of size / 8 vectors, V apart, from W + start.
template <bool kDv>
__device__ __forceinline__ VectorWalk weight_walk(int64_t size, int64_t depth, int64_t first, int64_t stride) {
  return kDv ? VectorWalk(depth, size / 8, first, stride) : VectorWalk(1, size * depth / 8, first, stride);
}
template <bool kDv>
__device__ __forceinline__ int64_t weight_offset(const VectorWalk& it, int64_t start, int64_t depth, int64_t vocab) {
  return kDv ? it.row * vocab + start + 8 * it.col : start * depth + 8 * it.col;
}

// T: a 16-bit float type (cutlass::bfloat16_t, cutlass::half_t). This thread's share of the
// range, 4 loads in flight, merged into *out by one atomicMax per warp (all 32 lanes call it).
template <class T, bool kDv>
__device__ void fold_weight_absmax(const T* weight, int64_t start, int64_t size, int64_t depth, int64_t vocab,
                                   int64_t first, int64_t stride, uint32_t* out) {
  constexpr int kInFlight = 4;
  if (size == 0) return;  // the same for every lane
  uint32_t m = 0;
  VectorWalk it = weight_walk<kDv>(size, depth, first, stride);
  while (it.more()) {
    uint4 raw[kInFlight];  // compile-time indices only: the array stays in registers
#pragma unroll
    for (int j = 0; j < kInFlight; ++j, it.next()) {
      raw[j] = it.more() ? __ldg(reinterpret_cast<const uint4*>(weight + weight_offset<kDv>(it, start, depth, vocab)))
                         : make_uint4(0, 0, 0, 0);  // |0| adds nothing to the max
    }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
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
