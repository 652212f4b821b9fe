// `jaxrl_kernels_kept_set` (jaxrl_kernels/backends/ffi/kept_set.py): each row's kept set under a
// sampler's truncation (kept_set.h, kept_set_kernel.cuh). Operands: u f32 [R, V], m f32 [R],
// active pred [R]. Results: floor, s, a f32 [R] and passes s32 [R]. Attributes: top_k (0: none),
// top_p (1: none), has_min_p and log_min_p (float32(log(min_p))).
#include <cstdint>
#include <string>

#include "ffi_common.h"
#include "kept_set.h"

namespace jaxrl_ffi {
namespace {

ffi::Error KeptSetImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> m,
                       ffi::Buffer<ffi::PRED> active, ffi::ResultBuffer<ffi::F32> floor, ffi::ResultBuffer<ffi::F32> s,
                       ffi::ResultBuffer<ffi::F32> a, ffi::ResultBuffer<ffi::S32> passes, int64_t top_k, float top_p,
                       bool has_min_p, float log_min_p) {
  auto dims = u.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("u must be [R, V], got " + dims_str(dims));
  const int64_t rows = dims[0], vocab = dims[1];
  if (!all_rows(rows, {m.element_count(), active.element_count(), floor->element_count(), s->element_count(),
                       a->element_count(), passes->element_count()}))
    return ffi::Error::InvalidArgument("m, active and the results must all be [R], R = " + std::to_string(rows));
  if (rows > jaxrl_kept::kMaxRows || vocab > jaxrl_kept::kMaxVocab)
    return ffi::Error::InvalidArgument("u " + dims_str(dims) + ": at most 2^31 rows of at most 2^23 columns");
  if (top_k < 0) return ffi::Error::InvalidArgument("top_k must be >= 0 (0: none)");
  if (!(top_p > 0.0f && top_p <= 1.0f)) return ffi::Error::InvalidArgument("top_p must be in (0, 1]");
  jaxrl_kept::KeptSetArgs args;
  args.u = u.typed_data();
  args.m = m.typed_data();
  args.active = active.typed_data();
  args.floor = floor->typed_data();
  args.s = s->typed_data();
  args.a = a->typed_data();
  args.passes = passes->typed_data();
  args.rows = rows;
  args.vocab = vocab;
  args.top_k = top_k;
  args.top_p = top_p;
  args.has_min_p = has_min_p;
  args.log_min_p = log_min_p;
  return launched(jaxrl_kept::launch_kept_set(args, stream));
}

}  // namespace
}  // namespace jaxrl_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsKeptSet, jaxrl_ffi::KeptSetImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("top_k")
                                  .Attr<float>("top_p")
                                  .Attr<bool>("has_min_p")
                                  .Attr<float>("log_min_p"));
