"""Host-sync events and how API calls become them: pure logic, driven by recorded callbacks.

A CUDA runtime call fires its own callback and then the callbacks of the driver calls it makes
(``cudaMemcpyAsync`` → ``cuMemcpyDtoHAsync_v2``). One user-level action must count once, so a
driver call made while a runtime call is open on the same thread is folded into that runtime
call's event. A driver call made directly (C++ extensions often do) is an event of its own.
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

# Kinds that block the host until the device catches up: each one is a bubble.
SYNC = "sync"  # stream / context / event / device synchronize
D2H_COPY = "d2h-copy"  # device-to-host copy into pageable memory (synchronous by nature)
SYNC_COPY = "sync-copy"  # a synchronous memcpy (cudaMemcpy, cuMemcpyHtoD, ...) in any direction
BLOCKING_KINDS = (SYNC, D2H_COPY, SYNC_COPY)
# Kinds recorded as information only.
PAGEABLE_H2D = "pageable-h2d-copy"  # staged through a driver buffer; no wait on the device
DEVICE_ALLOC = "device-alloc"  # cudaMalloc / cuMemAlloc: slow, and illegal inside a graph capture
INFO_KINDS = (PAGEABLE_H2D, DEVICE_ALLOC)

_SYNC_APIS = {
    "cudaDeviceSynchronize",
    "cudaThreadSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaExecutionCtxSynchronize",
    "cuCtxSynchronize",
    "cuStreamSynchronize",
    "cuEventSynchronize",
}
_SYNC_COPY_APIS = {
    "cudaMemcpy",
    "cudaMemcpy2D",
    "cudaMemcpy3D",
    "cudaMemcpyToSymbol",
    "cudaMemcpyFromSymbol",
    "cudaMemcpyPeer",
    "cuMemcpy",
    "cuMemcpyDtoH",
    "cuMemcpyHtoD",
    "cuMemcpyDtoD",
    "cuMemcpy2D",
    "cuMemcpy3D",
    "cuMemcpyPeer",
}
_ASYNC_COPY_APIS = {
    "cudaMemcpyAsync",
    "cudaMemcpy2DAsync",
    "cudaMemcpy3DAsync",
    "cuMemcpyAsync",
    "cuMemcpyDtoHAsync",
    "cuMemcpyHtoDAsync",
    "cuMemcpyDtoDAsync",
    "cuMemcpy2DAsync",
    "cuMemcpy3DAsync",
}
_ALLOC_APIS = {"cudaMalloc", "cudaMallocAsync", "cuMemAlloc", "cuMemAllocAsync", "cuMemCreate"}

# Every API this module classifies: the detector enables callbacks for these and nothing else
# (never kernel launches, so the hot path pays nothing).
WATCHED_APIS = _SYNC_APIS | _SYNC_COPY_APIS | _ASYNC_COPY_APIS | _ALLOC_APIS


@functools.lru_cache(maxsize=None)  # a few dozen names, met hundreds of thousands of times a run
def base_api_name(name: str) -> str:
    """cudaMemcpyAsync_v3020 → cudaMemcpyAsync; cuMemcpyDtoHAsync_v2 → cuMemcpyDtoHAsync."""
    name = re.sub(r"(_v\d+)?(_ptsz|_ptds)?(_v\d+)?$", "", name)
    return name


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    function: str
    line: str = ""

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}" + (f": {self.line.strip()}" if self.line else "")


@dataclass
class CopyInfo:
    """What a memcpy moves. direction: d2h, h2d, d2d, h2h or None when unknown."""

    direction: str | None = None
    num_bytes: int | None = None
    host_pinned: bool | None = None  # for the host side of a d2h / h2d copy


@dataclass
class ApiCall:
    """One callback, as a recorded sequence or a live CUPTI callback presents it."""

    domain: str  # "runtime" or "driver"
    name: str
    enter: bool
    thread: int = 0
    copy: CopyInfo | None = None


@dataclass
class SyncEvent:
    kind: str
    api: str
    blocking: bool
    num_bytes: int | None = None
    direction: str | None = None
    nested: list[str] = field(default_factory=list)  # driver calls folded into this event
    phase: str = ""
    source: Frame | None = None  # the line a backend author must change
    stack: list[Frame] = field(default_factory=list)  # innermost last

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["source"] = str(self.source) if self.source else None
        data["stack"] = [str(frame) for frame in self.stack[-12:]]
        return data

    def describe(self) -> str:
        size = f" {self.num_bytes} B" if self.num_bytes is not None else ""
        where = f" at {self.source}" if self.source else ""
        return f"{self.kind} ({self.api}{size}){where}"


def classify(call: ApiCall) -> tuple[str, bool] | None:
    """(kind, blocking) for an API call, or None when it does not concern the host."""
    name = base_api_name(call.name)
    copy = call.copy or CopyInfo()
    if name in _SYNC_APIS:
        return SYNC, True
    if name in _SYNC_COPY_APIS:
        return SYNC_COPY, True
    if name in _ASYNC_COPY_APIS:
        if copy.direction == "d2h":
            # Into pinned memory it is truly asynchronous; into pageable memory it blocks.
            return None if copy.host_pinned else (D2H_COPY, True)
        if copy.direction == "h2d" and copy.host_pinned is False:
            return PAGEABLE_H2D, False
        return None
    if name in _ALLOC_APIS:
        return DEVICE_ALLOC, False
    return None


@dataclass
class _OpenRuntimeCall:
    event: SyncEvent | None


class EventRecorder:
    """Turns a stream of enter/exit callbacks into de-duplicated events.

    ``capture_stack`` is called only when an event is created, so calls that do not concern the
    host cost one dictionary lookup.
    """

    def __init__(self, capture_stack: Callable[[], tuple[list[Frame], Frame | None]] = lambda: ([], None)) -> None:
        self.capture_stack = capture_stack
        self.events: list[SyncEvent] = []
        self.phase = ""
        self.recording = True
        self._open: dict[int, list[_OpenRuntimeCall]] = {}

    def on_call(self, call: ApiCall) -> None:
        open_calls = self._open.setdefault(call.thread, [])
        if call.domain == "runtime":
            if not call.enter:
                if open_calls:
                    open_calls.pop()
                return
            open_calls.append(_OpenRuntimeCall(self._new_event(call)))
            return
        if not call.enter:
            return
        if open_calls:  # made by the runtime call that is open on this thread: already counted
            outer = open_calls[-1].event
            if outer is not None:
                outer.nested.append(call.name)
            return
        self._new_event(call)

    def _new_event(self, call: ApiCall) -> SyncEvent | None:
        if not self.recording:
            return None
        classified = classify(call)
        if classified is None:
            return None
        kind, blocking = classified
        stack, source = self.capture_stack()
        copy = call.copy or CopyInfo()
        event = SyncEvent(
            kind=kind,
            api=base_api_name(call.name),
            blocking=blocking,
            num_bytes=copy.num_bytes,
            direction=copy.direction,
            phase=self.phase,
            source=source,
            stack=stack,
        )
        self.events.append(event)
        return event
