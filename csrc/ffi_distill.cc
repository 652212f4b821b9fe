// The distillation handlers (jaxrl_kernels/backends/ffi/distill.py), both on launch_distill
// (sm90_distill_kernel.cuh, DistillArgs in sm90_launch.h):
//
// `jaxrl_kernels_sm90_distill_stats`: operands hidden_s [N, D_s], weight_s [V, D_s],
// hidden_t [N, D_t], weight_t [V, D_t] (one 16-bit dtype, "vd"), lse_s, lse_t (f32 [N]; [0]
// for the pair statistics). Result: partials f32 [splits, K, N], K = 7 (pair statistics) or
// 2 (the JSD's sums). Attributes: jsd_sums (which of the two), beta, temperature, splits
// (the plan's, from _sm90.distill_plan: the result's shape depends on it).
//
// `jaxrl_kernels_sm90_distill_grad`: the four head operands, lse_s, lse_t, row_value, coef
// (f32 [N]) and start (s32 [1], a multiple of 128). Result: G f16 [N, size]. Attributes:
// mode (2 reverse KL, 3 forward KL, 4 JSD: DistillMode), beta, temperature.
#include <cstdint>
#include <string>

#include "ffi_common.h"

namespace jaxrl_ffi {
namespace {

using jaxrl_sm90::DistillArgs;
using jaxrl_sm90::DistillMode;

// The two heads' operands checked (check_head_shapes for each) and copied into `args`.
ffi::Error heads_of(ffi::AnyBuffer& hs, ffi::AnyBuffer& ws, ffi::AnyBuffer& ht, ffi::AnyBuffer& wt, float temperature,
                    DistillArgs& args) {
  Head student, teacher;
  ffi::Error checked = check_head_shapes(hs, ws, false, temperature, student);
  if (checked.failure()) return checked;
  checked = check_head_shapes(ht, wt, false, temperature, teacher);
  if (checked.failure()) return checked;
  if (teacher.n != student.n || teacher.v != student.v || teacher.dtype != student.dtype)
    return ffi::Error::InvalidArgument("the teacher's N, V and dtype must be the student's");
  args.hidden_s = hs.untyped_data();
  args.weight_s = ws.untyped_data();
  args.hidden_t = ht.untyped_data();
  args.weight_t = wt.untyped_data();
  args.n = static_cast<int>(student.n);
  args.v = static_cast<int>(student.v);
  args.d_s = static_cast<int>(student.d);
  args.d_t = static_cast<int>(teacher.d);
  args.dtype = student.dtype;
  args.temperature = temperature;
  return ffi::Error::Success();
}

ffi::Error DistillStatsImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer hs, ffi::AnyBuffer ws,
                            ffi::AnyBuffer ht, ffi::AnyBuffer wt, ffi::Buffer<ffi::F32> lse_s,
                            ffi::Buffer<ffi::F32> lse_t, ffi::ResultBuffer<ffi::F32> partials, bool jsd_sums,
                            float beta, float temperature, int32_t splits) {
  DistillArgs args;
  ffi::Error checked = heads_of(hs, ws, ht, wt, temperature, args);
  if (checked.failure()) return checked;
  if (jsd_sums && !all_rows(args.n, {lse_s.element_count(), lse_t.element_count()}))
    return ffi::Error::InvalidArgument("lse_s and lse_t must be [N]");
  if (splits <= 0) return ffi::Error::InvalidArgument("splits must be the plan's (> 0)");
  int sms = 0;
  checked = read_sm_count(device, sms);
  if (checked.failure()) return checked;
  const jaxrl_sm90::Plan plan = jaxrl_sm90::choose_distill_plan(args.n, args.v, sms, splits);
  const int k = jsd_sums ? 2 : jaxrl_sm90::kPairStatsK;
  if (plan.splits != splits || static_cast<int64_t>(partials->element_count()) != int64_t{splits} * k * args.n)
    return ffi::Error::InvalidArgument("partials must be [splits, " + std::to_string(k) +
                                       ", N] for the plan's splits (" + std::to_string(plan.splits) + ")");
  if (args.n == 0) return ffi::Error::Success();
  args.beta = beta;
  args.lse_s = lse_s.typed_data();
  args.lse_t = lse_t.typed_data();
  args.partials = partials->typed_data();
  const DistillMode mode = jsd_sums ? DistillMode::kJsdSums : DistillMode::kPairStats;
  return launched(jaxrl_sm90::launch_distill(args, mode, plan, stream));
}

ffi::Error DistillGradImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer hs, ffi::AnyBuffer ws, ffi::AnyBuffer ht,
                           ffi::AnyBuffer wt, ffi::Buffer<ffi::F32> lse_s, ffi::Buffer<ffi::F32> lse_t,
                           ffi::Buffer<ffi::F32> row_value, ffi::Buffer<ffi::F32> coef, ffi::Buffer<ffi::S32> start,
                           ffi::ResultBuffer<ffi::F16> out, int32_t mode, float beta, float temperature) {
  DistillArgs args;
  ffi::Error checked = heads_of(hs, ws, ht, wt, temperature, args);
  if (checked.failure()) return checked;
  if (!all_rows(args.n,
                {lse_s.element_count(), lse_t.element_count(), row_value.element_count(), coef.element_count()}))
    return ffi::Error::InvalidArgument("lse_s, lse_t, row_value and coef must all be [N]");
  if (start.element_count() != 1) return ffi::Error::InvalidArgument("start must hold one element");
  auto od = out->dimensions();
  if (od.size() != 2 || od[0] != args.n || od[1] > args.v)
    return ffi::Error::InvalidArgument("the result must be [N, size] with size <= V, got " + dims_str(od));
  if (mode < static_cast<int>(DistillMode::kGradReverseKl) || mode > static_cast<int>(DistillMode::kGradJsd))
    return ffi::Error::InvalidArgument("mode must be 2 (reverse KL), 3 (forward KL) or 4 (JSD)");
  int sms = 0;
  checked = read_sm_count(device, sms);
  if (checked.failure()) return checked;
  args.beta = beta;
  args.lse_s = lse_s.typed_data();
  args.lse_t = lse_t.typed_data();
  args.row_value = row_value.typed_data();
  args.coef = coef.typed_data();
  args.start_ptr = start.typed_data();
  args.size = static_cast<int>(od[1]);
  args.out = out->untyped_data();
  const jaxrl_sm90::Plan plan = jaxrl_sm90::choose_distill_grad_plan(args.n, args.size, sms);
  return launched(jaxrl_sm90::launch_distill(args, static_cast<DistillMode>(mode), plan, stream));
}

auto heads_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

}  // namespace
}  // namespace jaxrl_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90DistillStats, jaxrl_ffi::DistillStatsImpl,
                              jaxrl_ffi::heads_binding()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("jsd_sums")
                                  .Attr<float>("beta")
                                  .Attr<float>("temperature")
                                  .Attr<int32_t>("splits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlKernelsSm90DistillGrad, jaxrl_ffi::DistillGradImpl,
                              jaxrl_ffi::heads_binding()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F16>>()
                                  .Attr<int32_t>("mode")
                                  .Attr<float>("beta")
                                  .Attr<float>("temperature"));
