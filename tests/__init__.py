"""The test suite, one folder per layer of the package (tests/ops/ for jaxrl_kernels/ops/, ...);
tests/support/ holds the shared helpers (``from tests.support import oracle``) and the scripts
tests start. Every folder is a package, so modules import as ``tests.<layer>.test_x``."""
