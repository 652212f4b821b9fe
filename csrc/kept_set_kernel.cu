// The kept-set kernel (kept_set.h): one CTA per row, the row read from global memory once
// per pass.
//
// Values are compared as int32 keys in the order of their float32 values (float_key, as
// sampler_math.float_key); a threshold is a key. A stage (top-k: F = the count of values
// >= x, target k; top-p: F = their mass, target top_p times the mass of the values the
// stage starts from) looks for tau = the largest x with F(x) >= target, in an interval of
// keys [lo, hi):
//   histogram pass  the interval in kBins bins (evenly spaced values where it spans more
//                   than two binades, evenly spaced keys inside one), each bin's count (top-k)
//                   or mass (top-p: its count bounded from the mass where every value of the
//                   interval weighs at least kBoundedCountUnit, else counted too); the bin
//                   where F crosses the target;
//   gather pass     where that bin and everything above it hold at most kListCap values
//                   (else the bin alone, else the bin is the next interval): those values,
//                   sorted (bitonic up to one a thread, else by radix), give tau exactly.
// A gathered list that holds every value >= tau answers the next stage and the kept set's
// sums without another pass; otherwise one last pass sums them. Masses are exp(u - m) in
// fixed point (kMassScale units, 64-bit integers): a bin's mass and its values' summed
// one-by-one are the same integer, and the sums do not depend on the order of the atomics.
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "kept_set.h"

