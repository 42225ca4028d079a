"""graphs: captured once for batch A, replayed for batches B1..Bn — still right?

Driven by the claimed CGSupport (NEVER → SKIP). Eager warm-up, ``build_for_capture``, capture of
``write_kv`` + ``forward``; then for each B: load it into the same buffers, ``build`` (as engines
do before each replay), replay, and compare with the oracle and with an eager run. After each
replay the cache must equal the cache before it plus the batch's own rows, bit for bit (padding
rows write nothing), and two replays of one state are compared for determinism (information).
"""
from __future__ import annotations

from typing import Any

import torch

from backends.base import AttentionBackend
from conformance.cases import Case
from conformance.checks.base import Check
from conformance.checks.numerics import TOLERANCES, compare_with_oracle
from conformance.graph_batches import graph_class_reason, graph_shape, replay_batches
from conformance.graph_harness import GraphBuffers, cuda_graph_skip_reason, graph_pool_bytes, warm_up
from conformance.host_syncs.detector import detect_host_syncs
from conformance.results import CaseResult, Verdict


def capture_failure_cause(error: BaseException, detector) -> str:
    blocking = detector.blocking_events if detector else []
    if blocking:
        return f"{blocking[0].describe()} during capture ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
    allocations = [e for e in (detector.events if detector else []) if e.kind == "device-alloc"]
    if allocations:
        return f"a raw device allocation during capture: {allocations[0].describe()}"
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"


class GraphsCheck(Check):
    name = "graphs"
    question = "capture with batch A, replay with B1..Bn: equal to eager and to the oracle?"

    def skip_reason(self, backend_cls: type[AttentionBackend], device: torch.device) -> str | None:
        return cuda_graph_skip_reason(backend_cls, device)

    def case_skip_reason(self, backend_cls, case: Case, device) -> str | None:
        return super().case_skip_reason(backend_cls, case, device) or graph_class_reason(
            backend_cls.capabilities.cuda_graphs, case
        )

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> CaseResult:
        support = backend_cls.capabilities.cuda_graphs
        with_host_lengths = backend_cls.capabilities.needs_cpu_seq_lens
        replays = replay_batches(case, support)
        shape = graph_shape(case, replays)
        buffers = GraphBuffers(backend_cls, shape, [case] + [r.case for r in replays], device)
        loaded = buffers.load(case, with_host_lengths=with_host_lengths)

        def eager_step() -> None:
            buffers.step(buffers.backend.build(loaded.common))

        warm_up(eager_step)
        graph = torch.cuda.CUDAGraph()
        metrics: dict[str, Any] = {"padded_reqs": shape.num_reqs, "padded_tokens": shape.num_tokens, "replays": len(replays)}
        detector = None
        try:
            metadata = buffers.backend.build_for_capture(loaded.common)
            # Only the backend's calls are watched: torch.cuda.graph synchronizes around a capture.
            with detect_host_syncs("auto", only_in_phases=True) as detector:
                with torch.cuda.graph(graph), detector.phase("capture"):
                    buffers.step(metadata)
        except Exception as error:  # noqa: BLE001 - a capture failure is the finding
            torch.cuda.synchronize()
            cause = capture_failure_cause(error, detector)
            return CaseResult(case.id, Verdict.FAIL, f"capture failed: {cause}", tag=case.tag, metrics=metrics,
                              evidence={"capture_events": [e.to_dict() for e in (detector.events if detector else [])][:10]})
        metrics["graph_pool_bytes"] = graph_pool_bytes(graph)

        atol, rtol = TOLERANCES[case.spec.dtype]
        nondeterministic = []
        for index, replay in enumerate([None] + replays):
            replay_case = case if replay is None else replay.case
            what = "A itself" if replay is None else f"B{index} ({replay.description})"
            loaded = buffers.load(replay_case, with_host_lengths=with_host_lengths)
            buffers.backend.build(loaded.common)
            before = buffers.kv_cache.clone()
            graph.replay()
            torch.cuda.synchronize()
            replayed = buffers.out[: loaded.real_tokens].clone()
            reference = loaded.batch.reference_output()
            passed, errors, evidence = compare_with_oracle(replayed, reference, loaded.batch.query_start_loc, atol, rtol)
            if not passed:
                worst = evidence["worst"]
                reason = (f"replay of {what} differs from the oracle: {errors['mismatched']} elements, max abs error "
                          f"{errors['max_abs_error']:.3g}, worst at request {worst['request']} token {worst['token']} head {worst['head']}")
                return self._fail(case, reason, metrics, replay_case, errors, evidence)
            expected_cache = buffers.expected_cache_after(before, loaded)
            stray = int((buffers.kv_cache != expected_cache).sum())
            if stray:
                reason = f"replay of {what} changed {stray} cache elements outside the batch's own slots (padding rows must write nothing)"
                return self._fail(case, reason, metrics, replay_case, {}, {})
            # Eager on the same state, and a second replay of it (determinism, information only).
            buffers.step(buffers.backend.build(loaded.common))
            torch.cuda.synchronize()
            eager = buffers.out[: loaded.real_tokens].clone()
            metrics.setdefault("max_abs_diff_replay_vs_eager", 0.0)
            metrics["max_abs_diff_replay_vs_eager"] = max(
                metrics["max_abs_diff_replay_vs_eager"], float((eager.float() - replayed.float()).abs().max())
            )
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(buffers.out[: loaded.real_tokens], replayed):
                nondeterministic.append(what)
        metrics["deterministic"] = not nondeterministic
        reason = f"{len(replays)} replays equal to the oracle; cache untouched outside each batch's slots"
        if nondeterministic:
            reason += f"; two replays of one state differ bitwise ({nondeterministic[0]})"
        return CaseResult(case.id, Verdict.PASS, reason, tag=case.tag, metrics=metrics)

    def _fail(self, case, reason, metrics, replay_case, errors, evidence) -> CaseResult:
        return CaseResult(case.id, Verdict.FAIL, reason, tag=case.tag, metrics={**metrics, **errors},
                          evidence={**evidence, "failing_batch": replay_case.id})
