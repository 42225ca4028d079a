"""Tiling sweeps for our Triton kernels, run by hand on a GPU (not tests):
``python -m conformance.tuning.tune_triton`` and ``python -m conformance.tuning.tune_triton_mla``."""
