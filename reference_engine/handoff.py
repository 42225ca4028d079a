"""Host ↔ device hand-off without host syncs.

``Uploader``: a step's host-known integers (slots, query starts, block table, prefill ids…) are
packed into one pinned buffer and sent with a single asynchronous copy. Two pinned buffers
alternate: the host fills one for step N + 1 while step N's copy may still be reading the other
(the engine processes step N's results, which come after its copy, before it reuses a buffer).
The fields attention reads as int32 (``StepRows.INT32``) travel as int32, after the int64 ones,
so the device reads them where they land instead of converting them every step. A step of the
same field lengths as an earlier one lands at the same offsets: its device views are made once.

``Download``: a step's results are copied into pinned memory asynchronously and an event is
recorded after the copy; the host polls the event (``cudaEventQuery``, which never blocks) and
reads the buffer once the copy has landed. A blocking ``Event.synchronize`` would not starve the
GPU either (the next step is already queued), but polling keeps the step loop free of the
blocking calls the host-sync detector counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import numpy as np
import torch

from reference_engine.step_plan import StepRows


class Uploader:
    # Field lengths of steps seen -> their layout; a serving loop meets few (its graph sizes), a
    # run of varied prefill chunks more: cleared when it grows past this many.
    MAX_LAYOUTS = 64

    def __init__(self, capacity: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host = [torch.empty(capacity, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        # The same memory as numpy arrays, int64 and int32: the host's lists are written into them
        # without a torch operator or a temporary tensor.
        self.host_arrays = [(buffer.numpy(), buffer.numpy().view(np.int32)) for buffer in self.host]
        self.device_buffer = torch.empty(capacity, dtype=torch.int64, device=device)
        self.turn = 0
        self.layouts: dict[tuple[int, ...], _Layout] = {}

    def upload(self, rows: StepRows[list[int]]) -> StepRows[torch.Tensor]:
        """One copy for every field; returns the same rows as device views (int64, the
        ``StepRows.INT32`` fields int32)."""
        columns = [getattr(rows, name) for name in _NAMES]
        lengths = tuple(len(column) for column in columns)
        layout = self.layouts.get(lengths)
        if layout is None:
            layout = self._layout(lengths)
        (wide, narrow), staged = self.host_arrays[self.turn], self.host[self.turn]
        self.turn ^= 1
        wide[: layout.wide] = [value for column in columns[: len(_WIDE)] for value in column]
        for (start, end), column in zip(layout.narrow, columns[len(_WIDE) :]):
            narrow[start:end] = column
        self.device_buffer[: layout.total].copy_(staged[: layout.total], non_blocking=True)
        return layout.views

    def _layout(self, lengths: tuple[int, ...]) -> _Layout:
        """Where each field of a step of these lengths lies: the int64 fields, then the int32 ones
        (two to an int64 element, each from a 64-byte boundary, as a buffer of its own would be:
        a vendor kernel may load a block table in wide vectors), and the device views of them."""
        views, wide = {}, 0
        for name, length in zip(_WIDE, lengths):
            views[name] = self.device_buffer[wide : wide + length]
            wide += length
        narrow, end, int32 = [], 2 * wide, self.device_buffer.view(torch.int32)
        for name, length in zip(_NARROW, lengths[len(_WIDE) :]):
            start = -(-end // NARROW_ALIGNMENT) * NARROW_ALIGNMENT
            end = start + length
            views[name] = int32[start:end]
            narrow.append((start, end))
        total, capacity = -(-end // 2), self.device_buffer.numel()
        if total > capacity:
            raise RuntimeError(f"step upload of {total} integers exceeds the staging buffer ({capacity})")
        if len(self.layouts) >= self.MAX_LAYOUTS:
            self.layouts.clear()
        layout = self.layouts[lengths] = _Layout(wide, tuple(narrow), total, StepRows(**views))
        return layout


@dataclass(frozen=True)
class _Layout:
    wide: int  # int64 elements of the int64 fields, from the buffer's start
    narrow: tuple[tuple[int, int], ...]  # each int32 field's [start, end) in int32 elements
    total: int  # int64 elements copied
    views: StepRows[torch.Tensor]


NARROW_ALIGNMENT = 16  # int32 elements: 64 bytes


# The fields in upload order: the int64 ones, then the int32 ones.
_WIDE = tuple(f.name for f in fields(StepRows) if f.name not in StepRows.INT32)
_NARROW = tuple(f.name for f in fields(StepRows) if f.name in StepRows.INT32)
_NAMES = _WIDE + _NARROW


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
