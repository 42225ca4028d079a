"""numerics: is the backend's output equal to the float64 oracle on every case it supports?

Each case is stepped four times over the same batch (``comparison`` says what "equal" means):

1. **Loud poison**: every slot no request owns holds a dominant key and a loud value, so a read
   of one whose value is used pulls the output far off.
2. **NaN poison** (``nan_poison``): those slots hold NaN, so a read of one whose value is then
   multiplied by a zero weight turns the output NaN where the loud pass saw nothing; and the pool
   must change in the step's own slots only.
3. **A second layer**: engines build a step's metadata once and call ``write_kv`` + ``forward``
   for every layer, each with its own pool, fp8 scales and learned sinks. So the step runs once
   more with the metadata the last pass built (no ``build``), on a new pool holding the first one
   negated, with the query, key and value negated, and the layer's own scales and sinks
   (``layer_batch``, ``case_scales``): the scores are the same, the output must be the first
   layer's negated over its own scales and sinks. A backend that keeps something of the first
   pool (a view, a descriptor, a pointer cached by shape), keeps the first layer's scales or sinks
   (in the metadata, in a copy) or changes the metadata inside ``forward`` fails here. On a GPU this pass runs on
   a side stream kept busy first (``harness.on_a_busy_stream``), where its pool and inputs are
   negated: a backend that launches on another stream than the current one reads them unready.
4. **Two steps in flight**: an async scheduler builds step N+1 while step N is still queued on the
   GPU. So the step is launched again, then the same requests in reverse order are built and
   launched behind it, both on a busy stream (``harness.run_steps_in_flight``): the second build
   runs on the host before anything of the first step has run on the device, its copies from the
   host included. Both must equal the oracle. A backend that stages its metadata in one pinned
   host buffer copied with ``non_blocking=True`` lets the second build overwrite the first step's
   bytes before they are copied (FlashInfer's ``plan`` under an overlap scheduler: mini-sglang
   #103; vLLM #32799, Megatron-LM #5715, TensorRT-LLM #16088); one that reuses a plan cached by
   the batch's shape (its number of requests and tokens) gives the second step the first one's
   lengths. Every other pass builds once per backend, so neither could show there.

A ``dcpN`` case's step is also sharded over N simulated ranks, each rank's forward through a
backend instance of its own over its shard of the KV, and the outputs merged by their LSEs as vLLM
merges them (``dcp``): the merge must equal the oracle.

An ``lse`` case (run by a backend claiming ``returns_lse``) gets, right after the first pass, one
more forward of the same step handed an ``lse`` buffer (``lse_pass``): its log-sum-exp against the
oracle's, and where the layer allows (MHA, no sinks, a cache in the compute dtype), the step cut
into a context piece and a new-token piece merged by their LSEs, as vLLM runs MLA prefill with
context (``lse_merge``).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.base import AttentionBackend, dtype_name
from conformance.cases.grammar import Case
from conformance.checks.base import Check
from conformance.harness.comparison import TOLERANCES, compare_with_oracle, how_far_off, worst_place
from conformance.harness.dcp import dcp_findings
from conformance.harness.error_map import failure_maps
from conformance.harness.lse_merge import merge_applies, merge_findings
from conformance.harness.lse_pass import lse_findings
from conformance.harness.nan_poison import nan_poison_pass
from conformance.harness.step import (
    PreparedCase,
    case_scales,
    during,
    layer_batch,
    prepare_case,
    prepare_layer,
    run_step,
    run_steps_in_flight,
)
from conformance.harness.stored_cache import oracle, write_findings
from conformance.results import Outcome, Verdict

STORED_PASS = "the stored fp8 cache: write_kv's numbers against the contract's quantization"
DCP_PASS = "decode context parallelism: every rank's forward over its shard of the KV, merged by the LSEs"


def second_layer(prepared: PreparedCase) -> PreparedCase:
    """Another layer of the same step, with what a model's next layer has of its own: a copy of
    the pool (for an fp8 layer a pool written with its own scales) and its own learned sinks
    (``layer_batch``, ``case_scales``)."""
    batch = layer_batch(prepared.batch, 1)
    if prepared.scales is None:
        return PreparedCase(batch, prepared.backend, prepared.kv_cache.clone())
    return prepare_layer(batch, prepared.backend, case_scales(batch.case, batch.device, layer=1))


def _scales(layer: PreparedCase) -> str:
    """An fp8 layer's scales as a reason names them (MLA: its cache's one scale; an fp8 query's q)."""
    scales, case = layer.scales, layer.batch.case
    names = []
    if case.kv_scales is not None:
        names += [f"k {scales.k_scale:g}"] + ([f"v {scales.v_scale:g}"] if case.spec.layout.separate_value else [])
    if case.q_scale is not None:
        names.append(f"q {scales.q_scale:g}")
    return ", ".join(names)


