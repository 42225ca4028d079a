"""The detector: a context manager that records host-sync events, by phase.

    with detect_host_syncs() as detector:
        with detector.phase("build"):
            metadata = backend.build(common)
    for event in detector.blocking_events:
        print(event.describe())

``strategy``: "cupti" (every runtime and driver call), "torch" (PyTorch's sync-debug mode, only
PyTorch's own syncs) or "auto" (cupti when it can run, else torch). ``detector.strategy_name``
and ``detector.blind_spots`` say which ran and what it cannot see.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Iterator

import torch

from host_syncs.cupti_strategy import CuptiStrategy, CuptiUnavailable
from host_syncs.events import EventRecorder, SyncEvent
from host_syncs.frames import capture_python_stack
from host_syncs.torch_strategy import TorchSyncDebugStrategy

STRATEGIES = ("auto", "cupti", "torch")


def resolve_strategy(strategy: str = "auto") -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown sync-detector strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    if strategy != "auto":
        return strategy
    return "cupti" if importlib.util.find_spec("cupti") is not None else "torch"


class HostSyncDetector:
    def __init__(self, strategy: str = "auto", *, only_in_phases: bool = False) -> None:
        self.requested = strategy
        self.recorder = EventRecorder(capture_python_stack)
        self.recorder.recording = not only_in_phases
        self.only_in_phases = only_in_phases
        self.fallback_reason = ""
        self._strategy = None

    @property
    def strategy_name(self) -> str:
        return self._strategy.name if self._strategy else resolve_strategy(self.requested)

    @property
    def blind_spots(self) -> str:
        return self._strategy.blind_spots if self._strategy else ""

    @property
    def events(self) -> list[SyncEvent]:
        return self.recorder.events

    @property
    def blocking_events(self) -> list[SyncEvent]:
        return [event for event in self.events if event.blocking]

    def __enter__(self) -> "HostSyncDetector":
        if not torch.cuda.is_available():
            raise RuntimeError("host-sync detection needs a CUDA device")
        torch.cuda.init()  # context creation is not the code under test
        name = resolve_strategy(self.requested)
        if name == "cupti":
            try:
                self._strategy = CuptiStrategy(self.recorder)
                self._strategy.start()
            except CuptiUnavailable as error:
                if self.requested == "cupti":
                    raise
                self.fallback_reason = str(error)
                name = "torch"
        if name == "torch":
            self._strategy = TorchSyncDebugStrategy(self.recorder)
            self._strategy.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._strategy is not None:
            self._strategy.stop()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous = (self.recorder.phase, self.recorder.recording)
        self.recorder.phase, self.recorder.recording = name, True
        try:
            yield
        finally:
            self.recorder.phase, self.recorder.recording = previous

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        previous = self.recorder.recording
        self.recorder.recording = False
        try:
            yield
        finally:
            self.recorder.recording = previous


def detect_host_syncs(strategy: str = "auto", *, only_in_phases: bool = False) -> HostSyncDetector:
    """A context manager recording host↔device syncs; see the module docstring."""
    return HostSyncDetector(strategy, only_in_phases=only_in_phases)


def format_events(events: list[SyncEvent]) -> str:
    lines = []
    for index, event in enumerate(events, 1):
        lines.append(f"{index}. {event.describe()}" + (f" [{event.phase}]" if event.phase else ""))
        lines += [f"     {frame}" for frame in event.stack[-6:]]
    return "\n".join(lines)
