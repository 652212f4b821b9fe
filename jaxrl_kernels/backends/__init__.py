"""Backends: ``reference`` (the oracle), ``chunked``, ``pallas``, ``ffi``; one package each, whose
``__init__`` declares ``BACKEND`` (a ``backend_contract.Backend``). See ``dispatch``."""
