"""numerics: is the backend's output equal to the float64 oracle on every case it supports?

Each case is stepped three times over the same batch (``comparison`` says what "equal" means):

1. **Loud poison**: every slot no request owns holds a dominant key and a loud value, so a read
   of one whose value is used pulls the output far off.
2. **NaN poison** (``nan_poison``): those slots hold NaN, so a read of one whose value is then
   multiplied by a zero weight turns the output NaN where the loud pass saw nothing; and the pool
   must change in the step's own slots only.
3. **A second layer**: engines build a step's metadata once and call ``write_kv`` + ``forward``
   for every layer, each with its own pool. So the step runs once more with the metadata the last
   pass built (no ``build``), on a new pool holding the first one negated, with the query, key and
   value negated: the scores are the same, the output must be the first layer's negated. A
   backend that keeps something of the first pool (a view, a descriptor, a pointer cached by
   shape) or that changes the metadata inside ``forward`` fails here. On a GPU this pass runs on
   a side stream kept busy first (``harness.on_a_busy_stream``), where its pool and inputs are
   negated: a backend that launches on another stream than the current one reads them unready.
"""
from __future__ import annotations

from typing import Any

import torch

from backends.base import AttentionBackend, dtype_name
from conformance.checks.base import Check
from conformance.checks.comparison import TOLERANCES, compare_with_oracle
from conformance.checks.nan_poison import nan_poison_pass
from conformance.inputs.cases import Case
from conformance.inputs.harness import PreparedCase, WroteOutsideOutput, prepare_case, run_step
from conformance.results import CaseResult, Verdict


class NumericsCheck(Check):
    name = "numerics"
    question = "equal to the float64 oracle on every supported case: unowned KV slots loud or NaN, and as a second layer?"

    def details(self) -> dict[str, Any]:
        return {
            "tolerance": "|out - ref| <= atol + rtol * |ref|",
            "tolerances": {dtype_name(dtype): {"atol": a, "rtol": r} for dtype, (a, r) in TOLERANCES.items()},
        }

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> CaseResult:
        prepared = prepare_case(backend_cls, case, device)
        try:
            out = run_step(prepared, with_host_lengths=True)
        except WroteOutsideOutput as error:
            return CaseResult(case.id, Verdict.FAIL, str(error), tag=case.tag)
        reference = prepared.batch.reference_output()
        atol, rtol = TOLERANCES[case.spec.dtype]
        passed, metrics, evidence = compare_with_oracle(out, reference, prepared.batch.query_start_loc, atol, rtol)
        metrics.update(atol=atol, rtol=rtol)
        if passed:
            # The later passes reuse this batch (its oracle answer too); each returns its failure or None.
            for later_pass in (self._nan_poison, self._second_layer):
                failed = later_pass(prepared, metrics)
                if failed:
                    return failed
            return CaseResult(case.id, Verdict.PASS, tag=case.tag, metrics=metrics)
        worst = evidence["worst"]
        if metrics["non_finite"]:
            what = f"{metrics['non_finite']} NaN/Inf outputs (unwritten rows stay NaN)"
        else:
            what = f"{metrics['mismatched']} of {metrics['elements']} elements beyond tolerance"
        reason = (
            f"{what}; max abs error {metrics['max_abs_error']:.3g} (atol {atol:g}, rtol {rtol:g}); worst at "
            f"request {worst['request']} token {worst['token']} head {worst['head']}: "
            f"got {worst['got']:.4g}, expected {worst['expected']:.4g}"
        )
        return CaseResult(case.id, Verdict.FAIL, reason, tag=case.tag, metrics=metrics, evidence=evidence)

    @staticmethod
    def _nan_poison(prepared: PreparedCase, metrics: dict[str, Any]) -> CaseResult | None:
        """The second pass (see the module docstring)."""
        case = prepared.batch.case
        findings, poison_metrics = nan_poison_pass(prepared)
        metrics.update(poison_metrics)
        if not findings:
            return None
        reason = "; ".join(f"{finding['what']} (the loud-poison pass was within tolerance): {finding['place']}"
                           for finding in findings)
        evidence = {"pass": "NaN poison: every KV slot no request owns holds NaN"}
        worst = next((finding["worst"] for finding in findings if "worst" in finding), None)
        if worst:
            evidence["worst"] = worst
        return CaseResult(case.id, Verdict.FAIL, reason, tag=case.tag, metrics=metrics, evidence=evidence)

    @staticmethod
    def _second_layer(prepared: PreparedCase, metrics: dict[str, Any]) -> CaseResult | None:
        """The third pass: another layer of the same step (see the module docstring)."""
        batch = prepared.batch
        case = batch.case
        try:  # its pool, a copy of the first, and its inputs are negated in run_step
            layer = PreparedCase(batch, prepared.backend, prepared.kv_cache.clone())
            out = run_step(layer, metadata=prepared.metadata, negated=True)
        except WroteOutsideOutput as error:
            return CaseResult(case.id, Verdict.FAIL, f"a second layer's forward: {error}", tag=case.tag, metrics=metrics)
        atol, rtol = TOLERANCES[case.spec.dtype]
        passed, errors, evidence = compare_with_oracle(out.neg(), batch.reference_output(), batch.query_start_loc, atol, rtol)
        metrics["second layer max abs error"] = errors["max_abs_error"]
        if passed:
            return None
        worst = evidence["worst"]
        reason = (f"a second layer (this step's metadata, no build; its own pool; query, key and value negated) is not the "
                  f"first layer's output negated: {errors['mismatched']} of {errors['elements']} elements beyond tolerance, "
                  f"worst at request {worst['request']} token {worst['token']} head {worst['head']}: got {worst['got']:.4g} "
                  f"(negated back), expected {worst['expected']:.4g} — state kept from the first layer's pool or forward, or "
                  "(on a GPU) work launched on another stream than the current one")
        return CaseResult(case.id, Verdict.FAIL, reason, tag=case.tag, metrics=metrics,
                          evidence={"pass": "a second layer: the step's metadata reused, a new pool", "worst": worst})
