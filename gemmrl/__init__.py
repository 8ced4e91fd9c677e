"""gemmrl: writes, verifies and times HGEMM kernels per shape and keeps the fastest."""

__version__ = "0.1.0"
