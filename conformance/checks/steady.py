"""steady: 256 steps of continuous batching, as a serving engine's async spec-decode loop runs
them: requests finish and others join (several at once, or one in the place of another, so that
the number of requests goes up and down and also stays the same while the requests change), and
each step's query lengths are decode (1) or spec-verify (k + 1), as the backend's claims allow,
mixed within a step unless it takes only uniform batches (``harness.continuous_batch``).
``build``, ``write_kv``, ``forward``, eagerly, the backend handed the first rows of persistent
buffers, with host lengths only where it claims it needs them (as under async scheduling).

A joining request arrives with its context in the pool, written through ``write_kv`` before its
first step as its prefill left it, not as a prefill row of a mixed step: a decode-only or
uniform-only backend serves no prefill (an engine sends those to a companion backend), each step
stays within the limits one backend instance was built for, and what is asked here is whether the
backend's state follows the batch from step to step; prefill numerics are numerics'.

A backend that misbehaves only now and then passes every check that watches one step: a host-side
cache refreshed every Nth step, a sync or an allocation on some steps only, a workspace regrown
as the contexts grow, memory that creeps up. A fixed batch (every request one token longer each
step) hides more: a backend that re-plans, with a host sync, only when the number of requests
changes, or reuses a plan when the batch's shape (requests, tokens) comes back with other
requests in it, or writes its log-sum-exp only on the steps it re-planned, is right there; in a
serving engine the batch changes nearly every step. Here every step is watched:

* host syncs: the detector records every call of every step but two, the first decode-only step
  and the first with a longer row (``warm_up_steps``: their module loads and compiles, which the
  syncs check's warm-up step allows too; a phase each); any blocking sync is a FAIL naming the
  step and the line;
* every input handed to ``build``, ``write_kv`` and ``forward`` comes back as it went in (the
  input watch, compared after each step: the harness's read, outside the watched calls);
* every step's output against the float64 oracle (the first wrong step is named, with its batch:
  its requests, query and sequence lengths, who joined and who left);
* the log-sum-exp, on every step, where the backend claims ``returns_lse``: ``forward`` is handed
  an ``lse`` buffer refilled with NaN before each step and compared with the oracle's, within
  ``lse_pass``'s tolerance (an fp8 cache's plus how far dequantizing into the compute dtype moves
  it, as for the output);
* the output and lse rows after the ones a step was handed must stay NaN;
* device memory held after each step (``torch.cuda.memory_allocated``): it may not grow past the
  level after the warm-up steps by more than ``GROWTH_BYTES`` (a leak, or a buffer regrown and
  kept); the caching allocator's allocations and new segments per steady step are reported, and
  so is every device allocation the detector saw in a steady step (``cudaMalloc``,
  ``cuMemAlloc``: PyTorch's new segments and a backend's own alike), with its step and line.
  Reported, not failed: PyTorch's allocator may grow a segment as the contexts grow.

Each request's keys are ramped (``ramp_newest_keys``): its newest key outscores every earlier one
at every step, so a length one short fails by far more than the tolerance wherever it happens.

It runs once per attention kind and KV-cache format, on CUDA only (syncs and device memory exist
only there), from the first decode case (query length 1) of at most ``MAX_REQUESTS`` requests:
its requests are the first step's batch, and the joining requests are of its layer, with
contexts near its requests'.

Token trees: once more from the first token-tree case, as an engine verifying EAGLE's trees runs:
its requests start decoding, every step hands the backend trees (``tree_parents``; the host's copy
only where the backend claims it needs host lengths), and each verify row is a tree drawn afresh
(chains, stars and everything between), so a backend that keeps a step's masks for the next one,
or keys them by the batch's shape, is wrong at the step the trees change. The oracle sees each
request's tokens as its steps (``token_tree.visible_in_steps``): a token sees every key written
before its step, and in its step its ancestors, at its step's start + depth.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from backends.base import AttentionBackend
from backends.features import LSE
from conformance.cases.grammar import Case
from conformance.checks.base import EVERY_KIND, Check, Plan, first_of_each
from conformance.harness.answers import answer_for
from conformance.harness.batch import PagedBatch
from conformance.harness.comparison import TOLERANCES
from conformance.harness.continuous_batch import (
    MAX_REQUESTS,
    SPEC_TOKENS,
    ContinuousBatch,
    Schedule,
    continuous_batching,
)
from conformance.harness.lse_pass import LSE_ATOL, LSE_RTOL, lse_allowed
from conformance.harness.step import PreparedCase
from conformance.harness.stored_cache import expected_lse, oracle
from conformance.results import Outcome, Verdict
from host_syncs.detector import detect_host_syncs
from host_syncs.events import DEVICE_ALLOC

STEPS = 256
WARM_STEPS = 16  # lazy initialisation and JIT compiles happen here; memory is measured from here on
GROWTH_BYTES = 1 << 20
MAX_EVENTS_KEPT = 10


def ramp_newest_keys(batch: PagedBatch) -> None:
    """Each request's keys over its steps outscore every earlier one: probe channel ``j + 1`` for
    its ``j``-th new token (exact integers up to 256 in every dtype: a request is handed at most
    ``continuous_batch.MAX_BUDGET`` tokens; the probe query makes a unit about one logit), so a
    step that misses its newest key (a length one short, a stale copy of the lengths) is wrong by
    far more than the tolerance at every step, not only at the first few that edges data shape. An
    fp8 cache could not store the ramp: its look watches syncs and memory, its outputs less
    sharply."""
    spec = batch.case.spec
    if spec.fp8_kv_cache:
        return
    probe = spec.head_dim - 1
    for key, (context, steps) in zip(batch.keys, batch.case.batch):
        ramp = torch.arange(1, steps + 1, dtype=key.dtype, device=key.device)
        key[context : context + steps, ..., probe] = ramp.view(-1, *([1] * (key.dim() - 2)))


def warm_up_steps(schedule: Schedule) -> frozenset[int]:
    """The steps whose syncs are not counted: the first decode-only step and the first with a
    longer row (verify, a tree, a prefill chunk). A backend's first call of a kernel loads its
    module or JIT-compiles it (a sync each), as the syncs check's warm-up step allows, and a
    backend may pick its kernel by that kind of batch (FlashInfer's trtllm entry point: XQA's
    decode kernel, or its speculative-decoding one, loaded at its first verify step); an engine's
    warm-up runs both kinds (vLLM captures uniform-decode and mixed batches). Without this the
    verdict would depend on what the process had run before (a fresh process fails, one that had
    run the numerics check first passes). Every other step's syncs count, so a sync that comes
    back whenever the batch changes shows in the many changes after these two."""
    first: dict[bool, int] = {}
    for index, step in enumerate(schedule.steps):
        first.setdefault(max(step.query_lens) > 1, index)
    return frozenset(first.values())


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
    backend_cls: type[AttentionBackend],
    case: Case,
    device: torch.device,
    steps: int = STEPS,
    strategy: str = "auto",
    schedule: Schedule | None = None,
) -> Outcome:
    """``steps`` steps of continuous batching from ``case``'s requests (or ``schedule``'s steps:
    ``continuous_batch.fixed_batch`` is one batch decoding), each watched; the verdict and its
    evidence."""
    capabilities = backend_cls.capabilities
    if schedule is None:
        schedule = continuous_batching(case, steps, capabilities, trees=bool(case.trees))
    steps = len(schedule.steps)
    loop = ContinuousBatch(backend_cls, case, schedule, device, shape_steps=ramp_newest_keys)
    buffers, backend = loop.buffers, loop.buffers.backend
    with_lse = capabilities.supports(LSE)
    after: list[dict[str, int]] = []
    watch_syncs = device.type == "cuda"
    detector = detect_host_syncs(strategy, only_in_phases=True) if watch_syncs else None
    changed: list[str] = []
    inside = {"allocations": 0, "segments": 0}  # the caching allocator's counts inside the backend's calls only

    unwatched = warm_up_steps(schedule)

    def watched(step: int, name: str, watch, call):
        before = memory_counters(device)
        with _phase(detector if step not in unwatched else None, f"step {step}: {name}"):
            result = call()
        now = memory_counters(device)
        if step >= WARM_STEPS:
            for key in inside:
                inside[key] += now[key] - before[key]
        watch.called(name)
        return result

    with detector if detector is not None else contextlib.nullcontext():
        for step in range(steps):
            common = loop.load(step, lengths_known=capabilities.needs_cpu_seq_lens)
            handed = loop.handed(step)
            layer = buffers.forward_layer.with_lse(handed["lse"]) if with_lse else buffers.forward_layer
            watch = buffers.watch(common)  # every input must come back as it went in, at every step
            metadata = watched(step, "build", watch, lambda: backend.build(common))
            watched(
                step,
                "write_kv",
                watch,
                lambda: backend.write_kv(
                    buffers.kv_cache, handed["key"], handed["value"], handed["slot_mapping"], layer=buffers.layer
                ),
            )
            watched(
                step,
                "forward",
                watch,
                lambda: backend.forward(handed["query"], buffers.kv_cache, metadata, handed["out"], layer=layer),
            )
            loop.finish_step(step)
            changed = [f"step {step}: {change}" for change in watch.changes()]  # the harness's read: outside the phases
            del watch
            after.append(memory_counters(device))
            if changed:
                break
    if changed:
        return Outcome(
            Verdict.FAIL,
            f"the backend changed an input it was handed: {'; '.join(changed)}",
            metrics={"steps": len(after)},
            evidence={"failing_step_batch": schedule.describe(len(after) - 1)},
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    summary = schedule.summary()
    metrics, evidence = _memory_metrics(after, steps)
    metrics.update({key: summary[key] for key in SCHEDULE_METRICS})
    metrics["lse_checked"] = with_lse
    evidence["sync_warm_up_steps"] = sorted(unwatched)
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
        evidence["failing_step_batch"] = schedule.describe(steps_hit[0])
        return Outcome(
            Verdict.FAIL,
            f"{len(blocking)} host sync(s) over {steps} steps, in steps "
            f"{_steps_text(steps_hit)}; first in {first.phase}: {first.describe()}",
            metrics=metrics,
            evidence=evidence,
        )
    prepared = buffers.prepared(loop.batch)
    atol, rtol = TOLERANCES[case.spec.dtype]

    def failed_at(step: int, reason: str) -> Outcome:
        """The verdict for the first step that went wrong, with its batch."""
        evidence["failing_step_batch"] = schedule.describe(step)
        metrics_now = {**metrics, "first_failing_step": step}
        return Outcome(Verdict.FAIL, reason, metrics=metrics_now, evidence=evidence)

    reference, allowance = oracle(prepared)
    answer = answer_for(case.spec)
    failing = loop.first_bad_step(answer.mismatched_rows(loop.out_bank, reference, allowance, atol, rtol))
    if failing is not None:
        rows = loop.step_rows(failing)
        _, errors, found = answer.compare(
            loop.out_bank.index_select(0, rows),
            reference.index_select(0, rows.to(reference.device)),
            loop.host_starts[failing],
            atol,
            rtol,
            None if allowance is None else allowance.index_select(0, rows.to(allowance.device)),
        )
        evidence["worst"] = found["worst"]
        return failed_at(
            failing,
            f"step {failing} of {steps} differs from the oracle ({answer.count(errors)}, worst at "
            f"{answer.worst_place(found['worst'])}; "
            f"{_batch_text(schedule, failing)}); every step before it was right",
        )
    spill = loop.first_spill(steps)
    if spill is not None:
        step, what = spill
        return failed_at(
            step,
            f"step {step} of {steps}: forward wrote {what} rows past the {schedule.steps[step].num_tokens} it was "
            "handed (the rows after them in the same buffer must stay as they were)",
        )
    if with_lse:
        problem, lse_metrics = _lse_problem(loop, prepared, steps)
        metrics.update(lse_metrics)
        if problem is not None:
            return failed_at(*problem)
    growth = metrics["memory_growth_bytes"]
    if growth > GROWTH_BYTES:
        return Outcome(
            Verdict.FAIL,
            f"device memory held after a step grew by {growth / 2**20:.1f} MiB over "
            f"{steps - WARM_STEPS} steady steps (first past {GROWTH_BYTES >> 20} MiB at step "
            f"{metrics['memory_growth_step']}): a leak, or a buffer regrown and kept",
            metrics=metrics,
            evidence=evidence,
        )
    measured = "no host sync, " if watch_syncs else ""
    checked_lse = ", its log-sum-exp too" if with_lse else ""
    return Outcome(
        Verdict.PASS,
        f"{steps} steps ({_schedule_text(summary)}): {measured}every step equal to the oracle{checked_lse}, "
        f"device memory flat ({metrics['steady_allocations_per_step']:.1f} allocations and "
        f"{metrics['steady_new_segments']} new segments over the steady steps)",
        metrics=metrics,
        evidence=evidence,
    )


SCHEDULE_METRICS = (
    "requests_seen",
    "joins",
    "leaves",
    "steps_same_count_other_requests",
    "requests_per_step",
    "query_lens",
    "steps_with_mixed_query_lens",
    "max_tokens_per_step",
)


def _lse_problem(
    loop: ContinuousBatch, prepared: PreparedCase, steps: int
) -> tuple[tuple[int, str] | None, dict[str, Any]]:
    """(the first step whose log-sum-exp is beyond ``lse_pass.lse_allowed`` (NaN: not written) and
    what is wrong there, or None; metrics)."""
    expected = expected_lse(prepared)
    allowed = lse_allowed(prepared, expected)
    got = loop.lse_bank.double()
    error = (got - expected).abs()
    bad = ~(error <= allowed)  # NaN counts as bad
    metrics = {"lse_max_abs_error": float(error.nan_to_num(float("inf")).max()) if error.numel() else 0.0}
    step = loop.first_bad_step(bad.any(dim=1))
    if step is None:
        return None, metrics
    rows = loop.rows_of_step[step]
    step_bad = bad[rows]
    token, head = divmod(int(step_bad.flatten().nonzero()[0]), step_bad.shape[1])
    starts = loop.host_starts[step]
    request = max(r for r in range(len(starts) - 1) if starts[r] <= token)
    value = float(got[rows[token], head])
    shown = "NaN (not written)" if value != value else f"{value:.6g}"
    text = (
        f"step {step} of {steps}: lse: {int(step_bad.sum())} of {step_bad.numel()} beyond |Δ| <= {LSE_ATOL:g} + "
        f"{LSE_RTOL:g}·|lse| + the query's rounding (natural log); first at request {request} token "
        f"{token - starts[request]} head {head}: got {shown}, expected {float(expected[rows[token], head]):.6g} "
        f"(allowed {float(allowed[rows[token], head]):.3g}; {_batch_text(loop.schedule, step)}); every step "
        "before it was right"
    )
    return (step, text), metrics


def _batch_text(schedule: Schedule, step: int) -> str:
    """A step's batch in words: its requests and query lengths, who joined and who left."""
    described = schedule.describe(step)
    text = f"its batch {len(described['requests'])} requests, query lengths {_lengths(described['query_lens'])}"
    if described["joined"]:
        text += f", {len(described['joined'])} just joined"
    if described["left"]:
        text += f", {len(described['left'])} just left"
    return text


