// The kept-set kernel (csrc/kept_set_kernel.cuh) alone on float32 rows u [N, V] ~ N(0, sigma^2)
// (sigma = 4: the logits of benchmarks/studies/bench_kept_set.py; a small sigma makes flat rows whose
// nucleus spans thousands of values), built with JAXRL_KEPT_SET_LOAD_BATCH float4 loads a thread
// issues before it uses any (the kernel's template parameter; the package's build takes
// kDefaultLoadBatch): does batching the loads bring a pass nearer the copy bandwidth?
// Times by CUDA events (2 warm-up launches, the median of 10), the device's copy of the same
// bytes alongside; with a row block R > 0, the rows go in launches of R rows (as a lean head's
// forward makes them). `floor-sum`, `s-sum` (the sums of the rows' floors and kept masses) and
// the passes must not change with the build.
//
//   for b in 1 2 4; do
//     nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//       -DJAXRL_KEPT_SET_LOAD_BATCH=$b -Icsrc benchmarks/studies/variants/kept_set_load_batch.cu \
//       -o /tmp/kept_set_b$b && /tmp/kept_set_b$b 4096 131072 [row block] [sigma]
//   done
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "kept_set_kernel.cuh"

#ifndef JAXRL_KEPT_SET_LOAD_BATCH
#define JAXRL_KEPT_SET_LOAD_BATCH jaxrl_kept::kDefaultLoadBatch
#endif

namespace {

// u = sigma z, z ~ N(0, 1) by Box-Muller on a hash of the index.
__global__ void fill_normal(float* u, long long total, unsigned long long seed, float sigma) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    unsigned long long x = static_cast<unsigned long long>(i) * 0x9E3779B97F4A7C15ull + seed;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    const float a = ((x & 0xffffff) + 0.5f) / 16777216.f, b = (((x >> 24) & 0xffffff) + 0.5f) / 16777216.f;
    u[i] = sigma * sqrtf(-2.f * logf(a)) * cospif(2.f * b);
  }
}

__global__ void row_max(const float* u, long long v, float* m) {
  __shared__ float part[256];
  float mx = -INFINITY;
  for (long long i = threadIdx.x; i < v; i += blockDim.x) mx = fmaxf(mx, u[blockIdx.x * v + i]);
  part[threadIdx.x] = mx;
  __syncthreads();
  for (int k = 128; k > 0; k >>= 1) {
    if (threadIdx.x < k) part[threadIdx.x] = fmaxf(part[threadIdx.x], part[threadIdx.x + k]);
    __syncthreads();
  }
  if (threadIdx.x == 0) m[blockIdx.x] = part[0];
}

template <class F>
float median_ms(F&& launch, int warmup, int runs) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> times;
  for (int r = 0; r < warmup + runs; ++r) {
    cudaEventRecord(e0);
    launch();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t = 0.f;
    cudaEventElapsedTime(&t, e0, e1);
    if (r >= warmup) times.push_back(t);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const long long n = argc > 2 ? atoll(argv[1]) : 4096, v = argc > 2 ? atoll(argv[2]) : 131072;
  const long long block = argc > 3 && atoll(argv[3]) > 0 ? atoll(argv[3]) : n;
  const float sigma = argc > 4 ? static_cast<float>(atof(argv[4])) : 4.f;
  float *u, *m, *floor_, *s, *a, *copy;
  bool* active;
  int* passes;
  cudaMalloc(&u, n * v * 4);
  cudaMalloc(&copy, n * v * 4);
  cudaMalloc(&m, n * 4);
  cudaMalloc(&floor_, n * 4);
  cudaMalloc(&s, n * 4);
  cudaMalloc(&a, n * 4);
  cudaMalloc(&active, n);
  cudaMalloc(&passes, n * 4);
  cudaMemset(active, 1, n);
  fill_normal<<<1024, 256>>>(u, n * v, 7, sigma);
  row_max<<<static_cast<unsigned>(n), 256>>>(u, v, m);
  const float copy_ms = median_ms([&] { cudaMemcpyAsync(copy, u, n * v * 4, cudaMemcpyDeviceToDevice); }, 2, 10);
  printf("load batch %d, N=%lld V=%lld, row block %lld, sigma %g: copy %.3f ms (%.0f GB/s read + write)\n",
         JAXRL_KEPT_SET_LOAD_BATCH, n, v, block, sigma, copy_ms, 2.0 * n * v * 4 / copy_ms / 1e6);
  struct Case {
    const char* name;
    long long top_k;
    float top_p;
    bool min_p;
  };
  const Case cases[] = {{"top-k 50", 50, 1.f, false}, {"top-p 0.95", 0, 0.95f, false},
                        {"top-k 50, top-p 0.95", 50, 0.95f, false}, {"min-p 0.05", 0, 1.f, true}};
  for (const Case& c : cases) {
    jaxrl_kept::KeptSetArgs args;
    args.vocab = v;
    args.top_k = c.top_k;
    args.top_p = c.top_p;
    args.has_min_p = c.min_p;
    args.log_min_p = logf(0.05f);
    std::string why;
    const float ms = median_ms([&] {
      for (long long r0 = 0; r0 < n; r0 += block) {
        args.u = u + r0 * v;
        args.m = m + r0;
        args.active = active + r0;
        args.floor = floor_ + r0;
        args.s = s + r0;
        args.a = a + r0;
        args.passes = passes + r0;
        args.rows = std::min(block, n - r0);
        const std::string err = jaxrl_kept::launch_kept_set_kernel<JAXRL_KEPT_SET_LOAD_BATCH>(args, 0);
        if (why.empty()) why = err;
      }
    }, 2, 10);
    if (!why.empty()) {
      printf("%s: %s\n", c.name, why.c_str());
      return 1;
    }
    std::vector<int> p(n);
    std::vector<float> f(n), kept_s(n);
    cudaMemcpy(p.data(), passes, n * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(f.data(), floor_, n * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(kept_s.data(), s, n * 4, cudaMemcpyDeviceToHost);
    double mean_passes = 0.0, floor_sum = 0.0, s_sum = 0.0;
    for (long long r = 0; r < n; ++r) {
      mean_passes += p[r];
      floor_sum += f[r];
      s_sum += kept_s[r];
    }
    mean_passes /= n;
    printf("  %-22s %.3f ms  passes %.2f  %.0f GB/s a pass  floor-sum %.6f  s-sum %.6f  %s\n", c.name, ms,
           mean_passes, mean_passes * n * v * 4 / ms / 1e6, floor_sum, s_sum, cudaGetErrorString(cudaGetLastError()));
  }
  return 0;
}
