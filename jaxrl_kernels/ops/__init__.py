"""The public ops, re-exported as ``jaxrl_kernels.<name>``."""
