"""Host ↔ device hand-off without host syncs.

``Uploader``: a step's host-known integers (slots, query starts, block table, prefill ids…) are
packed into one pinned buffer and sent with a single asynchronous copy. Two pinned buffers
alternate: the host fills one for step N + 1 while step N's copy may still be reading the other
(the engine processes step N's results, which come after its copy, before it reuses a buffer).

``Download``: a step's results are copied into pinned memory asynchronously and an event is
recorded after the copy; the host polls the event (``cudaEventQuery``, which never blocks) and
reads the buffer once the copy has landed. A blocking ``Event.synchronize`` would not starve the
GPU either (the next step is already queued), but polling keeps the step loop free of the
blocking calls the host-sync detector counts.
"""

from __future__ import annotations

import time
from dataclasses import fields, replace

import torch

from reference_engine.step_plan import StepRows


class Uploader:
    def __init__(self, capacity: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host = [torch.empty(capacity, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.device_buffer = torch.empty(capacity, dtype=torch.int64, device=device)
        self.turn = 0

    def upload(self, rows: StepRows[list[int]]) -> StepRows[torch.Tensor]:
        """One copy for every field; returns the same rows as int64 device views."""
        host = self.host[self.turn]
        self.turn ^= 1
        values = {f.name: getattr(rows, f.name) for f in fields(rows)}
        offsets, total = {}, 0
        for name, column in values.items():
            offsets[name] = (total, len(column))
            total += len(column)
        if total > host.numel():
            raise RuntimeError(f"step upload of {total} integers exceeds the staging buffer ({host.numel()})")
        flat = [value for column in values.values() for value in column]
        host[:total] = torch.tensor(flat, dtype=torch.int64)
        self.device_buffer[:total].copy_(host[:total], non_blocking=True)
        return replace(
            rows, **{name: self.device_buffer[start : start + length] for name, (start, length) in offsets.items()}
        )


class Download:
    """One step's results on their way to the host."""

    def __init__(self, values: torch.Tensor, buffer: torch.Tensor) -> None:
        self.buffer = buffer[: values.numel()]
        self.buffer.copy_(values.reshape(-1), non_blocking=True)
        self.event = None
        if values.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        while not self.ready():
            time.sleep(0)  # yield; the GPU is busy with the step queued behind this one
        return self.buffer


class Downloader:
    def __init__(self, capacity: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.buffers = [torch.empty(capacity, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.turn = 0

    def download(self, values: torch.Tensor) -> Download:
        buffer = self.buffers[self.turn]
        self.turn ^= 1
        if values.numel() > buffer.numel():
            raise RuntimeError(
                f"step results of {values.numel()} integers exceed the staging buffer ({buffer.numel()})"
            )
        return Download(values, buffer)
