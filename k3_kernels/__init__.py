"""Triton kernels (`miles_k3.kernels`), each beside its pure-torch reference and parity-tested on a GPU.
KDA comes from fla-core, not from here. Imports torch and triton only."""
