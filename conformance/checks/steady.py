"""steady: 256 consecutive decode steps of a small batch, every request one token longer each step,
as an engine's decode loop runs them: ``build``, ``write_kv``, ``forward``, eagerly, with host
lengths only where the backend claims it needs them (as under async scheduling).

A backend that misbehaves only now and then passes every check that watches one step: a host-side
cache refreshed every Nth step, a workspace regrown as the contexts grow, a sync or an allocation
on some steps only, memory that creeps up. Here every step is watched:

* host syncs: the detector records every call of every step but the first (whose module loads
  and compiles the syncs check's warm-up step allows too; a phase each); any blocking sync is a
  FAIL naming the step and the line;
* every input handed to ``build``, ``write_kv`` and ``forward`` comes back as it went in (the
  input watch, compared after each step: the harness's read, outside the watched calls);
* every step's output against the oracle (the first wrong step is named);
* device memory held after each step (``torch.cuda.memory_allocated``): it may not grow past the
  level after the warm-up steps by more than ``GROWTH_BYTES`` (a leak, or a buffer regrown and
  kept); the caching allocator's allocations and new segments per steady step are reported, and
  so is every device allocation the detector saw in a steady step (``cudaMalloc``,
  ``cuMemAlloc``: PyTorch's new segments and a backend's own alike), with its step and line.
  Reported, not failed: PyTorch's allocator may grow a segment as the contexts grow.

It runs once per attention kind and KV-cache format, on the first decode case (query length 1)
of at most ``MAX_REQUESTS`` requests, and on CUDA only: syncs and device memory exist only there.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from backends.base import AttentionBackend
from conformance.cases.grammar import Case
from conformance.checks.base import Check
from conformance.checks.comparison import TOLERANCES, worst_place
from conformance.checks.draft_loop import DraftLoop
from conformance.harness.batch import PagedBatch
from conformance.results import CaseResult, Verdict
from host_syncs.detector import detect_host_syncs
from host_syncs.events import DEVICE_ALLOC

STEPS = 256
WARM_STEPS = 16  # lazy initialisation and JIT compiles happen here; memory is measured from here on
UNWATCHED_SYNC_STEPS = 1  # the first call's module loads and compiles (see steady_look)
MAX_REQUESTS = 8
GROWTH_BYTES = 1 << 20
MAX_EVENTS_KEPT = 10


def ramp_newest_keys(batch: PagedBatch) -> None:
    """Each step's key outscores every earlier one: probe channel ``i + 1`` for step ``i`` (exact
    integers up to 256 in every dtype; the probe query makes a unit about one logit), so a step
    that misses its newest key (a length one short, a stale copy of the lengths) is wrong by far
    more than the tolerance at every step, not only at the first few that edges data shape. An fp8
    cache could not store the ramp: its look watches syncs and memory, its outputs less sharply."""
    spec = batch.case.spec
    if spec.fp8_kv_cache:
        return
    probe = spec.head_dim - 1
    for key, (context, steps) in zip(batch.keys, batch.case.batch):
        ramp = torch.arange(1, steps + 1, dtype=key.dtype, device=key.device)
        key[context : context + steps, ..., probe] = ramp.view(-1, *([1] * (key.dim() - 2)))


def memory_counters(device: torch.device) -> dict[str, int]:
    """Device memory held and the caching allocator's cumulative counts (host bookkeeping: no sync)."""
    if device.type != "cuda":
        return {"allocated_bytes": 0, "allocations": 0, "segments": 0}
    stats = torch.cuda.memory_stats(device)
    return {
        "allocated_bytes": torch.cuda.memory_allocated(device),
        "allocations": stats.get("allocation.all.allocated", 0),
        "segments": stats.get("segment.all.allocated", 0),
    }


