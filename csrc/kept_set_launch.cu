// Host side of the kept-set kernel (kept_set.h): the launch's checks, then the kernel
// (kept_set_kernel.cuh) with its default load batch.
#include <string>

#include "kept_set.h"
#include "kept_set_kernel.cuh"

namespace jaxrl_kept {

std::string launch_kept_set(const KeptSetArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return "";
  if (args.rows > kMaxRows || args.vocab > kMaxVocab) return "kept_set: too many rows or columns";
  return launch_kept_set_kernel<kDefaultLoadBatch>(args, stream);
}

}  // namespace jaxrl_kept
