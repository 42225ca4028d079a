"""What an engine run measured: tokens/s, TTFT, TPOT, mean acceptance length, host-blocking syncs
per steady-state step, and GPU idle time between steps (and, from ``gpu_timeline``'s profiled
pass, inside them).

GPU idle comes from CUDA events: each step records one event before its first GPU work and one
after its last. When the host queued step N + 1 while step N ran, N + 1's start event completes the
moment N's end event does and the gap is ~0; when the host was late (a sync, slow scheduling), the
gap is the bubble. Idle fraction = sum of gaps / (last end − first start). The events are read once,
after the run.

Whether the host kept the GPU fed, without a profiler: the moment the host has made a step's last
launch, it queries the previous step's end event (``cudaEventQuery``, no wait). Completed means
the GPU ran out of earlier work before this step was wholly queued: it was *drained*, and may have
waited for the host inside the step. Sync drains every step by design; a zero-bubble loop should
drain none in steady state. A decode step that was not drained was queued whole before the GPU
reached it, so its start-to-end events time the GPU alone, with no host in the way: the *fed* step
time, what a step costs when the loop is GPU-bound. The profiler's busy time is not that figure:
it leaves out the gaps between a graph's kernels, which are the GPU's own cost.

Host syncs come from the detector (``host_syncs``), one phase per loop iteration. A
steady-state iteration launches a uniform decode step that captured no graph, also right after
the batch changed (a request left: fewer requests than the step before; requests joined: the first
decode step after their prefill), so a backend that syncs only when the number of requests
changes is seen. Prefill and mixed steps are not counted (``batch_change`` says why). The
detector's CUPTI callbacks cost host time on every CUDA call (they tripled the host launch time per
step on an H100), so it runs in a second pass over the same prompts: every time and the idle
fraction come from the first pass, which runs without it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from reference_engine.gpu_timeline import STEP_RANGE, profile_in_step_idle


class StepTimer:
    """CUDA events around each step's launches; and, while ``label_steps`` is set (the profiled
    pass of ``gpu_timeline``), a profiler range around them."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.label_steps = False
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.drained: list[bool] = []  # for each step after the first (see the module docstring)
        self._start = None
        self._range = None

    def begin(self) -> None:
        if self.label_steps:
            self._range = torch.profiler.record_function(STEP_RANGE)
            self._range.__enter__()
        if self.enabled:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def reset(self) -> None:
        self.pairs.clear()
        self.drained.clear()

    def end(self) -> None:
        if self.enabled:
            if self.pairs:
                self.drained.append(self.pairs[-1][1].query())  # this step's launches are all made
            finish = torch.cuda.Event(enable_timing=True)
            finish.record()
            self.pairs.append((self._start, finish))
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def gaps_ms(self) -> tuple[list[float], float]:
        """(idle gap before each step after the first, total span); synchronizes: call after the run."""
        if not self.pairs:
            return [], 0.0
        self.pairs[-1][1].synchronize()
        gaps = [
            max(0.0, previous_end.elapsed_time(start))
            for (_, previous_end), (start, _) in zip(self.pairs, self.pairs[1:])
        ]
        return gaps, self.pairs[0][0].elapsed_time(self.pairs[-1][1])

    def step_ms(self) -> list[float]:
        """Each step's first GPU work to its last (ms); after ``gaps_ms``, which synchronizes."""
        return [start.elapsed_time(finish) for start, finish in self.pairs]


def feeding(records, drained: list[bool], step_ms: list[float]) -> tuple[float | None, float | None, float | None]:
    """(drained fraction, fed decode step ms, decode step period ms) over the steps that captured
    no graph; the last two are medians over uniform decode steps. ``drained[i]`` is step i + 1's.
    The period is one loop iteration's host time, waiting included: schedule and launch of a step,
    wait and land of it (one iteration later under async, the same period in steady state)."""
    later = [
        (record, ran_dry, ms) for record, ran_dry, ms in zip(records[1:], drained, step_ms[1:]) if not record.captured
    ]
    if not later:
        return None, None, None
    fed = [ms for record, ran_dry, ms in later if record.uniform_decode and not ran_dry]
    periods = [
        record.host_schedule_s + record.host_launch_s + record.host_wait_s + record.host_land_s
        for record, _, _ in later
        if record.uniform_decode
    ]
    return (
        sum(ran_dry for _, ran_dry, _ in later) / len(later),
        statistics.median(fed) if fed else None,
        1e3 * statistics.median(periods) if periods else None,
    )


@dataclass
class EngineMetrics:
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_ms: float  # median
    tpot_ms: float  # median over requests
    acceptance_length: float  # mean tokens per decode step
    draft_acceptance: float | None
    steps: int
    gpu_idle_fraction: float | None = None  # between steps (CUDA events, timed pass)
    gpu_idle_ms_per_step: float | None = None
    gpu_idle_in_step_fraction: float | None = None  # inside steps (gpu_timeline's profiled pass)
    gpu_idle_in_step_ms: float | None = None
    gpu_busy_ms_per_step: float | None = None
    gpu_drained_fraction: float | None = None  # steps launched after the GPU ran out of work (timed pass)
    gpu_ms_per_fed_step: float | None = None  # a decode step queued whole before the GPU reached it
    decode_step_ms: float | None = None  # one loop iteration of uniform decode, waiting included
    steady_steps: int = 0
    host_syncs_per_steady_step: float | None = None
    host_sync_sources: list[str] = field(default_factory=list)
    graph_replays: int = 0
    host_ms_per_step: dict = field(
        default_factory=dict
    )  # schedule / launch / wait / land, means over steps without a capture

    def to_dict(self) -> dict:
        return asdict(self)