class NumericsCheck(Check):
    name = "numerics"
    drives_trees = True  # its step hands the case's trees to the backend and the oracle
    drives_dcp = True  # a dcpN case's step is sharded over its ranks and merged (``harness.dcp``)
    question = (
        "equal to the float64 oracle on every supported case: unowned KV slots loud or NaN, as a second layer, "
        "and with the next step built while it is queued?"
    )

    def details(self) -> dict[str, Any]:
        return {
            "tolerance": "|out - ref| <= atol + rtol * |ref|",
            "tolerances": {dtype_name(dtype): {"atol": a, "rtol": r} for dtype, (a, r) in TOLERANCES.items()},
        }

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        prepared = prepare_case(backend_cls, case, device)
        out = run_step(prepared, with_host_lengths=True)
        reference, allowance = oracle(prepared)
        stored = write_findings(prepared)
        atol, rtol = TOLERANCES[case.spec.dtype]
        passed, metrics, evidence = compare_with_oracle(
            out, reference, prepared.batch.query_start_loc, atol, rtol, allowance
        )
        metrics.update(atol=atol, rtol=rtol)
        if passed and stored:
            return Outcome(
                Verdict.FAIL,
                f"{stored['what']}: {stored['place']}",
                metrics=metrics,
                evidence={"pass": STORED_PASS, "stored": stored.get("worst")},
            )
        if passed:
            # The later passes reuse this batch (its oracle answer too); each returns its failure or None.
            for later_pass in (self._lse, self._dcp, self._nan_poison, self._second_layer, self._steps_in_flight):
                failed = later_pass(prepared, metrics)
                if failed:
                    return failed
            return Outcome(Verdict.PASS, metrics=metrics)
        what = how_far_off(metrics) + (" (unwritten rows stay NaN)" if metrics["non_finite"] else "")
        reason = (
            f"{what}; max abs error {metrics['max_abs_error']:.3g} (atol {atol:g}, rtol {rtol:g}); worst at "
            f"{worst_place(evidence['worst'])}"
        )
        if stored:  # the forward's error may come from what was stored: say both
            reason += f"; and {stored['what']}: {stored['place']}"
        evidence["pass"] = "loud poison: every KV slot no request owns holds a dominant key and a loud value"
        evidence.update(failure_maps(prepared, out, reference, evidence["worst"], atol, rtol, "loud poison"))
        return Outcome(Verdict.FAIL, reason, metrics=metrics, evidence=evidence)

    @staticmethod
    def _lse(prepared: PreparedCase, metrics: dict[str, Any]) -> Outcome | None:
        """For an ``lse`` case: the step's log-sum-exp against the oracle's."""
        if not prepared.batch.case.lse:
            return None
        problem, lse_metrics = lse_findings(prepared)
        metrics.update(lse_metrics)
        if problem is None and merge_applies(prepared):  # and the LSE at work: vLLM's MLA prefill merge
            problem, merge_metrics = merge_findings(prepared)
            metrics.update(merge_metrics)
        if problem is None:
            return None
        return Outcome(
            Verdict.FAIL,
            problem,
            metrics=metrics,
            evidence={"pass": "log-sum-exp: the same step, forward handed an lse buffer"},
        )

    @staticmethod
    def _dcp(prepared: PreparedCase, metrics: dict[str, Any]) -> Outcome | None:
        """For a ``dcpN`` case: the step sharded over N simulated ranks, merged by their LSEs (``dcp``)."""
        if prepared.batch.case.dcp == 1:
            return None
        problem, dcp_metrics = dcp_findings(prepared)
        metrics.update(dcp_metrics)
        if problem is None:
            return None
        return Outcome(Verdict.FAIL, problem, metrics=metrics, evidence={"pass": DCP_PASS})

    @staticmethod
    def _nan_poison(prepared: PreparedCase, metrics: dict[str, Any]) -> Outcome | None:
        """The second pass (see the module docstring)."""
        findings, poison_metrics = nan_poison_pass(prepared)
        metrics.update(poison_metrics)
        if not findings:
            return None
        reason = "; ".join(
            f"{finding['what']} (the loud-poison pass was within tolerance): {finding['place']}" for finding in findings
        )
        evidence = {"pass": "NaN poison: every KV slot no request owns holds NaN"}
        worst = next((finding["worst"] for finding in findings if "worst" in finding), None)
        if worst:
            evidence["worst"] = worst
        return Outcome(Verdict.FAIL, reason, metrics=metrics, evidence=evidence)

    @staticmethod
    def _second_layer(prepared: PreparedCase, metrics: dict[str, Any]) -> Outcome | None:
        """The third pass: another layer of the same step (see the module docstring)."""
        batch = prepared.batch
        case = batch.case
        with during("a second layer's forward", metrics):  # its pool and its inputs are negated in run_step
            layer = second_layer(prepared)
            out = run_step(layer, metadata=prepared.metadata, negated=True)
        atol, rtol = TOLERANCES[case.spec.dtype]
        expected, allowance = oracle(layer, negated=True)
        expected = expected.neg()
        passed, errors, evidence = compare_with_oracle(
            out.neg(), expected, batch.query_start_loc, atol, rtol, allowance
        )
        metrics["second layer max abs error"] = errors["max_abs_error"]
        metrics["second layer tolerance_ratio"] = errors["tolerance_ratio"]
        stored = write_findings(layer, negated=True)
        if passed and stored:
            return Outcome(
                Verdict.FAIL,
                f"a second layer (fp8 scales {_scales(layer)}): {stored['what']}: {stored['place']}",
                metrics=metrics,
                evidence={"pass": STORED_PASS, "stored": stored.get("worst")},
            )
        if passed:
            return None
        worst = evidence["worst"]
        maps = failure_maps(layer, out.neg(), expected, worst, atol, rtol, "a second layer", negated=True)
        scales = "" if layer.scales is None else f"; fp8 scales {_scales(layer)} instead of the first layer's"
        sinks = "" if batch.sinks is None else "; learned sinks of its own"
        reason = (
            f"a second layer (this step's metadata, no build; its own pool; query, key and value negated{scales}"
            f"{sinks}) "
            f"is wrong: {how_far_off(errors)}, worst (negated back) at {worst_place(worst)} — state kept from the "
            "first layer's pool, scales, sinks or forward, or (on a GPU) work launched on another stream than the "
            "current one"
        )
        return Outcome(
            Verdict.FAIL,
            reason,
            metrics=metrics,
            evidence={"pass": "a second layer: the step's metadata reused, a new pool", "worst": worst, **maps},
        )

    @staticmethod
    def _steps_in_flight(prepared: PreparedCase, metrics: dict[str, Any]) -> Outcome | None:
        """The fourth pass: the next step built while this one is queued (see the module docstring)."""
        batch = prepared.batch
        case = batch.case
        order = list(range(case.num_reqs))[::-1]
        later = prepared.over(batch.reordered(order))
        (reference, allowance), starts = oracle(prepared), batch.query_start_loc

        def later_order(rows: torch.Tensor | None) -> torch.Tensor | None:
            return (
                None if rows is None else torch.cat([rows[starts[request] : starts[request + 1]] for request in order])
            )

        with during("two steps in flight", metrics):
            outputs = run_steps_in_flight([prepared, later])
        atol, rtol = TOLERANCES[case.spec.dtype]
        worst_error = 0.0
        for label, out, expected, allowed, step, requests in (
            (
                "this step (the next one built before it ran)",
                outputs[0],
                reference,
                allowance,
                batch,
                list(range(case.num_reqs)),
            ),
            (
                "the next step (the same requests reversed, built while this one was queued)",
                outputs[1],
                later_order(reference),
                later_order(allowance),
                later.batch,
                order,
            ),
        ):
            passed, errors, evidence = compare_with_oracle(out, expected, step.query_start_loc, atol, rtol, allowed)
            worst_error = max(worst_error, errors["max_abs_error"])
            if passed:
                continue
            worst = evidence["worst"]
            maps = failure_maps(
                prepared if step is batch else later,
                out,
                expected,
                worst,
                atol,
                rtol,
                "two steps in flight",
                requests[worst["request"]],
            )
            worst["request"] = requests[worst["request"]]  # numbered as in the case
            reason = (
                f"two steps in flight: {label} is wrong: {how_far_off(errors)}, worst at {worst_place(worst)} — "
                "a build that overwrites what a queued step still reads (a pinned host buffer copied with "
                "non_blocking=True, a workspace), or a plan reused for a batch of the same shape"
            )
            metrics["in-flight max abs error"] = errors["max_abs_error"]
            return Outcome(
                Verdict.FAIL,
                reason,
                metrics=metrics,
                evidence={
                    "pass": "two steps in flight: the next step built before this one ran",
                    "worst": worst,
                    **maps,
                },
            )
        metrics["in-flight max abs error"] = worst_error
        return None
