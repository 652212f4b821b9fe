// Python module `jaxrl_kernels._sm90`: hands the XLA FFI handlers to Python as PyCapsules
// (jaxrl_kernels/backends/ffi/extension.py registers each with jax.ffi.register_ffi_target) and
// exposes the host-side planners for tests and benchmarks. `registrations()` holds:
//   jaxrl_kernels_sm90_linear_logprobs           the forward op          (ffi_forward.cc)
//   jaxrl_kernels_sm90_linear_kept_logits        the same, the logits kept (memory="fast")
//   jaxrl_kernels_sm90_linear_logprobs_backward  the backward op         (ffi_backward.cc)
//   jaxrl_kernels_uninitialized                  an unwritten buffer     (ffi_uninitialized.cc)
//   jaxrl_kernels_sm90_distill_stats             distillation: row statistics  (ffi_distill.cc)
//   jaxrl_kernels_sm90_distill_grad              distillation: the student's logit gradient
//   jaxrl_kernels_kept_set                       a sampler's kept set per row (ffi_kept_set.cc)
//   jaxrl_kernels_sm90_kept_grad_gemms           memory="fast": the backward's two GEMMs
//                                                from the kept gradient (ffi_kept_gemms.cc)
// and, built with JAXRL_KERNELS_MEASUREMENT_HANDLERS=ON (`measurement_handlers` true), the
// handlers for measurement only (ffi_variants.cc):
//   jaxrl_kernels_sm90_linear_logprobs_grad      the grad kernel alone
#include <pybind11/pybind11.h>

#include "sm90_head_gemm.h"
#include "sm90_launch.h"
#include "sm90_plan.h"
#include "xla/ffi/api/c_api.h"

namespace py = pybind11;

