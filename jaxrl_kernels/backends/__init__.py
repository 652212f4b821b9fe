"""Backends: ``reference`` (the oracle), ``chunked``, ``pallas``, ``ffi``; one package each, whose
``__init__`` declares ``BACKEND`` (a ``contract.Backend``). See ``dispatch``."""
