"""A page-locked staging buffer for every FlashInfer ``plan`` that no queued copy still reads.

A wrapper's ``plan`` writes its schedule into one page-locked host buffer
(``_pin_memory_int_workspace_buffer``) and copies it to the device with ``cudaMemcpyAsync`` on the
current stream: the copy reads the buffer when the stream reaches it, not when it is enqueued. An
async scheduler plans step N+1 while step N is still queued, so the second plan overwrites bytes
step N's copy has not read yet: step N attends with step N+1's schedule, wrong outputs or an
illegal address (mini-sglang #103; the numerics check's two steps in flight caught it here).

So each plan gets a buffer whose last copy has run, by an event recorded after that plan (a query,
never a wait): with one step in flight two buffers are enough, and a deeper queue adds one more
each time it is deeper than ever before. FlashInfer has no public hook for this; the attribute is
its own name for the buffer, checked when the wrapper is adopted.
"""

from __future__ import annotations

from typing import Any

import torch

STAGING_ATTRIBUTE = "_pin_memory_int_workspace_buffer"


class PlanStaging:
    """One wrapper's staging buffers, each with the event after the plan that last used it."""

    def __init__(self, wrapper: Any, device: torch.device) -> None:
        first = getattr(wrapper, STAGING_ATTRIBUTE, None)
        if not isinstance(first, torch.Tensor):
            raise RuntimeError(
                f"this flashinfer's {type(wrapper).__name__} has no {STAGING_ATTRIBUTE} tensor: "
                "the adapter cannot keep a queued step's plan from being overwritten"
            )
        self.wrapper, self.on_gpu = wrapper, torch.device(device).type == "cuda"
        self.buffers: list[tuple[torch.Tensor, torch.cuda.Event | None]] = [(first, None)]

    def plan(self, *args: Any, **kwargs: Any) -> None:
        index = next((i for i, (_, done) in enumerate(self.buffers) if done is None or done.query()), None)
        if index is None:  # every buffer is still read by a queued step
            self.buffers.append((torch.empty_like(self.buffers[0][0], pin_memory=True), None))
            index = len(self.buffers) - 1
        buffer = self.buffers[index][0]
        setattr(self.wrapper, STAGING_ATTRIBUTE, buffer)
        self.wrapper.plan(*args, **kwargs)
        if self.on_gpu:  # (a CPU test's stand-in copies nothing asynchronously)
            done = torch.cuda.Event()
            done.record()
            self.buffers[index] = (buffer, done)
