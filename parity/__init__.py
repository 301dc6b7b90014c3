"""parity: numerical parity verification for GPU kernels ported across vendors."""
__version__ = "0.1.0"