extern "C" XLA_FFI_Error* JaxrlKernelsSm90LinearLogprobs(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxrlKernelsSm90LinearKeptLogits(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxrlKernelsSm90LinearKeptExp(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxrlKernelsSm90LinearBackward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxrlKernelsUninitialized(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxrlKernelsSm90DistillStats(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxrlKernelsSm90DistillGrad(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxrlKernelsKeptSet(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxrlKernelsSm90KeptGradGemms(XLA_FFI_CallFrame* call_frame);
#ifdef JAXRL_KERNELS_MEASUREMENT_HANDLERS
extern "C" XLA_FFI_Error* JaxrlKernelsSm90LinearGrad(XLA_FFI_CallFrame* call_frame);
#endif

namespace {

#ifdef JAXRL_KERNELS_MEASUREMENT_HANDLERS
constexpr bool kMeasurementHandlers = true;
#else
constexpr bool kMeasurementHandlers = false;
#endif

py::capsule capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return py::capsule(reinterpret_cast<void*>(handler));
}

py::dict registrations() {
  py::dict out;
  out["jaxrl_kernels_sm90_linear_logprobs"] = capsule(&JaxrlKernelsSm90LinearLogprobs);
  out["jaxrl_kernels_sm90_linear_kept_logits"] = capsule(&JaxrlKernelsSm90LinearKeptLogits);
  out["jaxrl_kernels_sm90_linear_kept_exp"] = capsule(&JaxrlKernelsSm90LinearKeptExp);
  out["jaxrl_kernels_sm90_linear_logprobs_backward"] = capsule(&JaxrlKernelsSm90LinearBackward);
  out["jaxrl_kernels_uninitialized"] = capsule(&JaxrlKernelsUninitialized);
  out["jaxrl_kernels_sm90_distill_stats"] = capsule(&JaxrlKernelsSm90DistillStats);
  out["jaxrl_kernels_sm90_distill_grad"] = capsule(&JaxrlKernelsSm90DistillGrad);
  out["jaxrl_kernels_kept_set"] = capsule(&JaxrlKernelsKeptSet);
  out["jaxrl_kernels_sm90_kept_grad_gemms"] = capsule(&JaxrlKernelsSm90KeptGradGemms);
#ifdef JAXRL_KERNELS_MEASUREMENT_HANDLERS
  out["jaxrl_kernels_sm90_linear_logprobs_grad"] = capsule(&JaxrlKernelsSm90LinearGrad);
#endif
  return out;
}

py::dict plan_dict(const jaxrl_sm90::Plan& p) {
  py::dict out;
  out["row_blocks"] = p.row_blocks;
  out["vocab_tiles"] = p.vocab_tiles;
  out["splits"] = p.splits;
  out["group_rows"] = p.group_rows;
  out["grid"] = p.grid;
  out["makespan"] = p.makespan;
  return out;
}

py::dict plan(int n, int v, int num_sms, int force_splits) {
  const jaxrl_sm90::Plan p = jaxrl_sm90::choose_plan(n, v, num_sms, force_splits);
  py::dict out = plan_dict(p);
  out["partials_bytes"] = jaxrl_sm90::partials_bytes(p, n);
  return out;
}

py::dict distill_plan(int n, int v, int num_sms) { return plan_dict(jaxrl_sm90::choose_distill_plan(n, v, num_sms)); }

py::dict grad_plan(int n, int size, int num_sms) {
  const jaxrl_sm90::Plan p = jaxrl_sm90::choose_grad_plan(n, size, num_sms);
  py::dict out = plan_dict(p);
  out["weight_copy"] = jaxrl_sm90::choose_weight_copy(p) == jaxrl_sm90::WeightCopy::kApart ? "apart" : "in_kernel";
  return out;
}

// The 16-bit operand type a Python caller names by `bf16`.
jaxrl_sm90::DType operand_dtype(bool bf16) { return bf16 ? jaxrl_sm90::DType::kBF16 : jaxrl_sm90::DType::kF16; }

// The backward call's `hidden_tiles` attribute as the enum, checked.
jaxrl_sm90::HiddenTiles hidden_tiles_arg(int hidden_tiles) {
  if (hidden_tiles < 0 || hidden_tiles > 2) throw py::value_error("hidden_tiles must be 0, 1 or 2");
  return static_cast<jaxrl_sm90::HiddenTiles>(hidden_tiles);
}

size_t backward_workspace_bytes(int n, int v, int d, int chunk, bool weight_dv, bool bf16, bool split_k,
                                int hidden_tiles) {
  return jaxrl_sm90::backward_workspace_bytes(n, v, d, chunk, weight_dv, operand_dtype(bf16), split_k,
                                              hidden_tiles_arg(hidden_tiles));
}

size_t kept_gemms_workspace_bytes(int s, int v, int d, bool weight_dv, bool bf16) {
  return jaxrl_sm90::kept_gemms_workspace_bytes(s, v, d, weight_dv, operand_dtype(bf16));
}

py::dict hidden_plan(int n, int d, int k, bool bf16, bool split_k, int hidden_tiles) {
  const jaxrl_sm90::HiddenPlan p =
      jaxrl_sm90::hidden_plan(operand_dtype(bf16), n, d, k, split_k, hidden_tiles_arg(hidden_tiles));
  py::dict out;
  out["splits"] = p.splits;
  out["narrow"] = p.narrow;
  return out;
}

py::tuple decode_unit(int u, int row_blocks, int splits, int group_rows, int vocab_tiles) {
  const jaxrl_sm90::Unit w = jaxrl_sm90::decode_unit(u, row_blocks, splits, group_rows, vocab_tiles);
  return py::make_tuple(w.row_block, w.split, w.vt_begin, w.vt_end);
}

}  // namespace

PYBIND11_MODULE(_sm90, m) {
  m.doc() =
      "SM90 (Hopper) fused linear log-prob kernels as XLA FFI custom calls: the forward, the backward "
      "(logit gradient and CUTLASS GEMMs per vocabulary chunk), the distillation kernels, the sampler's "
      "kept set, an unwritten buffer, and where built with them (measurement_handlers) the "
      "logit-gradient kernel alone for measurement.";
  m.def("registrations", &registrations, "FFI target name -> handler capsule.");
  m.def("build_info", &jaxrl_sm90::build_info, "How the extension was built.");
  m.def("plan", &plan, py::arg("n"), py::arg("v"), py::arg("num_sms"), py::arg("force_splits") = 0,
        "The persistent-grid plan the forward handler uses for N rows and V columns (force_splits: "
        "the call's `splits` attribute, 0 automatic).");
  m.def("distill_plan", &distill_plan, py::arg("n"), py::arg("v"), py::arg("num_sms"),
        "The distillation statistics' plan for N rows and V columns (tiles of 128): its `splits` is "
        "the stats call's attribute and the partials' first dimension.");
  m.def("grad_plan", &grad_plan, py::arg("n"), py::arg("size"), py::arg("num_sms"),
        "The backward stage's plan for N rows and a chunk of `size` columns: one tile a unit; "
        "`weight_copy`: who writes the chunk's float16 weight copy under the automatic choice.");
  m.def("backward_workspace_bytes", &backward_workspace_bytes, py::arg("n"), py::arg("v"), py::arg("d"),
        py::arg("chunk"), py::arg("weight_dv"), py::arg("bf16"), py::arg("split_k") = true, py::arg("hidden_tiles") = 0,
        "Bytes of the backward custom call's workspace result.");
  m.def("kept_gemms_workspace_bytes", &kept_gemms_workspace_bytes, py::arg("s"), py::arg("v"), py::arg("d"),
        py::arg("weight_dv"), py::arg("bf16"), "Bytes of the kept-gradient GEMMs' workspace result (S rows).");
  m.def("hidden_plan", &hidden_plan, py::arg("n"), py::arg("d"), py::arg("k"), py::arg("bf16"),
        py::arg("split_k") = true, py::arg("hidden_tiles") = 0,
        "How d_hidden's GEMM acc[n, d] = G[n, :k] . W16 covers its output: K's parts (`splits`) and "
        "whether its unsplit tiles are 128 wide (`narrow`).");
  m.def("decode_unit", &decode_unit, "unit index -> (row_block, split, vt_begin, vt_end), as the kernel decodes it.");
  // Whether registrations() holds the measurement-only handlers (JAXRL_KERNELS_MEASUREMENT_HANDLERS).
  m.attr("measurement_handlers") = kMeasurementHandlers;
  m.attr("TILE_ROWS") = jaxrl_sm90::kBlockM;
  m.attr("TILE_COLS") = jaxrl_sm90::kBlockN;
  m.attr("DISTILL_TILE_COLS") = jaxrl_sm90::kDistillBlockN;
  m.attr("PAIR_STATS_K") = jaxrl_sm90::kPairStatsK;
}