def steady_look(
    backend_cls: type[AttentionBackend], case: Case, device: torch.device, steps: int = STEPS, strategy: str = "auto"
) -> CaseResult:
    """``steps`` decode steps of ``case``'s requests, each watched; the verdict and its evidence."""
    loop = DraftLoop(backend_cls, case, steps, device, padding_row=False, shape_steps=ramp_newest_keys)
    buffers, backend = loop.buffers, loop.buffers.backend
    after: list[dict[str, int]] = []
    watch_syncs = device.type == "cuda"
    detector = detect_host_syncs(strategy, only_in_phases=True) if watch_syncs else None
    changed: list[str] = []
    inside = {"allocations": 0, "segments": 0}  # the caching allocator's counts inside the backend's calls only

    def watched(step: int, name: str, watch, call):
        before = memory_counters(device)
        # The first step's syncs are not counted: a backend's first call loads its modules and JIT
        # kernels (a sync each), as the syncs check's warm-up step allows. Without this the verdict
        # depended on what the process had run before (a fresh process failed, one that had run
        # the numerics check first passed). From the second step on, every sync counts.
        with _phase(detector if step >= UNWATCHED_SYNC_STEPS else None, f"step {step}: {name}"):
            result = call()
        now = memory_counters(device)
        if step >= WARM_STEPS:
            for key in inside:
                inside[key] += now[key] - before[key]
        watch.called(name)
        return result

    with detector if detector is not None else contextlib.nullcontext():
        for step in range(steps):
            loop.advance()
            common = loop.common(step)
            watch = buffers.watch(common)  # every input must come back as it went in, at every step
            metadata = watched(step, "build", watch, lambda: backend.build(common))
            watched(
                step,
                "write_kv",
                watch,
                lambda: backend.write_kv(
                    buffers.kv_cache, buffers.key, buffers.value, buffers.slot_mapping, **buffers.layer
                ),
            )
            watched(
                step,
                "forward",
                watch,
                lambda: backend.forward(
                    buffers.query, buffers.kv_cache, metadata, buffers.out, **buffers.forward_layer
                ),
            )
            loop.finish_step()
            changed = [f"step {step}: {change}" for change in watch.changes()]  # the harness's read: outside the phases
            del watch
            after.append(memory_counters(device))
            if changed:
                break
    if changed:
        return CaseResult(
            case.id,
            Verdict.FAIL,
            f"the backend changed an input it was handed: {'; '.join(changed)}",
            tag=case.tag,
            metrics={"steps": len(after)},
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    metrics, evidence = _memory_metrics(after, steps)
    steady = max(steps - WARM_STEPS, 1)
    metrics["steady_allocations_per_step"] = inside["allocations"] / steady
    metrics["steady_new_segments"] = inside["segments"]
    events = detector.events if detector else []
    allocations = [event for event in events if event.kind == DEVICE_ALLOC and _step_of(event) >= WARM_STEPS]
    metrics["steady_device_allocations"] = len(allocations)
    if allocations:
        evidence["device_allocations"] = [event.to_dict() for event in allocations[:MAX_EVENTS_KEPT]]
    blocking = [event for event in events if event.blocking]
    metrics["blocking_syncs"] = len(blocking)
    if blocking:
        evidence["syncs"] = [event.to_dict() for event in blocking[:MAX_EVENTS_KEPT]]
        first = blocking[0]
        steps_hit = sorted({_step_of(event) for event in blocking})
        return CaseResult(
            case.id,
            Verdict.FAIL,
            f"{len(blocking)} host sync(s) over {steps} decode steps, in steps "
            f"{_steps_text(steps_hit)}; first in {first.phase}: {first.describe()}",
            tag=case.tag,
            metrics=metrics,
            evidence=evidence,
        )
    atol, rtol = TOLERANCES[case.spec.dtype]
    failing, details = loop.first_failing_step(atol, rtol)
    if failing is not None:
        evidence["worst"] = details.get("worst")
        return CaseResult(
            case.id,
            Verdict.FAIL,
            f"decode step {failing} of {steps} differs from the oracle "
            f"({details['mismatched']} elements, max abs error {details['max_abs_error']:.3g}, worst at "
            f"{worst_place(details['worst'])}); every step before it was right",
            tag=case.tag,
            metrics={**metrics, "first_failing_step": failing},
            evidence=evidence,
        )
    growth = metrics["memory_growth_bytes"]
    if growth > GROWTH_BYTES:
        return CaseResult(
            case.id,
            Verdict.FAIL,
            f"device memory held after a step grew by {growth / 2**20:.1f} MiB over "
            f"{steps - WARM_STEPS} steady decode steps (first past {GROWTH_BYTES >> 20} MiB at step "
            f"{metrics['memory_growth_step']}): a leak, or a buffer regrown and kept",
            tag=case.tag,
            metrics=metrics,
            evidence=evidence,
        )
    measured = "no host sync, " if watch_syncs else ""
    return CaseResult(
        case.id,
        Verdict.PASS,
        f"{steps} decode steps: {measured}every step equal to the oracle, device memory "
        f"flat ({metrics['steady_allocations_per_step']:.1f} allocations and "
        f"{metrics['steady_new_segments']} new segments over the steady steps)",
        tag=case.tag,
        metrics=metrics,
        evidence=evidence,
    )


def _memory_metrics(after: list[dict[str, int]], steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    warm = after[min(WARM_STEPS, steps) - 1]
    held = [counters["allocated_bytes"] - warm["allocated_bytes"] for counters in after]
    growth_step = next((step for step, grown in enumerate(held) if step >= WARM_STEPS and grown > GROWTH_BYTES), None)
    segment_steps = [step for step in range(WARM_STEPS, steps) if after[step]["segments"] > after[step - 1]["segments"]]
    metrics = {
        "steps": steps,
        "memory_growth_bytes": max(held[WARM_STEPS:], default=0),
        "memory_growth_step": growth_step,
    }
    return metrics, ({"new_segment_steps": segment_steps[:MAX_EVENTS_KEPT]} if segment_steps else {})


def _step_of(event) -> int:
    """The step of an event recorded in phase ``"step N: call"``."""
    return int(event.phase.split()[1].rstrip(":"))


def _steps_text(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:8]))
    return shown + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")


