"""Variants of the package's kernels kept for measurement only; the package never imports them.

* ``ffi_xla_gemms``: the SM90 backward's chunks as a loop of the grad custom call and XLA's
  GEMMs (what ``ffi.linear_backward(gemms="xla")`` was), and the grad kernel alone.
* ``pallas_max_epilogue``: the Pallas statistics kernel with its softmax epilogue cut to a
  running max (what ``pallas.linear.Config(epilogue="max")`` was): the bare GEMM's time.

What they measured, and the variants that were dropped: docs/design/linear_backward.md.
"""
