"""indexer: does a lightning indexer (DeepSeek-V3.2's, the layer kind ``indexer``) choose, for each
token, the top-k positions of its logits over the keys it stored, as the float64 oracle ranks them?

One step run as an engine runs it: the pool poisoned through the backend's own ``write_kv`` (a
poisoned key scores far above every real one, so a choice over slots no request owns takes it),
the history written, then ``build`` → ``write_kv`` of the step's keys (and padding rows) →
``forward`` into an int32 output filled with -2 (no answer: a row it forgets to write, or a
padding row it writes, shows). Its inputs are watched as every check's are. Two questions, each
with its own evidence, as for an fp8 attention cache: (a) the stored keys (``read_kv``) against
the contract's quantization, one e4m3 step allowed on at most 1% of the elements; (b) each token's
choice against the oracle's logits over *those* stored keys (``harness.index_choice``).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.base import AttentionBackend
from conformance.cases.grammar import Case
from conformance.cases.kv_quantization import ONE_ULP_FRACTION, quantize, token_scales, ulps_apart
from conformance.cases.oracle import index_logits, index_tolerance
from conformance.checks.base import Check
from conformance.harness.answers import CHOICE
from conformance.harness.index_choice import judge_rows
from conformance.harness.input_watch import InputWatch
from conformance.harness.step import ChangedInput, output_buffer, pool_watch, prepare_case
from conformance.results import Outcome, Verdict


class IndexerCheck(Check):
    name = "indexer"
    question = (
        "an indexer's choice: each token's top-k positions of Σ_h w_h·relu(q_h·k) over the keys it stored, "
        "and the keys stored as the contract quantizes them?"
    )
    kinds = frozenset({"indexer"})
    evidence_labels = {"token": "first wrong token", "choice": "its choice", "stored": "stored keys"}

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        prepared = prepare_case(backend_cls, case, device)
        batch, backend = prepared.batch, prepared.backend
        common = batch.common_metadata()
        key, _, slots = batch.step_rows()
        query = torch.cat([batch.query, batch.query.new_zeros(case.padding, *batch.query.shape[1:])])
        layer = prepared.forward_layer  # its head weights: copies, padding rows 0
        weights = batch.token_inputs["index_weights"]
        out = output_buffer(batch, case.padding)[0]
        watch = InputWatch.of(
            {
                "query": query,
                "key": key,
                "slot_mapping (write_kv)": slots,
                "query_start_loc": common.query_start_loc,
                "seq_lens": common.seq_lens,
                "block_table": common.block_table,
            },
            layers={"": layer},
            pools=pool_watch(prepared, slots),
        )
        metadata = backend.build(common)
        watch.called("build")
        backend.write_kv(prepared.kv_cache, key, None, slots, layer=prepared.layer)
        watch.called("write_kv")
        backend.forward(query, prepared.kv_cache, metadata, out, layer=layer)
        watch.called("forward")
        changed = watch.changes()
        if changed:
            raise ChangedInput("the backend changed an input it was handed: " + "; ".join(changed))
        padding = out[case.num_tokens :]
        if bool(CHOICE.written(padding).any()):
            return Outcome(Verdict.FAIL, "forward wrote output rows past the step's real tokens (padding rows)")
        stored_problem, stored_metrics, keys = self._stored(backend, prepared, batch)
        if stored_problem:
            return Outcome(Verdict.FAIL, stored_problem, stored_metrics, {"stored": stored_problem})
        return self._choices(case, batch, out, weights, keys, stored_metrics)

    def _stored(self, backend, prepared, batch) -> tuple[str | None, dict[str, Any], list[torch.Tensor]]:
        """Each request's keys as the backend stored them, dequantized (float64), and, for fp8
        keys, the stored bytes against the contract's."""
        spec = batch.spec
        keys, elements, off_by_one = [], 0, 0
        for request, (context_len, query_len) in enumerate(batch.case.batch):
            seq_len = context_len + query_len
            slots = batch.slots(request, range(seq_len)).to(batch.device)
            stored, scales = backend.read_kv(prepared.kv_cache, slots)
            if not spec.fp8_kv_cache:
                keys.append(stored.double())
                continue
            exact = batch.keys[request].double()
            expected_scales = token_scales(exact, spec.kv_cache_dtype)
            if not torch.equal(scales.double().cpu(), expected_scales.cpu()):
                bad = int((scales.double().cpu() != expected_scales.cpu()).nonzero()[0])
                return (
                    f"request {request} position {bad}: stored key scale {float(scales[bad]):.6g}, the contract's "
                    f"{float(expected_scales[bad]):.6g} (the smallest power of two at least max|key| / 448)",
                    {},
                    [],
                )
            expected = quantize(exact, expected_scales[:, None], spec.kv_cache_dtype)  # each row over its own scale
            apart = ulps_apart(stored.cpu(), expected.cpu())
            elements += apart.numel()
            off_by_one += int((apart == 1).sum())
            if bool((apart > 1).any()):
                where = (apart > 1).nonzero()[0].tolist()
                return (
                    f"request {request} position {where[0]} channel {where[1]}: stored key more than one e4m3 step off",
                    {},
                    [],
                )
            keys.append(stored.double() * scales.double()[:, None])
        metrics = {"stored_elements": elements, "stored_one_step_off": off_by_one}
        if elements and off_by_one > ONE_ULP_FRACTION * elements:
            return f"{off_by_one} of {elements} stored key elements one e4m3 step off (at most 1% may be)", metrics, []
        return None, metrics, keys

    def _choices(self, case, batch, out, weights, keys, metrics) -> Outcome:
        """Every token's choice judged; the worst one named."""
        worst, judged, found = 0.0, 0, None
        for request, (context_len, _) in enumerate(case.batch):
            start, end = batch.query_start_loc[request], batch.query_start_loc[request + 1]
            if end == start:
                continue
            query = batch.query[start:end]
            logits = index_logits(query, keys[request].to(query.device), weights[start:end], context_len=context_len)
            tolerances = index_tolerance(query, keys[request], weights[start:end])
            problem, miss = judge_rows(
                out[start:end], logits, tolerances, context_len, case.spec.sparse_topk, first_token=start
            )
            judged += end - start
            if problem and miss > worst:
                found = (problem, request)
            worst = max(worst, miss)
        metrics = {**metrics, "tokens": judged, "tolerance_ratio": worst}
        if found is None:
            return Outcome(Verdict.PASS, "", metrics)
        problem, request = found
        evidence = {"token": f"token {problem.token} (request {request})", "choice": problem.what}
        return Outcome(Verdict.FAIL, f"token {problem.token}: {problem.what}", metrics, evidence)
