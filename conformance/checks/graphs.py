"""graphs: captured once for batch A, replayed for batches B1..Bn — still right?

Driven by the claimed CGSupport (NEVER → SKIP). Each graph holds two layers over one metadata
(``harness.graphs.GraphLayer``: each its own pool, fp8 scales, learned sinks and buffers; a
``bigpool`` case's one), and every replay judges both; on an ``lse`` case each layer's LSE buffer
is refilled with NaN before every replay and judged against the oracle's (``lse_pass.judge_lse``).
Three captures per case (four where the backend claims vLLM's empty requests), each a way
engines really meet a backend:

1. **Warm-up, capture, replays.** Eager warm-up, ``build_for_capture``, capture of ``write_kv`` +
   ``forward``; then for each B — longer and shorter contexts, new block tables, fewer requests,
   requests reversed (another one last), one more request so no padding row is left (the last row
   real), query lengths moved — load it into the same buffers, ``build`` (as engines do before each
   replay), replay, and compare with the oracle and with an eager run. Every other replay (B1,
   B3, …) runs with NaN in every slot no request owns: a captured kernel that reads such a slot
   and weights it by zero (a tile count or bound frozen at capture) turns its output NaN. The
   padding's query rows hold NaN and huge values of either sign (``step.padding_queries``), as an
   engine's persistent query buffer holds whatever earlier steps left there: a backend whose real
   rows take something from every request's tokens (a dynamic query scale over the step) takes it
   from the padding requests' rows too, which the numerics check's padding (rows past every
   request) never shows. After each replay the cache must equal the cache before it plus the
   batch's own rows, bit for bit (padding rows write nothing). Two replays of one state must be
   bitwise equal when the backend claims ``deterministic`` (otherwise that is reported).
2. **A new, larger shape after the capture.** An eager step at twice the requests and longer
   contexts, never seen before; then every free block of the caching allocator is filled with NaN
   bytes (whatever the backend freed is now someone else's) and the graph replays again: a
   backend that grew a workspace and left the graph pointing at the old one fails here — by
   reading NaN, by stale contents, or by writing into the canaries.
3. **Capture as the first call.** A fresh backend instance captures A before it has run anything:
   a backend that initialises lazily on its first call (a host sync, an autotuning run, a
   workspace sized on first use) does it inside the capture. A must then replay right. This comes
   last on purpose: by then the *process* is warm (cuBLAS handles, kernels loaded and compiled),
   as in an engine that captures after its profiling run, so only the instance's own laziness
   is tested.
4. **Capture over empty requests only.** Where the backend claims vLLM's empty requests and graphs of
   any batch (ALWAYS: a uniform graph is captured for its own query length), a fresh
   instance captures a batch in which every request is one (query and sequence length 0, block-table
   rows -1: what an engine's warm-up and dummy captures hand it; vLLM #51970 is an illegal access
   captured over all-zero indexer lengths), then A is loaded, built and replayed: a backend that
   sizes a grid, a split count or a bound from the lengths it was captured over computes nothing,
   or reads out of bounds, for every real batch after.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch

from backends.base import AttentionBackend, CGSupport
from backends.features import EMPTY_REQUESTS
from conformance.cases.grammar import Case
from conformance.checks.base import EVERY_KIND, Check
from conformance.harness.answers import answer_for
from conformance.harness.batch import PagedBatch, materialize
from conformance.harness.comparison import TOLERANCES
from conformance.harness.graph_batches import (
    Replay,
    fits,
    graph_class_reason,
    graph_shape,
    larger_batch,
    replay_batches,
)
from conformance.harness.graphs import (
    CaptureFailed,
    GraphBuffers,
    GraphLayer,
    LoadedBatch,
    canaries_written,
    capture,
    count_different,
    cuda_graph_skip_reason,
    fill_freed_memory,
    graph_pool_bytes,
    step_layers,
    step_with_fresh_metadata,
    warm_up,
)
from conformance.harness.lse_pass import judge_lse
from conformance.harness.step import PoolFill, run_step
from conformance.harness.stored_cache import oracle
from conformance.results import Outcome, Verdict


class GraphsCheck(Check):
    name = "graphs"
    kinds = EVERY_KIND
    drives_trees = True  # the buffers hold the step's trees; one replay hands other trees (graph_batches)
    question = (
        "capture with batch A (also as the first call, and before a larger "
        "shape), replay with B1..Bn: equal to eager and to the oracle?"
    )

    evidence_labels = {"failing_batch": "failing replay batch"}
    sync_event_labels = {"capture_events": "during capture"}

    def skip_reason(self, backend_cls: type[AttentionBackend], device: torch.device) -> str | None:
        return cuda_graph_skip_reason(backend_cls, device)

    def case_skip_reason(self, backend_cls, case: Case, device) -> str | None:
        return super().case_skip_reason(backend_cls, case, device) or graph_class_reason(
            backend_cls.capabilities.cuda_graphs, case
        )

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        try:
            return self._run_case(backend_cls, case, device)
        finally:
            self.drawn = {}  # device memory of the case's batches goes with the case

    def _run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        support = backend_cls.capabilities.cuda_graphs
        self.host_lengths = backend_cls.capabilities.needs_cpu_seq_lens
        replays = replay_batches(case, support)
        larger = larger_batch(case)
        shape = graph_shape(case, replays, extra=(larger,))
        replays = [r for r in replays if fits(shape, r.case)]
        all_cases = [case, larger] + [r.case for r in replays]
        metrics: dict[str, Any] = {
            "padded_reqs": shape.num_reqs,
            "padded_tokens": shape.num_tokens,
            "replays": len(replays),
        }
        atol, rtol = TOLERANCES[case.spec.dtype]
        self.tolerance = (atol, rtol)

        # A and the first replay are loaded more than once: each is drawn and solved by the oracle once.
        self.drawn = {c: materialize(c, device) for c in {case, *(r.case for r in replays[:1])}}

        # 1. Warm-up, capture, replays.
        layers = dict(layers=step_layers(case), lse=case.lse)
        buffers = GraphBuffers(backend_cls, shape, all_cases, device, **layers)
        loaded = buffers.load(self._batch(case, device), with_host_lengths=self.host_lengths)
        warm_up(functools.partial(step_with_fresh_metadata, buffers, loaded.common))
        try:
            graph = capture(buffers, buffers.backend.build_for_capture(loaded.common))
        except CaptureFailed as failure:
            return Outcome(
                Verdict.FAIL,
                f"capture failed: {failure}",
                metrics=metrics,
                evidence={"capture_events": failure.events},
            )
        metrics["graph_pool_bytes"] = graph_pool_bytes(graph)
        nondeterministic = []
        for index, replay in enumerate([None] + replays):
            replay_case = case if replay is None else replay.case
            what = "A itself" if replay is None else f"B{index} ({replay.description})"
            # Every other replay over NaN: a slot it reads and weights by zero turns its output NaN.
            fill = PoolFill.NAN if index % 2 else PoolFill.LOUD
            what += ", NaN in every unowned slot" if fill == PoolFill.NAN else ""
            problem = self._replay(
                buffers, graph, replay_case, what, metrics=metrics, nondeterministic=nondeterministic, fill=fill
            )
            if problem:
                return self._fail(case, problem, metrics)
        metrics["deterministic"] = not nondeterministic
        if nondeterministic and backend_cls.capabilities.deterministic:
            return self._fail(
                case,
                (
                    f"claims deterministic, but two replays of one state differ bitwise ({nondeterministic[0]})",
                    None,
                    {},
                    {},
                ),
                metrics,
            )

        # 2. An eager step at a larger shape never seen, freed memory taken by NaN canaries, replay.
        problem = self._eager(buffers, larger, "an eager step at a larger, new shape after the capture")
        if problem:
            return self._fail(case, problem, metrics)
        canaries = fill_freed_memory(device)
        replay = replays[0] if replays else Replay("A", case)
        problem = self._replay(
            buffers, graph, replay.case, f"{replay.description}, after an eager step at a larger shape"
        )
        written = canaries_written(canaries)
        del canaries
        if problem:
            return self._fail(case, problem, metrics)
        if written:
            return self._fail(
                case,
                (
                    f"the graph replayed after an eager step at a larger shape wrote {written} bytes "
                    "into memory the backend had freed (a workspace reallocated after the capture?)",
                    None,
                    {},
                    {},
                ),
                metrics,
            )

        del graph, buffers
        # 3. Capture as the very first call of a fresh backend instance (the process is warm now).
        first = GraphBuffers(backend_cls, shape, all_cases, device, **layers)
        loaded = first.load(self._batch(case, device), with_host_lengths=self.host_lengths)
        failed = self._fresh_capture(first, loaded.common, case, metrics, "as the backend's first call")
        if failed:
            return failed
        del first

        # 4. Captured over empty requests only (every length 0), then A: where the backend claims
        #    vLLM's empty requests and graphs of any batch, whose dummy captures hand it such batches.
        idle_capture = support == CGSupport.ALWAYS and backend_cls.capabilities.supports(EMPTY_REQUESTS)
        if idle_capture:
            idle = GraphBuffers(backend_cls, shape, all_cases, device, **layers)
            common = idle.load_idle(with_host_lengths=self.host_lengths)
            failed = self._fresh_capture(idle, common, case, metrics, "over empty requests only (every length 0)")
            if failed:
                return failed

        reason = (
            f"{len(replays)} replays equal to the oracle (also captured as the first call"
            + (", captured over empty requests only" if idle_capture else "")
            + ", and replayed after a larger eager shape); cache untouched outside each batch's slots"
        )
        if nondeterministic:
            reason += f"; two replays of one state differ bitwise ({nondeterministic[0]}; determinism not claimed)"
        return Outcome(Verdict.PASS, reason, metrics=metrics)

    def _fresh_capture(self, buffers: GraphBuffers, common, case: Case, metrics, how: str) -> Outcome | None:
        """A fresh instance's capture over ``common`` (``how`` says which), then A loaded, built
        and replayed in it; None when right, else the case's FAIL."""
        try:
            graph = capture(buffers, buffers.backend.build_for_capture(common))
        except CaptureFailed as failure:
            return Outcome(
                Verdict.FAIL,
                f"capture {how} failed: {failure}",
                metrics=metrics,
                evidence={"capture_events": failure.events},
            )
        problem = self._replay(buffers, graph, case, f"A, captured {how}")
        return self._fail(case, problem, metrics) if problem else None

    def _replay(
        self,
        buffers: GraphBuffers,
        graph,
        replay_case: Case,
        what: str,
        *,
        metrics=None,
        nondeterministic=None,
        fill: PoolFill | None = None,
    ):
        """Load, build, replay, compare every layer; None when right, else (reason, failing case,
        errors, evidence)."""
        loaded = buffers.load(self._batch(replay_case, buffers.device), with_host_lengths=self.host_lengths, fill=fill)
        watch = buffers.watch(loaded.common)
        buffers.backend.build(loaded.common)
        watch.called("build")
        # Each layer's cache before the replay (its own rows are added below); its output and LSE
        # unwritten, so a replay that computes nothing cannot pass on an earlier step's numbers.
        expected_caches = [layer.kv_cache.clone() for layer in buffers.layers]
        buffers.clear_outputs()
        graph.replay()
        watch.called("the replay")
        torch.cuda.synchronize()
        changed = watch.changes()
        if changed:
            return (
                f"replay of {what}: the backend changed an input it was handed: {'; '.join(changed)}",
                replay_case,
                {},
                {},
            )
        for layer, expected_cache in zip(buffers.layers, expected_caches):
            problem = self._layer_problem(buffers, layer, loaded, expected_cache, what, replay_case)
            if problem:
                return problem
        del expected_caches
        if metrics is None:
            return None
        # Eager on the same state, and a second replay of it (determinism).
        canonical = answer_for(buffers.spec).canonical  # an indexer's choice: a set, in any order
        replayed = canonical(buffers.out[: loaded.real_tokens].clone())
        buffers.step(buffers.backend.build(loaded.common))
        torch.cuda.synchronize()
        eager = canonical(buffers.out[: loaded.real_tokens].clone())
        metrics["max_abs_diff_replay_vs_eager"] = max(
            metrics.get("max_abs_diff_replay_vs_eager", 0.0), float((eager.float() - replayed.float()).abs().max())
        )
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(canonical(buffers.out[: loaded.real_tokens]), replayed):
            nondeterministic.append(what)
        return None

    def _layer_problem(
        self,
        buffers: GraphBuffers,
        layer: GraphLayer,
        loaded: LoadedBatch,
        expected_cache: torch.Tensor,
        what: str,
        replay_case: Case,
    ):
        """One layer of a replay: its output and (where asked) its LSE against the oracle, its
        cache against the cache before plus the batch's own rows."""
        atol, rtol = self.tolerance
        real = loaded.real_tokens
        which = f"{what}, layer {layer.index} (its own pool, scales and sinks)" if layer.index else what
        prepared = buffers.prepared(loaded.batch, layer)
        reference, allowance = oracle(prepared, negated=layer.negated)
        answer = answer_for(prepared.batch.spec)
        passed, errors, evidence = answer.compare(
            layer.out[:real], reference, loaded.batch.query_start_loc, atol, rtol, allowance
        )
        if not passed:
            return (
                f"replay of {which} differs from the oracle: {answer.count(errors)}, worst at "
                f"{answer.worst_place(evidence['worst'])}",
                replay_case,
                errors,
                evidence,
            )
        if layer.lse is not None:
            problem, _ = judge_lse(prepared, layer.lse[:real], negated=layer.negated)
            if problem:
                return (
                    f"replay of {which}: {problem} (the LSE buffer held NaN before the replay)",
                    replay_case,
                    {},
                    {},
                )
        buffers.add_step_rows(expected_cache, loaded, layer)
        stray = count_different(layer.kv_cache, expected_cache)
        if stray:
            return (
                f"replay of {which} changed {stray} cache elements outside "
                "the batch's own slots (padding rows must write nothing)",
                replay_case,
                {},
                {},
            )
        return None

    def _batch(self, case: Case, device: torch.device) -> PagedBatch:
        return self.drawn.get(case) or materialize(case, device)

    def _eager(self, buffers: GraphBuffers, larger: Case, what: str):
        """One eager step of ``larger`` on the graph's backend and cache, checked against the oracle."""
        atol, rtol = self.tolerance
        batch = materialize(replace(larger, padding=0), buffers.device)
        key, value, slots = batch.history_rows()
        if slots.numel():
            buffers.backend.write_kv(buffers.kv_cache, key, value, slots, layer=buffers.layer)
        prepared = buffers.prepared(batch)
        out = run_step(prepared, with_host_lengths=self.host_lengths)
        torch.cuda.synchronize()
        reference, allowance = oracle(prepared)
        passed, errors, evidence = answer_for(batch.spec).compare(
            out, reference, batch.query_start_loc, atol, rtol, allowance
        )
        if passed:
            return None
        return (
            f"{what} differs from the oracle: {errors['mismatched']} "
            f"elements, max abs error {errors['max_abs_error']:.3g}",
            batch.case,
            errors,
            evidence,
        )

    def _fail(self, case, problem, metrics) -> Outcome:
        reason, failing_case, errors, evidence = problem
        evidence = dict(evidence)
        if failing_case is not None:
            evidence["failing_batch"] = failing_case.id
        return Outcome(Verdict.FAIL, reason, metrics={**metrics, **errors}, evidence=evidence)
