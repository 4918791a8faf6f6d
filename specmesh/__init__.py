"""specmesh: speculative-decoding inference as a gRPC mesh (shared library for every service)."""

__version__ = "0.1.0"