def steady_iterations(engine) -> dict[int, str]:
    """Loop iterations whose launched step is steady-state decode (see the module docstring), each
    with the change of batch it came right after: "" (none), "leave" or "join" (``batch_change``)."""
    records = engine.steps
    return {
        record.iteration: batch_change(previous, record)
        for previous, record in zip(records, records[1:])
        if record.uniform_decode and not record.captured  # a capture is a one-time cost
    }


def batch_change(previous, record) -> str:
    """How the batch of a uniform decode step ``record`` differs from the step before: "leave"
    (fewer requests), "join" (after a prefill or mixed step: requests joined and their prefill is
    done, the run's first decode step too; or more requests: under async, a request the host
    thought finished, awaiting its results, is back), or "" (the same number of requests).

    The prefill and mixed steps themselves are not steady state: the iteration that launches a
    joining request's prefill syncs in the engine itself (entering a slot writes the request's
    per-slot device state from host numbers, ``tensor[slot] = value``: a synchronous copy each),
    and a companion backend that may need host lengths serves them for a decode-only backend."""
    if not previous.uniform_decode or record.num_reqs > previous.num_reqs:
        return "join"
    return "leave" if record.num_reqs < previous.num_reqs else ""


def measure(engine, prompts, params, *, detect_syncs: bool = False, strategy: str = "auto", step_idle: bool = False):
    """Run ``engine.generate`` and measure it (and once more under the host-sync detector, when
    asked: ``count_host_syncs``; once more under the profiler for ``step_idle``). Returns
    (outputs of the timed run, EngineMetrics). Comparing engines, time them all before counting
    any one's syncs (``engine bench`` does), so that no timed run follows an untimed pass."""
    timer = getattr(engine, "timer", None)
    if timer is not None:
        timer.reset()
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - started
    tokens = sum(len(out.tokens) for out in outputs)
    drafted = sum(out.drafted for out in outputs)
    latency = max(
        out.latency_s for out in outputs
    )  # arrival → last token (excludes the scripted drafter's reference run)
    metrics = EngineMetrics(
        requests=len(outputs),
        tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / latency if latency else 0.0,
        ttft_ms=1e3 * statistics.median(out.ttft_s for out in outputs),
        tpot_ms=1e3 * statistics.median(out.tpot_s for out in outputs),
        acceptance_length=statistics.mean(out.acceptance_length for out in outputs),
        draft_acceptance=sum(out.accepted for out in outputs) / drafted if drafted else None,
        steps=len(getattr(engine, "steps", [])),
    )
    if timer is not None and timer.enabled:
        gaps, span = timer.gaps_ms()
        if span > 0:
            metrics.gpu_idle_fraction = sum(gaps) / span
            metrics.gpu_idle_ms_per_step = sum(gaps) / max(len(gaps), 1)
        metrics.gpu_drained_fraction, metrics.gpu_ms_per_fed_step, metrics.decode_step_ms = feeding(
            engine.steps, timer.drained, timer.step_ms()
        )
    records = getattr(engine, "steps", [])
    steady_records = [r for r in records if not r.captured]  # a capture is a one-time cost
    if steady_records:
        metrics.host_ms_per_step = {
            phase: 1e3 * statistics.mean(getattr(r, f"host_{phase}_s") for r in steady_records)
            for phase in ("schedule", "launch", "wait", "land")
        }
    graphs = getattr(engine, "graphs", None)
    metrics.graph_replays = graphs.replays if graphs is not None else 0
    if detect_syncs:
        count_host_syncs(engine, prompts, params, metrics, strategy)
    if step_idle:
        measure_in_step_idle(engine, prompts, params, metrics)
    return outputs, metrics


def measure_in_step_idle(engine, prompts, params, metrics: EngineMetrics) -> None:
    """GPU idle inside steps from ``gpu_timeline``'s profiled pass, written into ``metrics``."""
    idle = profile_in_step_idle(engine, prompts, params)
    if idle is not None:
        metrics.gpu_idle_in_step_fraction = idle.fraction
        metrics.gpu_idle_in_step_ms = idle.idle_ms_per_step
        metrics.gpu_busy_ms_per_step = idle.busy_ms_per_step


def median_run(runs: list[tuple[list, EngineMetrics]]) -> tuple[list, EngineMetrics]:
    """Of repeated timed runs of one engine, the one of median TPOT (the lower of the middle two):
    a whole run's figures, each from the same run, rather than medians of each figure apart."""
    return sorted(runs, key=lambda run: run[1].tpot_ms)[(len(runs) - 1) // 2]


def count_host_syncs(engine, prompts, params, metrics: EngineMetrics, strategy: str = "auto") -> None:
    """One more ``generate`` under the host-sync detector (CUDA only), its steady steps' blocking
    syncs written into ``metrics``. Its own pass, never timed: the detector's callbacks cost host
    time on every call they watch."""
    if engine.device.type != "cuda":
        return
    from host_syncs.detector import detect_host_syncs

    detector = detect_host_syncs(strategy, only_in_phases=True)
    engine.sync_detector = detector
    try:
        with detector:
            engine.generate(prompts, params)
    finally:
        engine.sync_detector = None
    steady = steady_iterations(engine)
    names = {f"iteration {index}" for index in steady}
    blocking = [event for event in detector.blocking_events if event.phase in names]
    metrics.steady_steps = len(steady)
    metrics.host_syncs_per_steady_step = len(blocking) / len(steady) if steady else None
    metrics.host_sync_sources = sorted({event.describe() for event in blocking})[:8]
