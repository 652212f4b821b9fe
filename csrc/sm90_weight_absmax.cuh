// max |W| over the columns [start, start + size) of the weight ("vd" [V, D]: rows of W;
// "dv" [D, V]: a column range of every row), for the float16 weight copy's power-of-two scale.
// Maxima travel as the bits of a non-negative float: as unsigned integers they order like
// the floats, with NaN above +inf, so an integer atomicMax merges them in any order.
#pragma once

#include <cstdint>

namespace jaxrl_sm90 {

// T: a 16-bit float type (cutlass::bfloat16_t, cutlass::half_t). This thread's share of the chunk, vector i = first, first + stride, ... of 8 elements;
// the result is merged into *out by one atomicMax per warp (all 32 lanes must call it).
template <class T, bool kDv>
__device__ void fold_weight_absmax(const T* weight, int64_t start, int64_t size, int64_t depth, int64_t vocab,
                                   int64_t first, int64_t stride, uint32_t* out) {
  const int64_t row_vecs = size / 8;  // "dv": vectors per row of the range (size % 8 == 0)
  const int64_t vecs = size * depth / 8;
  uint32_t m = 0;
  for (int64_t i = first; i < vecs; i += stride) {
    int64_t src;
    if constexpr (kDv) {
      const int64_t row = i / row_vecs;
      src = row * vocab + start + 8 * (i - row * row_vecs);
    } else {
      src = start * depth + 8 * i;
    }
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(weight + src));
    const T* w = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int e = 0; e < 8; ++e) m = max(m, __float_as_uint(fabsf(static_cast<float>(w[e]))));
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
