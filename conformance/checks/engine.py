"""engine: the reference engine end to end with the backend under test, sync and async.

For each attention kind, KV-cache format, dtype, learned sinks or none, sliding window or none and
MLA prefill's layer or not (the first case of each in the suite gives the head shape, block size
and fp8 scales) a small two-layer model of that layout runs four prompts, greedy (``model_for``):
a sinks case gives every layer sinks of its own; a windowed case alternates windowed and full
layers as gpt-oss and Gemma 2 do (a window of ``ENGINE_WINDOW``, shorter than the prompts, each
group of layers with a backend and metadata of its own); MLA prefill's layer (a value head dim
other than the key's, DeepSeek-V3's 192 / 128) runs a DeepSeek-style MLA model whose prefills go
through the backend under test, decompressed, while a built-in decodes absorbed; an MLA case's
model runs its prefills through the backend too where it claims that layer
(``reference_engine.model_attention``). On a CPU all but the dtype decide, and in the quick suite
(the CPU default, a minute long) the kind alone; in fp32 where the backend claims it: there the
dtypes differ only in rounding, and bf16 and fp16 matrix products are many times slower.

Judged first, against an independent reference: plain decoding (no speculation, sync) through
the backend must give the tokens of the same engine run (model, prompts, dtype, block size, fp8
cache format and scales, sampling, MLA prefill path) through ``torch_naive``, the suite's plain
PyTorch backend. Every other claim compares the backend with itself, so an error it makes the same
way in every run passes them: state shared across layers, such as the first layer's learned sinks
or fp8 scales kept in a persistent copy, or in the step's metadata that every layer reads, for
every layer (each layer of the engine's model has sinks and scales of its own). Where the backend
is torch_naive itself, or torch_naive cannot run the layout, the evidence and the reason say so.

0. for an MLA model whose prefills run decompressed: plain decoding again with every request
   absorbed; the two paths must agree (a prefill kernel's value offset, scale or context shows here);

1. plain decoding (no speculation), the reference of the claims below;
2. speculative decoding, k = 3, scripted drafter at 50 % acceptance (a rejection in most steps),
synchronous loop: must equal 1;
3. the same, asynchronous loop with the debug input checks on: must equal 2 token for token, and no
   placeholder, stale length or foreign slot may reach the model;
4. speculative decoding, k = 3, drafting *through the backend under test* (``layer-skip``: the
   target's first layer drafts k tokens, one attention step per draft token), sync and async, under
   CUDA graphs on CUDA (the draft loop in one graph with ``update_for_draft_step`` when the backend
   claims ``draft_step_update``, else one draft-step graph replayed k times with ``build`` between):
   must equal 1. The batch holds as many prompts as ``max_num_reqs``, so the padded graph batch's
   last row is often a real request; where it is padding, it is vLLM's empty request for a backend
   that claims that style (``reference_engine.empty_padding``). Drafts change only what is accepted,
   never the output, so
   the drafts accepted per prompt under graphs must also equal those of the same backend's eager
   draft steps (metadata rebuilt per step); and a backend claiming ``draft_step_update`` must
   draft exactly the tokens it drafts with its metadata built afresh for every draft step (on
   the CPU too: the engine uses the update path eagerly);
   For a token-tree case's layout (``layout_key``) 2–4 are, instead: EAGLE drafting token trees
   through the backend (a dynamic top-k 4 tree of 8 drafts, sync and async with the input checks,
   and a static binary tree of depth 2, async; the head made of the model's first layer, so that
   paths leave the first branch and the accepted nodes' KV moves), each equal to 1; the evidence
   counts the drafts accepted and the accepted nodes moved. The chain layout of the same layer
   judges the chain runs;
5. on CUDA, the async loop again, measured over at least ``STEADY_STEPS`` steady-state steps: CUDA
   graphs where the backend claims them, host-blocking syncs per steady-state step (must be 0 for a
   backend claiming ``needs_cpu_seq_lens=False``), TPOT
   and GPU idle fraction (reported); k = 0 for a backend that cannot verify k + 1 tokens, so that
   the steady steps are its own (a token-tree layout's: the dynamic tree engine, whose tree
   steps run eagerly and whose trees the host never sees); not measured where a built-in decodes
   (MLA prefill's layer), nor for a backend claiming ``needs_cpu_seq_lens=True`` (its syncs are
   allowed, so the count could not fail).
   The batch changes inside the measured window, as continuous batching changes it: twice as many
   requests as the engine's four slots, each with its own max_tokens (``STEADY_MAX_TOKENS``), so
   requests leave and waiting ones join; the decode steps right after a request left or joined
   are counted too (``reference_engine.metrics.steady_iterations``), and the window must hold at
   least one of each (else an ERROR, as for too few steps). The metrics report how many
   (``composition_changes_measured``, ``joins_measured``, ``leaves_measured``).

A DCP case's layout (``dcpN``) runs every engine above with each layer's KV sharded over the
case's N ranks (``reference_engine.dcp_attention``: one backend instance a rank, each query token
a decode row on every rank, the ranks merged by LSE; graphs and ``update_for_draft_step`` over the
ranks' own lengths), and its plain decoding is held to torch_naive *without* DCP, torch_naive's own
DCP layout included: a keyless rank's LSE or an LSE in another base shows there as other tokens. A
draft update that advances every rank's lengths reads a slot its rank does not hold, which the
engine's pool leaves zero (not poisoned): over 8 ranks it drafted other tokens, over 2 it moved no
draft of the model tried; the DCP draft loop, over a poisoned pool, judges it every time. One DCP
case of each layout stands for the others, whatever its ranks (``layout_key``). Every rank call is
a decode batch, so no companion serves beside a DCP layout's backend, and an MLA model runs
absorbed throughout (MLA prefill's layer SKIPs: the backend under test would serve no layer).

A backend that serves only some batches (decode-only, uniform-only) runs every engine beside a
companion that serves the rest, prefill chunks above all (``reference_engine.attention_split``,
``--prefill-backend``); the evidence counts the batches and tokens each one served.

A reduced-precision run may flip an argmax where two logits tie within rounding; a difference is
accepted only when an fp32 re-score of the same weights puts both tokens within ``NEAR_TIE`` logits
plus two rounding steps of the run's dtype at their magnitude (the LM head rounds logits to it:
bf16 at 8-16 logits, 0.0625 a step) of the top logit (``equality.Explanation.is_near_tie``), and
the report names it. Between the async and the sync loop a near tie is accepted only where the
prompt's own steps, up to the one that emitted the token, were batched apart
(``loop_tokens.batched_apart``: other rows, another max_seq_len handed, a graph captured in
one loop and replayed in the other, or a step shared with a prompt that had already parted): steps
batched alike had the same inputs in both loops.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from backends.base import AttentionBackend
from backends.features import Needs
from conformance.cases.grammar import Case
from conformance.checks.base import EVERY_KIND, Check, Plan, first_of_each
from conformance.harness.engine_model import cache_config, is_mla_prefill_layer, model_for
from conformance.harness.engine_runs import (
    ATTENTION_DRAFTER,
    DRAFTER,
    REFERENCE,
    SPEC_TOKENS,
    TREE_SPEC_TOKENS,
    EngineRuns,
    TooFewSteadySteps,
)
from conformance.results import Outcome, Verdict
from reference_engine.attention_split import AUTO, Routing
from reference_engine.dcp_attention import dcp_refusal
from reference_engine.equality import NEAR_TIE
from reference_engine.model_attention import plan_attention

REFERENCE_LABEL = f"plain vs {REFERENCE} (an independent reference)"


def layout_key(case: Case, device: torch.device, suite: str | None = None) -> tuple:
    """One engine scenario per attention kind, sparse or dense, KV-cache format, dtype, learned
    sinks, sliding window (or window part) and value head dim (on a CPU, all but the dtype; in the
    quick suite, per kind, sparse or dense): the first such case's shapes (and an fp8 cache's
    scales) stand in."""
    spec = case.spec
    sparse = spec.sparse_topk is not None
    if suite == "quick":
        return (spec.kind, sparse, bool(case.trees), spec.fp8_query, case.dcp > 1)
    windowed = spec.sliding_window is not None or spec.sparse_window is not None
    key = spec.kind, sparse, spec.attention_sinks, windowed, is_mla_prefill_layer(spec), spec.kv_scale_block
    # A token-tree layout's engines draft trees; an fp8 query's quantize it; a DCP layout's shard every layer.
    key += (bool(case.trees), spec.fp8_query, case.dcp > 1)
    if device.type == "cpu":
        return key + (spec.fp8_kv_cache,)
    return key + (spec.kv_cache_dtype if spec.fp8_kv_cache else None, spec.dtype)


def engine_case(backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Case:
    """The case whose layout the engine runs: on a CPU in fp32 where the backend claims it."""
    if device.type == "cpu" and case.spec.dtype != torch.float32 and torch.float32 in backend_cls.capabilities.dtypes:
        return dataclasses.replace(case, spec=dataclasses.replace(case.spec, dtype=torch.float32))
    return case


def engine_skip_reason(
    backend_cls: type[AttentionBackend], case: Case, device: torch.device, prefill_backend: str = AUTO
) -> str | None:
    """Why the engine cannot run ``model_for(case)`` through this backend, or None. The case's
    own layer first: an MLA case is an MLA backend's, MLA prefill's layer a backend's that claims it."""
    spec = case.spec
    reason = backend_cls.unsupported_reason(spec, device)
    if reason:
        return reason
    if case.trees:  # a tree layout's engines verify EAGLE's trees through the backend itself
        tokens = 1 + max(TREE_SPEC_TOKENS)
        reason = backend_cls.capabilities.skip_reason(Needs(spec, (tokens,), tree_tokens=tokens), device)
        if reason:
            return f"the engine verifies token trees of {tokens} tokens through the backend: {reason}"
    if is_mla_prefill_layer(spec) and spec.num_kv_heads != spec.num_heads:
        return (
            "the engine runs a value head dim other than the key's as MLA prefill's layer, which has as many KV "
            f"heads as query heads (this layer: {spec.num_kv_heads} over {spec.num_heads})"
        )
    try:  # a backend serving only some batches (decode-only, uniform-only) needs a companion
        plans = plan_attention(
            backend_cls,
            model_for(case),
            spec.dtype,
            spec.block_size,
            cache_config(case).get("kv_cache_dtype"),
            device,
            prefill_backend,
            decompressed_prefill=case.dcp == 1,
            kv_scale_block=cache_config(case).get("kv_scale_block"),
        )
    except ValueError as error:
        return str(error)
    return dcp_skip_reason(backend_cls, case, plans, device) if case.dcp > 1 else None


