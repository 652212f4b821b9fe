"""One-question studies: measurements that answered one question once, kept runnable so that
every figure the documents quote from them can be measured again
(``python -m benchmarks.studies.NAME``; benchmarks/README.md, "Studies").

* ``bench_lean_chunks``: where lean's time goes at small N, by kernel kind; wider backward
  chunks and the weight copy's placement.
* ``bench_fast_loss``: the fused loss's logits' gradient in one pass against a loop over
  blocks of rows (``--one-pass``); one tree against another (``--tag``).
* ``bench_fast_mode``: the settings of ``memory="fast"`` side by side (``variants/fast_mode.py``).
* ``bench_sampler_forward``: where a lean sampler-matched call's time goes (the statistics
  pass, the kept-set kernel's block of rows, by kernel); ``--peak`` one call's device peak.
* ``bench_kept_set``: the kept set alone, by the ffi kernel and by the jnp passes.
* ``profile_distill``: which kernels take ``linear_distill_loss``'s device time.
* ``bench_ffi``: the first SM90 forward against one GEMM, the materialised path and Pallas.
* ``linear_kernels``: the linear head's kernel-level studies: the SM90 kernels alone
  (``--kernels``), clocks and power at the power limit (``--clocks``), the one-call backward
  against a loop of XLA GEMMs (``--fused``), backward variants (``--backward``), Pallas launch
  plans (``--sweep``), ncu targets (``--profile``).
* ``variants/``: kernel variants kept for measurement only (the package never imports them),
  and ``kept_set_load_batch.cu``, a standalone CUDA program (its header says how to build it).

They share the suite's helpers (``benchmarks.common``, ``linear_harness``, the inputs and
losses of ``bench_tokens``); the suite never imports a study.
"""
