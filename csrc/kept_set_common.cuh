// What the kept-set kernel's passes (kept_set_kernel.cuh) are made of: values as int32 keys, masses
// in fixed point, the CTA's shared memory, the loop over this thread's share of a row, block-wide
// reductions, a histogram's bins and the sort of the gathered list.
#pragma once

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>
#include <cmath>
#include <cstdint>

namespace jaxrl_kept {

constexpr int kThreads = 512;
constexpr int kBins = 2048;
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kListCap = 4096;
constexpr int kListPerThread = kListCap / kThreads;
constexpr int32_t kKeyNone = INT32_MIN;
constexpr int32_t kKeyTop = INT32_MAX;          // above every value's key
constexpr float kMassScale = 1099511627776.0f;  // 2^40

using ull = unsigned long long;

enum Kind { kCount, kMass };

// The keys of -inf and +inf by the bit flip below: NaNs fall outside them (a negative NaN
// below, a positive one above) and, with -inf, take kKeyNone.
constexpr int32_t kKeyMinusInf = static_cast<int32_t>(0xff800000u ^ 0x7fffffffu);
constexpr int32_t kKeyPlusInf = 0x7f800000;

__device__ __forceinline__ int32_t float_key(float u) {
  const int32_t bits = __float_as_int(u + 0.0f);  // -0 as +0
  const int32_t key = bits ^ ((bits >> 31) & 0x7fffffff);
  return key > kKeyMinusInf && key <= kKeyPlusInf ? key : kKeyNone;
}

__device__ __forceinline__ float key_value(int32_t key) {
  if (key == kKeyNone) return -INFINITY;
  return __int_as_float(key < 0 ? key ^ 0x7fffffff : key);
}

// exp(u - m) in fixed point, for the histograms and the gathered lists alike (the same
// function in both, so that a bin's mass is its values' sum); the fast exp: thresholds sit
// within its 2^-21 relative error of the float64 sums' only at near ties. The kept set's
// sums take expf.
__device__ __forceinline__ ull fixed_mass(float u, float m) {
  // __expf's ex2 on (u - m) log2(e), without its rescaling of results below 2^-126 (they are
  // 0 units either way)
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"((u - m) * 1.4426950408889634f));
  return __float2ull_rn(e * kMassScale);
}

struct MaxOp {
  template <class T>
  __device__ T operator()(T x, T y) const {
    return x > y ? x : y;
  }
};
struct MinOp {
  template <class T>
  __device__ T operator()(T x, T y) const {
    return x < y ? x : y;
  }
};

using ScanUll = cub::BlockScan<ull, kThreads>;
using ReduceUll = cub::BlockReduce<ull, kThreads>;
using ReduceF64 = cub::BlockReduce<double, kThreads>;
using ReduceF32 = cub::BlockReduce<float, kThreads>;
using ReduceInt = cub::BlockReduce<int, kThreads>;
using ReduceU32 = cub::BlockReduce<uint32_t, kThreads>;
using SortKeys = cub::BlockRadixSort<uint32_t, kThreads, kListPerThread>;

// A histogram's bins over the keys [lo, hi): evenly spaced values (by_value: the interval spans
// more than two binades) or keys.
struct Bins {
  int32_t lo, hi;
  bool by_value;
  float lo_value, bins_per_unit;
  uint32_t step;
  // false: a mass histogram that took no count atomics (bounded_count gives its bins' counts)
  bool counted;