def dcp_skip_reason(backend_cls: type[AttentionBackend], case: Case, plans, device: torch.device) -> str | None:
    """Why the engine cannot shard ``model_for(case)`` over the case's DCP ranks through the
    backend, or None: every layer group's backend must claim it (``dcp_refusal``), and the backend
    under test must serve some layer (under DCP MLA runs absorbed: MLA prefill's layer has none)."""
    where = f"the engine shards every layer over {case.dcp} DCP ranks"
    if not any(plan.backend_cls is backend_cls for plan in plans):
        return f"{where}, and runs an MLA model absorbed there: the backend under test (MLA prefill's) serves no layer"
    reason = dcp_refusal(model_for(case), plans, case.dcp, device)
    return f"{where} through the backend: {reason}" if reason else None


class EngineCheck(Check):
    name = "engine"
    case_seconds = 15.0  # the mean case on one H200, six backends side by side on it
    kinds = EVERY_KIND  # an indexer runs as a sparse model's, beside a built-in attention
    question = (
        "Does the reference engine, async and sync, produce the same tokens through this backend as through "
        "torch_naive, with no host syncs?"
    )
    evidence_labels = {
        "independent_reference": f"compared with {REFERENCE}",
        "near_ties": "near-tie flips (explained, not failures)",
        "verified_drafts_digest": "verified drafts' digest",
        "accepted_drafts": "accepted drafts per prompt",
        "host_sync_sources": "host syncs in the async loop",
        "attention_routing": "batches and tokens each backend served (prefill/decode split)",
        "token_trees": "token-tree runs: drafts accepted per prompt, accepted nodes whose KV moved",
    }

    drives_trees = True  # a tree layout's engines draft and verify EAGLE token trees through the backend
    drives_dcp = True  # a DCP layout's engines shard every layer's KV over the case's ranks

    def case_skip_reason(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> str | None:
        # The engine's own batches, not the case's: a decode-only backend runs beside a companion.
        prefill = self.options.get("prefill_backend", AUTO)
        return self.judged_reason(case) or engine_skip_reason(
            backend_cls, engine_case(backend_cls, case, device), device, prefill
        )

    def plan(self, backend_cls: type[AttentionBackend], cases: list[Case], device: torch.device) -> Plan:
        """One engine run per layout (``layout_key``): the first case of each that the engine can run."""
        return first_of_each(
            cases,
            lambda case: layout_key(case, device, self.options.get("suite")),
            lambda case: self.case_skip_reason(backend_cls, case, device),
            "layout covered by {}",
        )

    def details(self) -> dict[str, Any]:
        return {
            "spec_tokens": SPEC_TOKENS,
            "drafter": DRAFTER,
            "attention_drafter": ATTENTION_DRAFTER,
            "near_tie_logits": NEAR_TIE,
            "sync_detector": self.options.get("sync_detector", "auto"),
        }

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        routings: list[Routing] = []  # a split backend's: which backend served the attention calls of each engine run
        ran = engine_case(backend_cls, case, device)
        result = self._run_engines(backend_cls, ran, device, routings)
        if ran is not case:
            result.reason += " (the model in fp32: a CPU run)"
        served = Routing.total(routings)
        if served.batches:
            result.evidence["attention_routing"] = served.to_dict()
            if result.verdict == Verdict.PASS:
                result.reason += "; " + served.summary()
        return result

    def _run_engines(
        self, backend_cls: type[AttentionBackend], case: Case, device: torch.device, routings: list[Routing]
    ) -> Outcome:
        from reference_engine.batched_engine import InputCheckFailed

        runs = EngineRuns(backend_cls, case, device, routings, self.options)
        try:
            for _, claim in self._claims(backend_cls, runs):
                problem = claim()
                if problem:
                    return Outcome(Verdict.FAIL, problem, metrics=runs.metrics, evidence=runs.evidence)
        except InputCheckFailed as error:
            return Outcome(Verdict.FAIL, f"async loop: {error}")
        except TooFewSteadySteps as error:
            return Outcome(Verdict.ERROR, str(error), metrics=runs.metrics)
        return Outcome(Verdict.PASS, self._pass_reason(runs), metrics=runs.metrics, evidence=runs.evidence)

    def _claims(
        self, backend_cls: type[AttentionBackend], runs: EngineRuns
    ) -> list[tuple[str, Callable[[], str | None]]]:
        """The check's claims in the order they are judged, each ``(label, function)``: the function
        returns the problem, or None. The engine runs they compare are made once, when first needed."""
        drafting = runs.drafting
        # First, against an independent reference: the other claims compare the backend with
        # itself, so an error it makes the same way in every run passes them all.
        table = [(REFERENCE_LABEL, self._reference_claim(runs))]
        same: list[tuple[str, Callable[[], list], Callable[[], list]]] = []
        if runs.decompressed_prefill and not runs.case.spec.fp8_query:
            # MLA's two paths must agree: prefills decompressed through this backend, and the same
            # requests absorbed (by the MLA decode backend: this one, or a built-in beside it). Not
            # with an fp8 query: the absorbed path quantizes its latent-space query, the decompressed
            # prefill (as vLLM's) takes its query unquantized, so the two attend with other numbers.
            same.append(
                ("MLA prefill decompressed vs every request absorbed", lambda: runs.absorbed, lambda: runs.plain)
            )
        if runs.trees:  # the chain layout of the same layer judges the chain runs
            same += [
                ("EAGLE top-k 4 token trees, sync vs plain", lambda: runs.tree_sync, lambda: runs.plain),
                ("EAGLE top-k 4 token trees, async vs plain", lambda: runs.tree_async, lambda: runs.plain),
                ("a static EAGLE token tree, async vs plain", lambda: runs.static_tree_async, lambda: runs.plain),
            ]
        else:
            same += [
                ("spec (sync) vs plain", lambda: runs.sync, lambda: runs.plain),
                ("async vs sync", lambda: runs.overlapped, lambda: runs.sync),
                (f"{drafting}, sync vs plain", lambda: runs.drafted_sync, lambda: runs.plain),
                (f"{drafting}, async vs plain", lambda: runs.drafted_async, lambda: runs.plain),
            ]
        # Between the two loops a near tie may flip only where the prompt's steps were batched apart.
        apart = {"async vs sync": runs.loops_batched_apart}
        table += [
            (label, self._same_tokens(runs, label, got, expected, apart.get(label))) for label, got, expected in same
        ]
        if backend_cls.capabilities.draft_step_update and not runs.trees:  # tree draft steps are rebuilt
            table.append(("update_for_draft_step drafts what rebuilt metadata drafts", runs.draft_update_problem))
        if runs.graphs:
            table.append(("drafts accepted under CUDA graphs == eager", runs.graph_acceptance_problem))
        if runs.measures_steady_steps:
            table.append(("host syncs per steady-state async step", runs.steady_problem))
        return table

    def _same_tokens(
        self,
        runs: EngineRuns,
        label: str,
        got: Callable[[], list],
        expected: Callable[[], list],
        apart: Callable[[int, int], bool | None] | None = None,
    ) -> Callable[[], str | None]:
        """``apart(prompt, index)``: for two runs that should differ only in how they batched, whether
        the prompt's steps up to that output token were batched apart; a near tie flips only there."""

        def claim() -> str | None:
            return self._difference(label, got(), expected(), runs.prompts, runs.model, runs.base, runs.evidence, apart)

        return claim

    def _reference_claim(self, runs: EngineRuns) -> Callable[[], str | None]:
        """Plain decoding must equal the same run through torch_naive; where that run cannot be
        made (torch_naive itself, or a layout it does not claim), the evidence and reason say so."""
        same = self._same_tokens(runs, REFERENCE_LABEL, lambda: runs.plain, lambda: runs.reference)

        def claim() -> str | None:
            if runs.reference_missing:
                runs.evidence["independent_reference"] = f"not compared: {runs.reference_missing}"
                return None
            problem = same()
            if problem is None:
                without = " without DCP" if runs.case.dcp > 1 else ""
                runs.evidence["independent_reference"] = f"plain decoding gave {REFERENCE}'s tokens{without}"
            return problem

        return claim

    @staticmethod
    def _pass_reason(runs: EngineRuns) -> str:
        evidence, metrics = runs.evidence, runs.metrics
        equal = "async == sync == plain" + ("" if runs.reference_missing else f" == {REFERENCE}")
        reason = f"{equal}, also with {runs.drafting}"
        if runs.case.dcp > 1:
            reason += f"; every layer's KV over {runs.case.dcp} DCP ranks, merged by LSE"
        if runs.reference_missing:
            reason += f"; not compared with {REFERENCE} ({runs.reference_missing})"
        if evidence.get("near_ties"):
            reason += f"; {len(evidence['near_ties'])} near-tie flip(s)"
        if runs.device.type == "cuda" and not runs.decodes:
            reason += "; steady-state steps not measured (a built-in decodes: this backend serves MLA's prefill)"
        elif runs.device.type == "cuda" and not runs.measures_steady_steps:
            reason += "; steady-state steps not measured (the backend claims needs_cpu_seq_lens: host syncs allowed)"
        if metrics.get("host_syncs_per_steady_step") is not None:
            reason += (
                f"; {metrics['host_syncs_per_steady_step']:.2f} syncs/step ({metrics['steady_steps']} steps, "
                f"{metrics['composition_changes_measured']} right after a request joined or left), "
                f"GPU idle {metrics['gpu_idle_fraction']:.1%}"
            )
        return reason

    def _difference(self, label, got, expected, prompts, model, base, evidence, apart=None) -> str | None:
        """None when equal or every difference is an explained near-tie; else the failure reason."""
        from reference_engine.equality import explain, first_divergence, fp32_reference

        reference = None
        for index, (a, b) in enumerate(zip(expected, got)):
            at = first_divergence(a, b)
            if at is None:
                continue
            if at >= min(len(a), len(b)):
                return f"{label}: prompt {index} has {len(b)} tokens, expected {len(a)}"
            if reference is None:  # an fp8 query's margins are its quantized query's
                reference = fp32_reference(model, block_size=base.block_size, query_dtype=base.query_dtype)
            why = explain(reference, prompts[index], a[:at], a[at], b[at])
            where = (
                f"{label}: prompt {index}, output token {at}: {b[at]} "
                f"instead of {a[at]} (fp32 margin {why.margin:.4f}, "
                f"{why.behind_top:.4f} below the top logit, near-tie tolerance {why.tolerance(base.dtype):.4f})"
            )
            if not why.is_near_tie(base.dtype):
                return where
            own_steps_apart = True if apart is None else apart(index, at)
            if own_steps_apart is False:
                return (
                    f"{where}: a near tie, but every step that wrote this prompt's KV or scored the token held "
                    "the same rows and host lengths in both loops, so the same bits should have come out"
                )
            if own_steps_apart is None:
                return f"{where}: a near tie, but no step records show the loops batched this prompt apart"
            evidence.setdefault("near_ties", []).append(where)
        return None