def _phase(detector, name: str):
    return detector.phase(name) if detector is not None else contextlib.nullcontext()


class SteadyCheck(Check):
    name = "steady"
    question = f"{STEPS} consecutive decode steps: no host sync, no memory growth, every step right?"
    evidence_labels = {"new_segment_steps": "steady steps in which PyTorch's allocator made a new segment"}
    sync_event_labels = {"syncs": "host syncs", "device_allocations": "device allocations in steady steps (reported)"}

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.covered: dict[tuple, str] = {}

    def skip_reason(self, backend_cls: type[AttentionBackend], device: torch.device) -> str | None:
        if device.type != "cuda":
            return "host syncs and device memory exist only on a CUDA device (run with --device cuda)"
        return None

    def details(self) -> dict[str, Any]:
        return {"steps": STEPS, "warm_steps": WARM_STEPS, "growth_bytes": GROWTH_BYTES}

    def case_skip_reason(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> str | None:
        if any(query != 1 for _, query in case.batch) or not 1 <= case.num_reqs <= MAX_REQUESTS:
            return f"the steady look starts from decode batches (query length 1) of at most {MAX_REQUESTS} requests"
        key = (case.spec.kind, case.spec.kv_cache_dtype if case.spec.fp8_kv_cache else None)
        if key in self.covered:
            return f"steady look covered by {self.covered[key]}"
        reason = super().case_skip_reason(backend_cls, case, device)
        if reason:
            return reason
        self.covered[key] = case.id
        return None

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> CaseResult:
        return steady_look(backend_cls, case, device, strategy=self.options.get("sync_detector", "auto"))
