// The kept-set kernel (kept_set.h): one CTA per row, the row read from global memory once
// per pass.
//
// Values are compared as int32 keys in the order of their float32 values (float_key, as
// sampler_math.float_key); a threshold is a key. A stage (top-k: F = the count of values
// >= x, target k; top-p: F = their mass, target top_p times the mass of the values the
// stage starts from) looks for tau = the largest x with F(x) >= target, in an interval of
// keys [lo, hi):
//   histogram pass  the interval in kBins bins (evenly spaced values where it spans more
//                   than two binades, evenly spaced keys inside one), each bin's count (and
//                   mass); the bin where F crosses the target;
//   gather pass     where that bin and everything above it hold at most kListCap values
//                   (else the bin alone, else the bin is the next interval): those values,
//                   sorted, give tau exactly.
// A gathered list that holds every value >= tau answers the next stage and the kept set's
// sums without another pass; otherwise one last pass sums them. Masses are exp(u - m) in
// fixed point (kMassScale units, 64-bit integers): a bin's mass and its values' summed
// one-by-one are the same integer, and the sums do not depend on the order of the atomics.
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
// (benchmarks/variants/kept_set_load_batch.cu, which sets the macro).
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

__device__ __forceinline__ int32_t float_key(float u) {
  if (isnan(u) || u == -INFINITY) return kKeyNone;
  if (u == 0.0f) u = 0.0f;  // -0 as +0
  const int32_t bits = __float_as_int(u);
  return bits < 0 ? bits ^ 0x7fffffff : bits;
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
  return __float2ull_rn(__expf(u - m) * kMassScale);
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

struct Shared {
  unsigned int mass_lo[kBins];  // a bin's mass in two 32-bit words (two native atomics)
  unsigned int mass_hi[kBins];
  unsigned int count[kBins];
  int32_t edge[kBins + 1];
  int32_t list[kListCap];
  union {
    ScanUll::TempStorage scan;
    ReduceUll::TempStorage reduce_ull;
    ReduceF64::TempStorage reduce_f64;
    ReduceF32::TempStorage reduce_f32;
    ReduceInt::TempStorage reduce_int;
  } tmp;
  // values every thread reads after a __syncthreads()
  ull bcast_ull[4];
  double bcast_f64[2];
  int bcast_int[4];
  int list_len;
  // the histogram's bins: evenly spaced values (by_value) or keys
  bool by_value;
  float lo_value, bins_per_unit;
  uint32_t step;
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

// The bins of [lo, hi) (kBins of them, edge[b] <= key < edge[b + 1]).
__device__ void spread(Shared& sh, int32_t lo, int32_t hi) {
  const uint32_t span = static_cast<uint32_t>(static_cast<int64_t>(hi) - lo);
  const float lo_v = key_value(lo), hi_v = key_value(hi);
  const float limit = 18446744073709551616.0f;  // 2^64: no overflow of hi_v - lo_v
  const bool by_value = span > (1u << 24) && fabsf(lo_v) < limit && fabsf(hi_v) < limit;
  const float width = (hi_v - lo_v) / kBins;
  const uint32_t step = span / kBins + (span % kBins != 0);
  for (int b = threadIdx.x; b <= kBins; b += kThreads) {
    int32_t e;
    if (b == 0) {
      e = lo;
    } else if (b == kBins) {
      e = hi;
    } else if (by_value) {
      e = min(max(float_key(lo_v + width * b), lo), hi);
    } else {
      e = static_cast<int32_t>(lo + static_cast<int64_t>(min(static_cast<ull>(b) * step, static_cast<ull>(span))));
    }
    sh.edge[b] = e;
  }
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    sh.count[b] = 0;
    sh.mass_lo[b] = 0;
    sh.mass_hi[b] = 0;
  }
  if (threadIdx.x == 0) {
    sh.by_value = by_value;
    sh.lo_value = lo_v;
    sh.bins_per_unit = kBins / (hi_v - lo_v);
    sh.step = step;
  }
  __syncthreads();
}

__device__ __forceinline__ int bin_of(const Shared& sh, int32_t key, float value, int32_t lo) {
  int b;
  if (sh.by_value) {
    const float guess = (value - sh.lo_value) * sh.bins_per_unit;
    b = guess < 0.0f ? 0 : guess >= kBins - 1 ? kBins - 1 : static_cast<int>(guess);
    while (b > 0 && key < sh.edge[b]) --b;
    while (b < kBins - 1 && key >= sh.edge[b + 1]) ++b;
  } else {
    b = static_cast<int>((static_cast<uint32_t>(key) - static_cast<uint32_t>(lo)) / sh.step);
  }
  return b;
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
  spread(sh, lo, hi);
  Sums above, below;
  for_each(row, [&](float value) {
    const int32_t key = float_key(value);
    if (key < filter) return;
    const ull e = with_mass ? fixed_mass(value, row.m) : 0;
    if (key >= hi) {
      above.count += 1;
      above.mass += e;
    } else if (key < lo) {
      below.count += 1;
      below.mass += e;
    } else {
      const int b = bin_of(sh, key, value, lo);
      atomicAdd(&sh.count[b], 1u);
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
  h.above.count = all_sum(sh, above.count);
  h.above.mass = all_sum(sh, above.mass);
  h.below.count = all_sum(sh, below.count);
  h.below.mass = all_sum(sh, below.mass);
  return h;
}

// Where F (count or mass) of the values >= each bin's lower edge crosses the target.
struct Crossing {
  int bin = -1;       // -1: F(>= lo) < target
  Sums above_bin;     // over the values >= edge[bin + 1]
  Sums at_or_above;   // over the values >= edge[bin]
  Sums inside;        // over [lo, hi)
};

__device__ Crossing crossing(Shared& sh, const Histogram& h, Kind kind, ull target) {
  // thread t holds bins kBins - 1 - (t * kBinsPerThread + j): from the top down
  ull cnt[kBinsPerThread], mas[kBinsPerThread];
  ull cnt_sum = 0, mas_sum = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    const int b = kBins - 1 - (threadIdx.x * kBinsPerThread + j);
    cnt[j] = sh.count[b];
    mas[j] = (static_cast<ull>(sh.mass_hi[b]) << 32) | sh.mass_lo[b];
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
  const int len = sh.list_len;
  int n = 2;
  while (n < len) n <<= 1;
  for (int i = len + threadIdx.x; i < n; i += kThreads) sh.list[i] = kKeyNone;
  __syncthreads();
  for (int k = 2; k <= n; k <<= 1) {  // bitonic sort, decreasing
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += kThreads) {
        const int partner = i ^ j;
        if (partner > i) {
          const int32_t x = sh.list[i], y = sh.list[partner];
          const bool decreasing = (i & k) == 0;
          if (decreasing ? x < y : x > y) {
            sh.list[i] = y;
            sh.list[partner] = x;
          }
        }
      }
      __syncthreads();
    }
  }
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
      c = crossing(sh, h, kind, ~0ull);
      const ull total = h.above.mass + c.inside.mass + h.below.mass;
      target = static_cast<ull>(ceil(static_cast<double>(top_p) * static_cast<double>(total)));
      if (target == 0) return Stage{filter};
    }
    first = false;
    c = crossing(sh, h, kind, target);
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
    const int32_t bin_lo = sh.edge[c.bin], bin_hi = sh.edge[c.bin + 1];
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