  __device__ __forceinline__ int of_value(float value) const {
    const float guess = fminf(fmaxf((value - lo_value) * bins_per_unit, 0.0f), static_cast<float>(kBins - 1));
    return static_cast<int>(guess);
  }
  // The bin of a value in [lo, hi): by_value, its offset from lo in bins, clamped (monotone in
  // the value, so that each bin holds the keys between two edges).
  __device__ __forceinline__ int of(int32_t key, float value) const {
    if (by_value) return of_value(value);
    return static_cast<int>((static_cast<uint32_t>(key) - static_cast<uint32_t>(lo)) / step);
  }
  // A value no larger than any of bin b's (its lower edge, or below it by less than half a bin).
  __device__ __forceinline__ float floor_value(int b) const {
    if (!by_value) return key_value(edge_by_key(b));
    return b == 0 ? lo_value : lo_value + (static_cast<float>(b) - 0.5f) / bins_per_unit;
  }
  __device__ __forceinline__ int32_t edge_by_key(int b) const {
    const uint32_t span = static_cast<uint32_t>(static_cast<int64_t>(hi) - lo);
    return static_cast<int32_t>(lo + static_cast<int64_t>(min(static_cast<ull>(b) * step, static_cast<ull>(span))));
  }
};

struct Shared {
  // a bin's mass in two 32-bit words: two native atomics (a 64-bit add on shared memory is a
  // compare-and-swap loop; docs/performance.md, "Kernel constants")
  unsigned int mass_lo[kBins];
  unsigned int mass_hi[kBins];
  unsigned int count[kBins];
  int32_t list[kListCap];
  union {
    SortKeys::TempStorage sort;
    ScanUll::TempStorage scan;
    ReduceUll::TempStorage reduce_ull;
    ReduceF64::TempStorage reduce_f64;
    ReduceF32::TempStorage reduce_f32;
    ReduceInt::TempStorage reduce_int;
    ReduceU32::TempStorage reduce_u32;
  } tmp;
  // values every thread reads after a __syncthreads()
  ull bcast_ull[4];
  double bcast_f64[2];
  int bcast_int[4];
  int list_len;
  Bins bins;
};

struct Row {
  const float* x;
  int64_t v;
  float m;
};

// f(value) on this thread's share of the row: 16-byte loads where the row allows them, in
// batches of kLoadBatch issued before f runs on any (a pass is bound by the loads' latency,
// not the arithmetic; kDefaultLoadBatch in the kernel).
template <int kLoadBatch, class F>
__device__ __forceinline__ void for_each(const Row& row, F&& f) {
  if (row.v % 4 == 0 && reinterpret_cast<uintptr_t>(row.x) % 16 == 0) {
    const float4* x4 = reinterpret_cast<const float4*>(row.x);
    const int64_t n4 = row.v / 4;
    int64_t i = threadIdx.x;
    for (; i + (kLoadBatch - 1) * kThreads < n4; i += kLoadBatch * kThreads) {
      float4 q[kLoadBatch];
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) q[j] = __ldg(x4 + i + j * kThreads);
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) {
        f(q[j].x);
        f(q[j].y);
        f(q[j].z);
        f(q[j].w);
      }
    }
    for (; i < n4; i += kThreads) {
      const float4 q = __ldg(x4 + i);
      f(q.x);
      f(q.y);
      f(q.z);
      f(q.w);
    }
  } else {
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < row.v; i += kThreads) f(__ldg(row.x + i));
  }
}

// A block-wide reduction whose result every thread gets.
__device__ inline ull all_sum(Shared& sh, ull x) {
  ull r = ReduceUll(sh.tmp.reduce_ull).Sum(x);
  if (threadIdx.x == 0) sh.bcast_ull[0] = r;
  __syncthreads();
  r = sh.bcast_ull[0];
  __syncthreads();
  return r;
}

__device__ inline double all_sum(Shared& sh, double x) {
  double r = ReduceF64(sh.tmp.reduce_f64).Sum(x);
  if (threadIdx.x == 0) sh.bcast_f64[0] = r;
  __syncthreads();
  r = sh.bcast_f64[0];
  __syncthreads();
  return r;
}

__device__ inline int all_max(Shared& sh, int x) {
  int r = ReduceInt(sh.tmp.reduce_int).Reduce(x, MaxOp());
  if (threadIdx.x == 0) sh.bcast_int[0] = r;
  __syncthreads();
  r = sh.bcast_int[0];
  __syncthreads();
  return r;
}

__device__ inline uint32_t all_max_u32(Shared& sh, uint32_t x) {
  uint32_t r = ReduceU32(sh.tmp.reduce_u32).Reduce(x, MaxOp());
  if (threadIdx.x == 0) sh.bcast_int[0] = static_cast<int>(r);
  __syncthreads();
  r = static_cast<uint32_t>(sh.bcast_int[0]);
  __syncthreads();
  return r;
}

__device__ inline int all_min(Shared& sh, int x) {
  int r = ReduceInt(sh.tmp.reduce_int).Reduce(x, MinOp());
  if (threadIdx.x == 0) sh.bcast_int[0] = r;
  __syncthreads();
  r = sh.bcast_int[0];
  __syncthreads();
  return r;
}

template <int kLoadBatch>
__device__ float row_max(Shared& sh, const Row& row) {
  float mx = -INFINITY;
  for_each<kLoadBatch>(row, [&](float value) { mx = fmaxf(mx, value); });  // fmaxf drops NaN
  float r = ReduceF32(sh.tmp.reduce_f32).Reduce(mx, MaxOp());
  if (threadIdx.x == 0) sh.bcast_f64[0] = r;
  __syncthreads();
  r = static_cast<float>(sh.bcast_f64[0]);
  __syncthreads();
  return r;
}