namespace jaxrl_kept {
namespace {

constexpr int kThreads = 512;
// float4 loads a thread issues before it uses any (a pass is bound by the loads in flight):
// 1, 2, 4 took 2.18, 1.84, 1.70 ms for top-k 50 over [4096, 131072] on one H200
// (benchmarks/studies/variants/kept_set_load_batch.cu, which sets the macro).
#ifndef JAXRL_KEPT_SET_LOAD_BATCH
#define JAXRL_KEPT_SET_LOAD_BATCH 4
#endif
constexpr int kLoadBatch = JAXRL_KEPT_SET_LOAD_BATCH;
constexpr int kBins = 2048;
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kListCap = 4096;
constexpr int kListPerThread = kListCap / kThreads;
constexpr int kMaxRefinements = 12;  // more than a 32-bit interval needs (each cuts >= 2048-fold)
constexpr int32_t kKeyNone = INT32_MIN;
constexpr int32_t kKeyTop = INT32_MAX;  // above every value's key
constexpr float kMassScale = 1099511627776.0f;  // 2^40
// The first interval of a stage, [m - range, m]: most values lie below it and cost no
// atomic; a threshold below it (a row hundreds wide) takes one pass more.
constexpr float kCountRange = 10.0f;  // top-k
constexpr float kMassRange = 14.0f;   // top-p

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
  __device__ T operator()(T x, T y) const { return x > y ? x : y; }
};
struct MinOp {
  template <class T>
  __device__ T operator()(T x, T y) const { return x < y ? x : y; }
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
  // compare-and-swap loop, 8 % slower over a top-p pass)
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
// not the arithmetic).
template <class F>
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
__device__ ull all_sum(Shared& sh, ull x) {
  ull r = ReduceUll(sh.tmp.reduce_ull).Sum(x);
  if (threadIdx.x == 0) sh.bcast_ull[0] = r;
  __syncthreads();
  r = sh.bcast_ull[0];
  __syncthreads();
  return r;
}

__device__ double all_sum(Shared& sh, double x) {
  double r = ReduceF64(sh.tmp.reduce_f64).Sum(x);
  if (threadIdx.x == 0) sh.bcast_f64[0] = r;
  __syncthreads();
  r = sh.bcast_f64[0];
  __syncthreads();
  return r;
}

__device__ int all_max(Shared& sh, int x) {
  int r = ReduceInt(sh.tmp.reduce_int).Reduce(x, MaxOp());
  if (threadIdx.x == 0) sh.bcast_int[0] = r;
  __syncthreads();
  r = sh.bcast_int[0];
  __syncthreads();
  return r;
}

__device__ uint32_t all_max_u32(Shared& sh, uint32_t x) {
  uint32_t r = ReduceU32(sh.tmp.reduce_u32).Reduce(x, MaxOp());
  if (threadIdx.x == 0) sh.bcast_int[0] = static_cast<int>(r);
  __syncthreads();
  r = static_cast<uint32_t>(sh.bcast_int[0]);
  __syncthreads();
  return r;
}

__device__ int all_min(Shared& sh, int x) {
  int r = ReduceInt(sh.tmp.reduce_int).Reduce(x, MinOp());
  if (threadIdx.x == 0) sh.bcast_int[0] = r;
  __syncthreads();
  r = sh.bcast_int[0];
  __syncthreads();
  return r;
}

__device__ float row_max(Shared& sh, const Row& row) {
  float mx = -INFINITY;
  for_each(row, [&](float value) { mx = fmaxf(mx, value); });  // fmaxf drops NaN
  float r = ReduceF32(sh.tmp.reduce_f32).Reduce(mx, MaxOp());
  if (threadIdx.x == 0) sh.bcast_f64[0] = r;
  __syncthreads();
  r = static_cast<float>(sh.bcast_f64[0]);
  __syncthreads();
  return r;
}

// Lays out the bins of [lo, hi) and clears them. `counted`: whether the histogram pass counts
// each bin's values.
__device__ void spread(Shared& sh, int32_t lo, int32_t hi, bool counted) {
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
__device__ int32_t edge(Shared& sh, int b) {
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

// F over parts of the filtered values: count and mass.
struct Sums {
  ull count = 0, mass = 0;
};

struct Histogram {
  Sums above;  // keys >= hi
  Sums below;  // filter <= keys < lo
  Sums inside;
};

// One pass: the bins of [lo, hi) over the values with key >= filter.
__device__ Histogram histogram(Shared& sh, const Row& row, int32_t filter, int32_t lo, int32_t hi, bool with_mass) {
  const bool counted = !with_mass || fixed_mass(key_value(lo), row.m) < kBoundedCountUnit;
  spread(sh, lo, hi, counted);
  const Bins bins = sh.bins;  // in registers: the atomics below would make the compiler reread it
  unsigned int above_count = 0, below_count = 0;  // V < 2^32
  ull above_mass = 0, below_mass = 0;
  for_each(row, [&](float value) {
    const int32_t key = float_key(value);
    if (key < filter) return;
    const ull e = with_mass ? fixed_mass(value, row.m) : 0;
    if (key >= hi) {
      above_count += 1;
      above_mass += e;
    } else if (key < lo) {
      below_count += 1;
      below_mass += e;
    } else {
      const int b = bins.of(key, value);
      if (counted) atomicAdd(&sh.count[b], 1u);
      if (with_mass) {
        const unsigned int lo_word = static_cast<unsigned int>(e);
        unsigned int hi_word = static_cast<unsigned int>(e >> 32);
        const unsigned int old = atomicAdd(&sh.mass_lo[b], lo_word);
        hi_word += old + lo_word < old;  // the carry out of the low word
        if (hi_word) atomicAdd(&sh.mass_hi[b], hi_word);
      }
    }
  });
  Histogram h;
  h.above.count = all_sum(sh, ull{above_count});
  h.above.mass = all_sum(sh, above_mass);
  h.below.count = all_sum(sh, ull{below_count});
  h.below.mass = all_sum(sh, below_mass);
  return h;
}

// Where F (count or mass) of the values >= each bin's lower edge crosses the target.
// The counts are upper bounds where the histogram took no count atomics (Bins::counted): they
// only decide whether a gather fits the list.
struct Crossing {
  int bin = -1;       // -1: F(>= lo) < target
  Sums above_bin;     // over the values >= edge(bin + 1)
  Sums at_or_above;   // over the values >= edge(bin)
  Sums inside;        // over [lo, hi)
};

__device__ Crossing crossing(Shared& sh, const Row& row, const Histogram& h, Kind kind, ull target) {
  // thread t holds bins kBins - 1 - (t * kBinsPerThread + j): from the top down
  ull cnt[kBinsPerThread], mas[kBinsPerThread];
  ull cnt_sum = 0, mas_sum = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    const int b = kBins - 1 - (threadIdx.x * kBinsPerThread + j);
    mas[j] = (static_cast<ull>(sh.mass_hi[b]) << 32) | sh.mass_lo[b];
    cnt[j] = sh.bins.counted ? sh.count[b] : bounded_count(sh.bins, b, mas[j], row.m);
    cnt_sum += cnt[j];
    mas_sum += mas[j];
  }
  ull cnt_above, mas_above, cnt_total, mas_total;
  ScanUll(sh.tmp.scan).ExclusiveSum(cnt_sum, cnt_above, cnt_total);
  __syncthreads();
  ScanUll(sh.tmp.scan).ExclusiveSum(mas_sum, mas_above, mas_total);
  __syncthreads();
  cnt_above += h.above.count;
  mas_above += h.above.mass;
  if (threadIdx.x == 0) sh.bcast_int[1] = -1;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    const ull f_above = kind == kCount ? cnt_above : mas_above;
    const ull f_at = f_above + (kind == kCount ? cnt[j] : mas[j]);
    if (f_above < target && f_at >= target) {
      sh.bcast_int[1] = kBins - 1 - (threadIdx.x * kBinsPerThread + j);
      sh.bcast_ull[0] = cnt_above;
      sh.bcast_ull[1] = mas_above;
      sh.bcast_ull[2] = cnt_above + cnt[j];
      sh.bcast_ull[3] = mas_above + mas[j];
    }
    cnt_above += cnt[j];
    mas_above += mas[j];
  }
  __syncthreads();
  Crossing c;
  c.bin = sh.bcast_int[1];
  if (c.bin >= 0) {
    c.above_bin = {sh.bcast_ull[0], sh.bcast_ull[1]};
    c.at_or_above = {sh.bcast_ull[2], sh.bcast_ull[3]};
  }
  c.inside = {cnt_total, mas_total};
  __syncthreads();
  return c;
}

// Sorts sh.list[0, len) (keys >= lo) in decreasing order: a bitonic sort where the list is at
// most one key a thread, else a radix sort of the keys' offsets from lo (over as many bits as
// the largest needs).
__device__ void sort_list(Shared& sh, int len, int32_t lo) {
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

// The filtered values with keys in [lo, hi) into sh.list, sorted in decreasing order
// (sh.list_len of them, at most kListCap); returns the largest key below lo of any value.
__device__ int32_t gather(Shared& sh, const Row& row, int32_t filter, int32_t lo, int32_t hi) {
  if (threadIdx.x == 0) sh.list_len = 0;
  __syncthreads();
  int32_t below = kKeyNone;
  for_each(row, [&](float value) {
    const int32_t key = float_key(value);
    if (key >= lo && key < hi) {
      if (key >= filter) sh.list[atomicAdd(&sh.list_len, 1)] = key;
    } else if (key < lo) {
      below = max(below, key);
    }
  });
  below = all_max(sh, below);  // (synchronises: list_len is final)
  sort_list(sh, sh.list_len, max(lo, filter));
  return below;
}

// Within the sorted list (its first `len` keys, above it values summing to `base`): the first
// index whose F, counted from the top, reaches the target.
__device__ int first_reaching(Shared& sh, const Row& row, int len, Kind kind, Sums base, ull target) {
  if (kind == kCount) return static_cast<int>(target - base.count) - 1;
  ull e[kListPerThread];
  ull sum = 0;
#pragma unroll
  for (int j = 0; j < kListPerThread; ++j) {
    const int i = threadIdx.x * kListPerThread + j;
    e[j] = i < len ? fixed_mass(key_value(sh.list[i]), row.m) : 0;
    sum += e[j];
  }
  ull before;
  ScanUll(sh.tmp.scan).ExclusiveSum(sum, before);
  __syncthreads();
  ull f = base.mass + before;
  int first = INT_MAX;
#pragma unroll
  for (int j = 0; j < kListPerThread; ++j) {
    const int i = threadIdx.x * kListPerThread + j;
    f += e[j];
    if (i < len && f >= target) first = min(first, i);
  }
  return all_min(sh, first);
}

// The last index of the list holding `key` (the list is sorted: its run of equal keys).
__device__ int last_index_of(Shared& sh, int len, int32_t key) {
  int last = -1;
  for (int i = threadIdx.x; i < len; i += kThreads)
    if (sh.list[i] == key) last = max(last, i);
  return all_max(sh, last);
}

// The list's mass over its first `count` entries.
__device__ ull list_mass(Shared& sh, const Row& row, int count) {
  ull sum = 0;
  for (int i = threadIdx.x; i < count; i += kThreads) sum += fixed_mass(key_value(sh.list[i]), row.m);
  return all_sum(sh, sum);
}

// A stage's outcome: the kept set is key >= tau; `listed`: sh.list holds every filtered value
// >= its own lowest key, `gap_below_list` the largest key below that (any value).
struct Stage {
  int32_t tau;
  bool listed = false;
  int32_t gap_below_list = kKeyNone;
};

// top-k (kCount, target k) or top-p (kMass, target the fraction `top_p` of the filtered mass).
__device__ Stage search(Shared& sh, const Row& row, int32_t filter, Kind kind, ull k, float top_p, int& passes) {
  const float range = kind == kCount ? kCountRange : kMassRange;
  int32_t hi = isfinite(row.m) ? float_key(row.m) + 1 : kKeyTop;
  int32_t lo = isfinite(row.m) ? max(filter, float_key(row.m - range)) : filter;
  if (lo >= hi) lo = filter;
  if (lo >= hi) hi = kKeyTop;
  ull target = k;
  bool first = true;
  for (int round = 0; round < kMaxRefinements; ++round) {
    const Histogram h = histogram(sh, row, filter, lo, hi, kind == kMass);
    ++passes;
    Crossing c;
    if (first && kind == kMass) {
      // the target needs the total, which needs this pass's sums first
      c = crossing(sh, row, h, kind, ~0ull);
      const ull total = h.above.mass + c.inside.mass + h.below.mass;
      target = static_cast<ull>(ceil(static_cast<double>(top_p) * static_cast<double>(total)));
      if (target == 0) return Stage{filter};
    }
    first = false;
    c = crossing(sh, row, h, kind, target);
    if (c.bin < 0) {
      const Sums ge_lo{h.above.count + c.inside.count, h.above.mass + c.inside.mass};
      const ull f_ge_lo = kind == kCount ? ge_lo.count : ge_lo.mass;
      const ull f_ge_filter = f_ge_lo + (kind == kCount ? h.below.count : h.below.mass);
      if (lo > filter && f_ge_filter >= target) {  // below the interval
        hi = lo;
        lo = filter;
        continue;
      }
      return Stage{filter};  // fewer than the target: everything from the filter up is kept
    }
    const int32_t bin_lo = edge(sh, c.bin), bin_hi = edge(sh, c.bin + 1);
    if (bin_hi - bin_lo == 1) return Stage{bin_lo};  // one value, tied entries
    const bool all_above = c.at_or_above.count <= kListCap;
    if (all_above || c.at_or_above.count - c.above_bin.count <= kListCap) {
      const int32_t gap = gather(sh, row, filter, bin_lo, all_above ? kKeyTop : bin_hi);
      ++passes;
      const int len = sh.list_len;
      const Sums base = all_above ? Sums{} : c.above_bin;
      const int at = first_reaching(sh, row, len, kind, base, target);
      Stage out{sh.list[at]};
      __syncthreads();
      out.listed = all_above;
      out.gap_below_list = gap;
      return out;
    }
    lo = bin_lo;
    hi = bin_hi;
  }
  return Stage{lo};  // not reached: each round cuts the interval at least 2048-fold
}

__global__ void __launch_bounds__(kThreads, 2) kept_set_kernel(KeptSetArgs args) {
  extern __shared__ __align__(16) unsigned char smem[];
  Shared& sh = *reinterpret_cast<Shared*>(smem);
  const int64_t r = blockIdx.x;
  if (!args.active[r]) {
    if (threadIdx.x == 0) {
      args.floor[r] = -INFINITY;
      args.s[r] = 0.0f;
      args.a[r] = 0.0f;
      args.passes[r] = 0;
    }
    return;
  }
  const Row row{args.u + r * args.vocab, args.vocab, args.m[r]};
  int passes = 0;
  int32_t filter = kKeyNone + 1;  // every value but -inf (and NaN)
  if (args.has_min_p) {
    const float top = row_max(sh, row);
    ++passes;
    filter = max(filter, float_key(top + args.log_min_p));
  }
  Stage stage{filter};
  if (args.top_k > 0) stage = search(sh, row, filter, kCount, static_cast<ull>(args.top_k), 1.0f, passes);
  if (args.top_p < 1.0f) {
    if (stage.listed) {  // the list holds every value >= tau: top-p within it
      const int len = last_index_of(sh, sh.list_len, stage.tau) + 1;
      const ull z = list_mass(sh, row, len);
      const ull target = static_cast<ull>(ceil(static_cast<double>(args.top_p) * static_cast<double>(z)));
      const int at = first_reaching(sh, row, len, kMass, Sums{}, target);
      stage.tau = sh.list[at];
      __syncthreads();
    } else {
      stage = search(sh, row, stage.tau, kMass, 0, args.top_p, passes);
    }
  }
  // The kept set's sums, the smallest kept value and the largest value below it.
  int32_t tau_key, gap;
  double s = 0.0, a = 0.0;
  if (stage.listed) {
    const int last = last_index_of(sh, sh.list_len, stage.tau);
    for (int i = threadIdx.x; i <= last; i += kThreads) {
      const float shifted = key_value(sh.list[i]) - row.m;
      const double e = expf(shifted);
      s += e;
      a += e * shifted;
    }
    tau_key = stage.tau;
    gap = last + 1 < sh.list_len ? sh.list[last + 1] : stage.gap_below_list;
  } else {
    int kept_min = INT_MAX, below = kKeyNone;
    for_each(row, [&](float value) {
      const int32_t key = float_key(value);
      if (key >= stage.tau) {
        const float shifted = value - row.m;
        const double e = expf(shifted);
        s += e;
        a += e * shifted;
        kept_min = min(kept_min, key);
      } else {
        below = max(below, key);
      }
    });
    ++passes;
    tau_key = all_min(sh, kept_min);
    gap = all_max(sh, below);
  }
  s = all_sum(sh, s);
  a = all_sum(sh, a);
  if (threadIdx.x == 0) {
    float floor = -INFINITY;
    if (tau_key != INT_MAX && gap != kKeyNone) {
      const float tau_v = key_value(tau_key), gap_v = key_value(gap);
      float mid = gap_v + (tau_v - gap_v) * 0.5f;
      if (!isfinite(mid)) mid = gap_v * 0.5f + tau_v * 0.5f;
      floor = mid > gap_v && mid <= tau_v ? mid : tau_v;
    }
    args.floor[r] = floor;
    args.s[r] = static_cast<float>(s);
    args.a[r] = static_cast<float>(a);
    args.passes[r] = passes;
  }
}

}  // namespace

std::string launch_kept_set(const KeptSetArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return "";
  if (args.rows > kMaxRows || args.vocab > kMaxVocab) return "kept_set: too many rows or columns";
  const size_t smem = sizeof(Shared);
  cudaError_t err = cudaFuncSetAttribute(kept_set_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return std::string("kept_set: ") + cudaGetErrorString(err);
  kept_set_kernel<<<static_cast<unsigned int>(args.rows), kThreads, smem, stream>>>(args);
  err = cudaGetLastError();
  return err == cudaSuccess ? "" : std::string("kept_set: ") + cudaGetErrorString(err);
}

}  // namespace jaxrl_kept
