"""NVTX ranges for the engine's phases (schedule, prepare, draft, build metadata, target forward,
rejection, output processing), visible in Nsight Systems. Uses the ``nvtx`` package when it is
installed (near-free when no profiler is attached), nothing otherwise."""

from __future__ import annotations

import contextlib

try:
    import nvtx as _nvtx
except ImportError:  # the engine runs without it; ranges are then no-ops
    _nvtx = None


def range(name: str):  # noqa: A001 - mirrors nvtx.annotate / torch.cuda.nvtx.range
    if _nvtx is None:
        return contextlib.nullcontext()
    return _nvtx.annotate(name, domain="reference_engine")
