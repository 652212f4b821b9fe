// The kept-set kernel (kept_set.h; launched by kept_set_launch.cu): one CTA per row, the row read
// from global memory once per pass.
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
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "kept_set.h"
#include "kept_set_common.cuh"

namespace jaxrl_kept {

// float4 loads a thread issues before it uses any (for_each): a pass is bound by the loads in
// flight (docs/performance.md, "Kernel constants"). The kernel's template parameter, so that a
// build may measure others (benchmarks/studies/variants/kept_set_load_batch.cu).
constexpr int kDefaultLoadBatch = 4;
constexpr int kMaxRefinements = 12;  // more than a 32-bit interval needs (each cuts >= 2048-fold)
// The first interval of a stage, [m - range, m]: most values lie below it and cost no
// atomic; a threshold below it (a row hundreds wide) takes one pass more.
constexpr float kCountRange = 10.0f;  // top-k
constexpr float kMassRange = 14.0f;   // top-p

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
template <int kLoadBatch>
__device__ Histogram histogram(Shared& sh, const Row& row, int32_t filter, int32_t lo, int32_t hi, bool with_mass) {
  const bool counted = !with_mass || fixed_mass(key_value(lo), row.m) < kBoundedCountUnit;
  spread(sh, lo, hi, counted);
  // in registers: the atomics below would make the compiler reread it
  const Bins bins = sh.bins;
  unsigned int above_count = 0, below_count = 0;  // V < 2^32
  ull above_mass = 0, below_mass = 0;
  for_each<kLoadBatch>(row, [&](float value) {
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
  int bin = -1;      // -1: F(>= lo) < target
  Sums above_bin;    // over the values >= edge(bin + 1)
  Sums at_or_above;  // over the values >= edge(bin)
  Sums inside;       // over [lo, hi)
};

__device__ inline Crossing crossing(Shared& sh, const Row& row, const Histogram& h, Kind kind, ull target) {
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

// The filtered values with keys in [lo, hi) into sh.list, sorted in decreasing order
// (sh.list_len of them, at most kListCap); returns the largest key below lo of any value.
template <int kLoadBatch>
__device__ int32_t gather(Shared& sh, const Row& row, int32_t filter, int32_t lo, int32_t hi) {
  if (threadIdx.x == 0) sh.list_len = 0;
  __syncthreads();
  int32_t below = kKeyNone;
  for_each<kLoadBatch>(row, [&](float value) {
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
__device__ inline int first_reaching(Shared& sh, const Row& row, int len, Kind kind, Sums base, ull target) {
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
__device__ inline int last_index_of(Shared& sh, int len, int32_t key) {
  int last = -1;
  for (int i = threadIdx.x; i < len; i += kThreads)
    if (sh.list[i] == key) last = max(last, i);
  return all_max(sh, last);
}

// The list's mass over its first `count` entries.
__device__ inline ull list_mass(Shared& sh, const Row& row, int count) {
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
template <int kLoadBatch>
__device__ Stage search(Shared& sh, const Row& row, int32_t filter, Kind kind, ull k, float top_p, int& passes) {
  const float range = kind == kCount ? kCountRange : kMassRange;
  int32_t hi = isfinite(row.m) ? float_key(row.m) + 1 : kKeyTop;
  int32_t lo = isfinite(row.m) ? max(filter, float_key(row.m - range)) : filter;
  if (lo >= hi) lo = filter;
  if (lo >= hi) hi = kKeyTop;
  ull target = k;
  bool first = true;
  for (int round = 0; round < kMaxRefinements; ++round) {
    const Histogram h = histogram<kLoadBatch>(sh, row, filter, lo, hi, kind == kMass);
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
      const int32_t gap = gather<kLoadBatch>(sh, row, filter, bin_lo, all_above ? kKeyTop : bin_hi);
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

template <int kLoadBatch>
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
    const float top = row_max<kLoadBatch>(sh, row);
    ++passes;
    filter = max(filter, float_key(top + args.log_min_p));
  }
  Stage stage{filter};
  if (args.top_k > 0) stage = search<kLoadBatch>(sh, row, filter, kCount, static_cast<ull>(args.top_k), 1.0f, passes);
  if (args.top_p < 1.0f) {
    if (stage.listed) {  // the list holds every value >= tau: top-p within it
      const int len = last_index_of(sh, sh.list_len, stage.tau) + 1;
      const ull z = list_mass(sh, row, len);
      const ull target = static_cast<ull>(ceil(static_cast<double>(args.top_p) * static_cast<double>(z)));
      const int at = first_reaching(sh, row, len, kMass, Sums{}, target);
      stage.tau = sh.list[at];
      __syncthreads();
    } else {
      stage = search<kLoadBatch>(sh, row, stage.tau, kMass, 0, args.top_p, passes);
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
    for_each<kLoadBatch>(row, [&](float value) {
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

// Enqueues kept_set_kernel<kLoadBatch>, one CTA per row of `args` (launch_kept_set checks them
// first); an empty string on success, else why not.
template <int kLoadBatch>
std::string launch_kept_set_kernel(const KeptSetArgs& args, cudaStream_t stream) {
  const size_t smem = sizeof(Shared);
  cudaError_t err = cudaFuncSetAttribute(kept_set_kernel<kLoadBatch>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return std::string("kept_set: ") + cudaGetErrorString(err);
  kept_set_kernel<kLoadBatch><<<static_cast<unsigned int>(args.rows), kThreads, smem, stream>>>(args);
  err = cudaGetLastError();
  return err == cudaSuccess ? "" : std::string("kept_set: ") + cudaGetErrorString(err);
}

}  // namespace jaxrl_kept
