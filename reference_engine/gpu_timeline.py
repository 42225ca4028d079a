"""GPU idle inside each engine step, from one profiled pass.

"Idle between steps" (``metrics.StepTimer``) sees only the gap from one step's last GPU work to
the next step's first. A loop can close those gaps and still leave the GPU waiting in the middle
of a step: for a host sync, for a launch the host has not made yet. This pass finds that time.

``torch.profiler`` (CUPTI activity records) gives every kernel, copy and memset with its device
start and end, and the correlation id of the runtime or driver call that launched it (for a CUDA
graph, the ``cudaGraphLaunch``: every node of the graph carries its id). The engine opens one
profiler range per step around the launches it makes for that step (``StepTimer.label_steps``),
so each launch call, and through its correlation id each GPU activity, belongs to a step. A
step's span runs from its first activity's start to its last one's end; its busy time is the
union of its activities (streams that overlap count once); idle inside it is the rest.

Its own pass, never timed: the profiler records every operator on the host (a few µs each), and
that extra host time can itself open gaps in a step whose launches the GPU is waiting for, so the
figure is an upper bound for the unprofiled run.
"""

from __future__ import annotations

import bisect
import json
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

STEP_RANGE = "engine step"
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})  # Triton launches through the driver API
ACTIVITY_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


@dataclass(frozen=True)
class StepActivity:
    span_us: float  # first activity's start to last activity's end; 0 for a step that ran nothing
    busy_us: float  # union of its activities

    @property
    def idle_us(self) -> float:
        return self.span_us - self.busy_us


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def step_activity(events: list[dict]) -> list[StepActivity]:
    """Each step range's GPU activity, in launch order, from a Chrome trace's events (the format
    ``torch.profiler``'s ``export_chrome_trace`` writes)."""
    ranges = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e.get("name") == STEP_RANGE), key=lambda e: e["ts"]
    )
    starts = [r["ts"] for r in ranges]
    step_of_launch: dict[int, int] = {}
    for event in events:
        if event.get("cat") not in LAUNCH_CATEGORIES:
            continue
        index = bisect.bisect_right(starts, event["ts"]) - 1
        if index >= 0:
            step = ranges[index]
            if event["ts"] <= step["ts"] + step["dur"] and event.get("tid") == step.get("tid"):
                step_of_launch[event["args"]["correlation"]] = index
    intervals: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        if event.get("cat") in ACTIVITY_CATEGORIES:
            index = step_of_launch.get(event.get("args", {}).get("correlation"))
            if index is not None:
                intervals[index].append((event["ts"], event["ts"] + event["dur"]))
    steps = []
    for index in range(len(ranges)):
        spans = intervals.get(index, [])
        span = max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0
        steps.append(StepActivity(span, union_length(spans)))
    return steps


@dataclass(frozen=True)
class InStepIdle:
    fraction: float  # idle inside steps / their spans, over the steps measured
    idle_ms_per_step: float
    busy_ms_per_step: float
    steps: int


def summarize(steps: list[StepActivity]) -> InStepIdle | None:
    ran = [step for step in steps if step.span_us > 0]
    if not ran:
        return None
    return InStepIdle(
        fraction=sum(step.idle_us for step in ran) / sum(step.span_us for step in ran),
        idle_ms_per_step=statistics.mean(step.idle_us for step in ran) / 1e3,
        busy_ms_per_step=statistics.mean(step.busy_us for step in ran) / 1e3,
        steps=len(ran),
    )


def profile_in_step_idle(engine, prompts, params) -> InStepIdle | None:
    """One more ``generate`` under ``torch.profiler``; the idle inside its steps that captured no
    CUDA graph (a capture is a one-time cost). None off CUDA or for a loop without step ranges."""
    timer = getattr(engine, "timer", None)
    if engine.device.type != "cuda" or timer is None:
        return None
    from torch.profiler import ProfilerActivity, profile

    timer.label_steps = True
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            # CUPTI asks for its first activity buffer at the first GPU activity it records (about
            # 3 ms on an H100): let that be this one, not the first step's.
            torch.zeros(1, device=engine.device).add_(1)
            torch.cuda.synchronize(engine.device)
            engine.generate(prompts, params)
            torch.cuda.synchronize(engine.device)
    finally:
        timer.label_steps = False
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    steps = step_activity(events)
    if len(steps) != len(engine.steps):
        raise RuntimeError(f"the profiled pass has {len(steps)} step ranges for {len(engine.steps)} steps")
    return summarize([step for step, record in zip(steps, engine.steps) if not record.captured])
