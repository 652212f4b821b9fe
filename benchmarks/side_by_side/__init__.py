"""Workers of ``benchmarks.linear_side_by_side``: one process each for the float64 exact
gradients (``exact``), the JAX implementations (``jax_worker``) and the PyTorch ones
(``torch_worker``); ``shared`` holds what they agree on and imports only NumPy."""
