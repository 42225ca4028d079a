"""One ``bigpool`` case at a time on a GPU, across every process that shares it.

A big-pool case holds its 4–8 GiB pool, a copy and their comparison (about 3× the pool) for a few
seconds. Runs side by side on one GPU (``reports/regenerate.sh`` runs 15 processes, CI shards)
reach the big-pool cases at about the same time, and together they would need far more memory
than the GPU has: an out-of-memory error would then be reported as the backend's. So a case with
a big pool first takes the GPU's turn (an exclusive ``flock`` on a file named by the GPU's UUID,
which names one device whatever ``CUDA_VISIBLE_DEVICES`` each process has), and gives it back
only after its memory is returned to the driver.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from conformance.cases.grammar import Case


@contextlib.contextmanager
def exclusive(name: str) -> Iterator[None]:
    """Held by one holder at a time on this machine (processes and threads alike)."""
    with open(Path(tempfile.gettempdir()) / f"conformance-{name}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def big_pool_turn(case: Case, device: torch.device) -> Iterator[None]:
    """The GPU to this case alone while it runs, when its pool is big; otherwise nothing."""
    if not case.big_pool or device.type != "cuda":
        yield
        return
    with exclusive(f"bigpool-{torch.cuda.get_device_properties(device).uuid}"):
        try:
            yield
        finally:
            gc.collect()  # the case's tensors, so that the cache below can go back to the driver
            with contextlib.suppress(RuntimeError):  # a faulted context cannot free; the process ends anyway
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
