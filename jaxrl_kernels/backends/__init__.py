"""Backends: ``reference`` (the oracle), ``chunked``, ``pallas``, ``ffi``. See ``dispatch``."""
