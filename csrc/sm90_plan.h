// The work decomposition shared by the host planner and the kernel.
#pragma once

#ifdef __CUDACC__
#define JAXRL_HD __host__ __device__
#else
#define JAXRL_HD
#endif

namespace jaxrl_sm90 {

// A unit is one row block (128 rows) times one contiguous range of vocabulary
// tiles [vt_begin, vt_end) (256 columns each). Units are numbered in the order
// (row group, split, row block within the group): the CTAs running at one time
// then share few vocabulary ranges (weight tiles are reused from L2) and few row
// blocks (hidden tiles stay in L2). CTA b computes units b, b + grid, ...
struct Unit {
  int row_block, split, vt_begin, vt_end;
};

JAXRL_HD inline int imin(int a, int b) { return a < b ? a : b; }

JAXRL_HD inline Unit decode_unit(int u, int row_blocks, int splits, int group_rows, int vocab_tiles) {
  int per_group = group_rows * splits;
  int g = u / per_group;
  int r = u - g * per_group;
  int rows_here = imin(group_rows, row_blocks - g * group_rows);
  int s = r / rows_here;
  int p = g * group_rows + (r - s * rows_here);
  int base = vocab_tiles / splits, rem = vocab_tiles % splits;
  int begin = s * base + imin(s, rem);
  int count = base + (s < rem ? 1 : 0);
  return {p, s, begin, begin + count};
}

}  // namespace jaxrl_sm90
