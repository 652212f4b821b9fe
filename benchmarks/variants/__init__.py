"""Variants of the package's kernels kept for measurement only; the package never imports them.

* ``ffi_xla_gemms``: the SM90 backward's chunks as a loop of the grad custom call and XLA's
  GEMMs (what ``ffi.linear_backward(gemms="xla")`` was), and the grad kernel alone.

What they measured, and the variants that were dropped: docs/design/linear_backward.md.
"""
