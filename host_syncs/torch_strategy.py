"""PyTorch's own sync-debug mode: warns on synchronizing operations made through PyTorch.

Measured on an H200: it catches .item(), .cpu() and .tolist(), and misses torch.cuda.synchronize(),
Event.synchronize(), a raw ctypes cudaMemcpy and cudaStreamSynchronize, and anything a C++
extension does (FlashInfer's plan()). Used when cupti-python is missing.
"""

from __future__ import annotations

import warnings

import torch

from host_syncs.events import SYNC, EventRecorder, SyncEvent

_MESSAGE = "called a synchronizing CUDA operation"


class TorchSyncDebugStrategy:
    name = "torch"
    blind_spots = (
        "sees only synchronizing PyTorch operators (.item(), .cpu(), .tolist(), blocking copies); misses "
        "torch.cuda.synchronize(), Event.synchronize(), C++ extensions (e.g. FlashInfer plan()) and raw CUDA "
        "calls (ctypes cudaMemcpy / cudaStreamSynchronize)"
    )

    def __init__(self, recorder: EventRecorder) -> None:
        self.recorder = recorder
        self._catcher = None
        self._previous_mode = 0

    def start(self) -> None:
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("always")
        original = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if _MESSAGE not in str(message):
                return original(message, category, filename, lineno, file, line)
            if not self.recorder.recording:
                return None
            stack, source = self.recorder.capture_stack()
            self.recorder.events.append(
                SyncEvent(
                    kind=SYNC,
                    api="torch sync-debug",
                    blocking=True,
                    phase=self.recorder.phase,
                    source=source,
                    stack=stack,
                )
            )
            return None

        warnings.showwarning = showwarning
        self._previous_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        torch.cuda.set_sync_debug_mode(self._previous_mode)
        if self._catcher is not None:
            self._catcher.__exit__(None, None, None)
            self._catcher = None