def _lengths(values: list[int]) -> str:
    return ",".join(map(str, values))


def _schedule_text(summary: dict[str, Any]) -> str:
    low, high = summary["requests_per_step"]
    requests = f"{low}" if low == high else f"{low} to {high}"
    return (
        f"{summary['joins']} joins, {summary['leaves']} leaves, {requests} requests a step, query lengths "
        f"{_lengths(summary['query_lens'])}"
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
    case_seconds = 24.0  # the mean case on one H200, six backends side by side on it
    kinds = EVERY_KIND
    question = (
        f"{STEPS} steps of continuous batching (requests joining and leaving, decode and spec-verify "
        "query lengths): no host sync, inputs unchanged, no memory growth, every step right?"
    )
    evidence_labels = {
        "new_segment_steps": "steady steps in which PyTorch's allocator made a new segment",
        "sync_warm_up_steps": "the steps whose syncs are not counted (the first decode-only, the first with longer "
        "rows)",
        "failing_step_batch": "the failing step's batch (requests by row, query and sequence lengths, joined, left)",
    }
    sync_event_labels = {"syncs": "host syncs", "device_allocations": "device allocations in steady steps (reported)"}

    def skip_reason(self, backend_cls: type[AttentionBackend], device: torch.device) -> str | None:
        if device.type != "cuda":
            return "host syncs and device memory exist only on a CUDA device (run with --device cuda)"
        return None

    def details(self) -> dict[str, Any]:
        return {
            "steps": STEPS,
            "warm_steps": WARM_STEPS,
            "growth_bytes": GROWTH_BYTES,
            "max_requests": MAX_REQUESTS,
            "verify_query_len": SPEC_TOKENS + 1,
        }

    drives_trees = True  # a tree case's look verifies a tree of its own in every verify row

    @staticmethod
    def _not_decode(case: Case) -> str | None:
        # A tree case's requests start decoding, as an engine's after their prefill.
        decodes = case.trees or all(query == 1 for _, query in case.batch)
        if not decodes or not 1 <= case.num_reqs <= MAX_REQUESTS:
            return (
                f"the steady look starts from decode batches (query length 1) of at most {MAX_REQUESTS} requests, "
                "or from a token-tree case's requests"
            )
        return None

    def case_skip_reason(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> str | None:
        return self._not_decode(case) or super().case_skip_reason(backend_cls, case, device)

    def plan(self, backend_cls: type[AttentionBackend], cases: list[Case], device: torch.device) -> Plan:
        """One steady look per attention kind, KV-cache format, sparse or dense layer, tree or chain
        engine and query format: the first decode batch of each that the backend runs."""
        return first_of_each(
            cases,
            lambda case: (
                case.spec.kind,
                case.spec.kv_cache_dtype if case.spec.fp8_kv_cache else None,
                case.spec.sparse_topk is not None,  # a sparse layer is looked at apart from a dense one
                bool(case.trees),  # and a token-tree engine's steps apart from a chain engine's
                case.spec.fp8_query,  # and an fp8 query's (its scale read every step)
            ),
            lambda case: self.case_skip_reason(backend_cls, case, device),
            "steady look covered by {}",
            before=self._not_decode,
        )

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        return steady_look(backend_cls, case, device, strategy=self.options.get("sync_detector", "auto"))