// Lays out the bins of [lo, hi) and clears them. `counted`: whether the histogram pass counts
// each bin's values.
__device__ inline void spread(Shared& sh, int32_t lo, int32_t hi, bool counted) {
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    sh.count[b] = 0;
    sh.mass_lo[b] = 0;
    sh.mass_hi[b] = 0;
  }
  if (threadIdx.x == 0) {
    const uint32_t span = static_cast<uint32_t>(static_cast<int64_t>(hi) - lo);
    const float lo_v = key_value(lo), hi_v = key_value(hi);
    const float limit = 18446744073709551616.0f;  // 2^64: no overflow of hi_v - lo_v
    Bins& bins = sh.bins;
    bins.lo = lo;
    bins.hi = hi;
    bins.by_value = span > (1u << 24) && fabsf(lo_v) < limit && fabsf(hi_v) < limit;
    bins.lo_value = lo_v;
    bins.bins_per_unit = kBins / (hi_v - lo_v);
    bins.step = span / kBins + (span % kBins != 0);
    bins.counted = counted;
  }
  __syncthreads();
}

// Bin b's lower edge (edge(b) <= key < edge(b + 1) in bin b; edge(kBins) = hi). By value, the
// first key whose bin is >= b, found by warp 0 in steps that split the interval 32-fold.
__device__ inline int32_t edge(Shared& sh, int b) {
  const Bins& bins = sh.bins;
  if (!bins.by_value || b == 0 || b == kBins) return b == kBins ? bins.hi : bins.edge_by_key(b);
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int64_t first = bins.lo, last = bins.hi;  // the edge is in [first, last]
    while (first < last) {
      const int64_t step = (last - first + 31) / 32;
      const int64_t probe = first + lane * step;
      const bool at_or_above = probe >= last || bins.of_value(key_value(static_cast<int32_t>(probe))) >= b;
      const int j = __ffs(__ballot_sync(0xffffffffu, at_or_above)) - 1;  // the first probe at or above
      if (j < 0) {  // every probe below the edge: it is past lane 31's
        first = first + 31 * step + 1;
      } else if (j == 0) {
        last = first;
      } else {
        last = min(last, first + j * step);
        first = first + (j - 1) * step + 1;
      }
    }
    if (lane == 0) sh.bcast_int[2] = static_cast<int32_t>(first);
  }
  __syncthreads();
  const int32_t e = sh.bcast_int[2];
  __syncthreads();
  return e;
}

// A mass histogram leaves out the count atomics where every value of its interval has a mass of
// at least this many units: a bin's count is then at most its mass over its lower edge's
// (bounded_count), within a relative 2^-16 of the exact one for these units.
constexpr ull kBoundedCountUnit = ull{1} << 16;

// At least the count of bin b of `mass`: each value's fixed mass is at least that of the bin's
// floor_value (the fast exp is monotone to within its 2^-21 error, the rounding to within half
// a unit: together less than the 2^-12 taken off).
__device__ __forceinline__ ull bounded_count(const Bins& bins, int b, ull mass, float m) {
  const ull unit = fixed_mass(bins.floor_value(b), m);
  return mass / (unit - (unit >> 12));
}

// Sorts sh.list[0, len) (keys >= lo) in decreasing order: a bitonic sort where the list is at
// most one key a thread, else a radix sort of the keys' offsets from lo (over as many bits as
// the largest needs).
__device__ inline void sort_list(Shared& sh, int len, int32_t lo) {
  if (len <= kThreads) {
    int n = 2;
    while (n < len) n <<= 1;
    if (threadIdx.x >= len && threadIdx.x < n) sh.list[threadIdx.x] = kKeyNone;
    __syncthreads();
    const int i = threadIdx.x;
    for (int k = 2; k <= n; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        const int partner = i ^ j;
        if (i < n && partner > i) {
          const int32_t x = sh.list[i], y = sh.list[partner];
          const bool decreasing = (i & k) == 0;
          if (decreasing ? x < y : x > y) {
            sh.list[i] = y;
            sh.list[partner] = x;
          }
        }
        __syncthreads();
      }
    }
    return;
  }
  // padding takes offset 0, the smallest: the first len keys sorted are the list's
  uint32_t offsets[kListPerThread];
  uint32_t top = 0;
#pragma unroll
  for (int j = 0; j < kListPerThread; ++j) {
    const int i = threadIdx.x * kListPerThread + j;
    offsets[j] = i < len ? static_cast<uint32_t>(sh.list[i]) - static_cast<uint32_t>(lo) : 0u;
    top = max(top, offsets[j]);
  }
  const int bits = 32 - __clz(static_cast<int>(all_max_u32(sh, top)));
  if (bits == 0) return;  // all equal
  SortKeys(sh.tmp.sort).SortDescending(offsets, 0, bits);
#pragma unroll
  for (int j = 0; j < kListPerThread; ++j)
    sh.list[threadIdx.x * kListPerThread + j] = static_cast<int32_t>(static_cast<uint32_t>(lo) + offsets[j]);
  __syncthreads();
}

}  // namespace jaxrl_kept
