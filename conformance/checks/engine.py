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

0. for an MLA model whose prefills run decompressed: plain decoding again with every request
   absorbed; the two paths must agree (a prefill kernel's value offset, scale or context shows here);

1. plain decoding (no speculation), the reference;
2. speculative decoding, k = 3, scripted drafter at 50 % acceptance (a rejection in most steps), synchronous loop: must equal 1;
3. the same, asynchronous loop with the debug input checks on: must equal 2 token for token, and no
   placeholder, stale length or foreign slot may reach the model;
4. speculative decoding, k = 3, drafting *through the backend under test* (``layer-skip``: the
   target's first layer drafts k tokens, one attention step per draft token), sync and async, under
   CUDA graphs on CUDA (the draft loop in one graph with ``update_for_draft_step`` when the backend
   claims ``draft_step_update``, else one draft-step graph replayed k times with ``build`` between):
   must equal 1. The batch holds as many prompts as ``max_num_reqs``, so the padded graph batch's
   last row is often a real request; where it is padding, it is vLLM's empty request for a backend
   that claims that style (``reference_engine.empty_padding``). Drafts change only what is accepted, never the output, so
   the drafts accepted per prompt under graphs must also equal those of the same backend's eager
   draft steps (metadata rebuilt per step); and a backend claiming ``draft_step_update`` must
   draft exactly the tokens it drafts with its metadata built afresh for every draft step (on
   the CPU too: the engine uses the update path eagerly);
5. on CUDA, the async loop again, measured over at least ``STEADY_STEPS`` steady-state steps: CUDA
   graphs where the backend claims them, host-blocking syncs per steady-state step (must be 0 for a backend claiming ``needs_cpu_seq_lens=False``), TPOT
   and GPU idle fraction (reported); k = 0 for a backend that cannot verify k + 1 tokens, so that
   the steady steps are its own; not measured where a built-in decodes (MLA prefill's layer).

A backend that serves only some batches (decode-only, uniform-only) runs every engine beside a
companion that serves the rest, prefill chunks above all (``reference_engine.attention_split``,
``--prefill-backend``); the evidence counts the batches and tokens each one served.

A reduced-precision run may flip an argmax where two logits tie within rounding; a difference is
accepted only when an fp32 re-score of the same weights puts both tokens within ``NEAR_TIE`` logits
plus two rounding steps of the run's dtype at their magnitude (the LM head rounds logits to it:
bf16 at 8-16 logits, 0.0625 a step) of the top logit (``equality.Explanation.is_near_tie``), and
the report names it.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from backends.base import AttentionBackend
from conformance.inputs.cases import Case
from conformance.checks.base import Check
from conformance.results import CaseResult, Verdict
from reference_engine.attention_split import AUTO, Routing
from reference_engine.model_attention import plan_attention
from reference_engine.equality import NEAR_TIE

SPEC_TOKENS = 3
STEADY_STEPS = 128  # the measured run's steady-state steps, at least
STEADY_TOKENS = 400  # tokens per prompt that give them: at most k + 1 = 4 a step, prompts of up to 64 in 512
DRAFTER = "scripted:random:0.5"
ATTENTION_DRAFTER = "layer-skip"  # drafts through the backend under test


def layout_key(case: Case, device: torch.device, suite: str | None = None) -> tuple:
    """One engine scenario per attention kind, KV-cache format, dtype, learned sinks, sliding window
    and value head dim (on a CPU, all but the dtype; in the quick suite, per kind): the first such
    case's shapes (and an fp8 cache's scales) stand in."""
    spec = case.spec
    if suite == "quick":
        return (spec.kind,)
    key = spec.kind, spec.attention_sinks, spec.sliding_window is not None, is_mla_prefill_layer(spec)
    if device.type == "cpu":
        return key + (spec.fp8_kv_cache,)
    return key + (spec.kv_cache_dtype if spec.fp8_kv_cache else None, spec.dtype)


def cache_config(case: Case) -> dict[str, Any]:
    """The EngineConfig fields of the case's KV cache: an fp8 format and its scales, or nothing."""
    return dict(kv_cache_dtype=case.spec.kv_cache_dtype, kv_scales=case.kv_scales) if case.kv_scales else {}


def engine_case(backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Case:
    """The case whose layout the engine runs: on a CPU in fp32 where the backend claims it."""
    if device.type == "cpu" and case.spec.dtype != torch.float32 and torch.float32 in backend_cls.capabilities.dtypes:
        return dataclasses.replace(case, spec=dataclasses.replace(case.spec, dtype=torch.float32))
    return case


def is_mla_prefill_layer(spec) -> bool:
    """An MHA layer whose value head dim is not its key's: MLA's prefill (DeepSeek-V3: 192 / 128)."""
    return spec.kind == "mha" and spec.v_head_dim != spec.head_dim


ENGINE_WINDOW = 48  # a windowed layer's window in the engine: shorter than its prompts and outputs, so it bites


def model_for(case: Case):
    """The engine's model for a case's layer: a Llama-style model (windowed cases: windowed layers
    alternating with full ones, as gpt-oss's and Gemma 2's do; sinks cases: every layer's own
    sinks), an MLA model for MLA's layer, and for MLA prefill's layer (a value head dim other than
    the key's) a DeepSeek-style MLA model whose prefill it is."""
    from reference_engine.model import ModelConfig

    spec = case.spec
    common = dict(vocab_size=512, hidden_size=256, num_layers=2, intermediate_size=512, max_model_len=512)
    if spec.kind == "mla":
        return ModelConfig(attention="mla", num_heads=spec.num_heads, kv_lora_rank=spec.kv_lora_rank,
                           qk_rope_dim=spec.rope_dim, qk_nope_dim=64, v_head_dim=64, **common)
    if is_mla_prefill_layer(spec):
        rope = 64 if spec.head_dim > 64 else spec.head_dim // 2  # DeepSeek-V3: 192 = 128 + 64
        return ModelConfig(attention="mla", num_heads=spec.num_heads, kv_lora_rank=512, qk_rope_dim=rope,
                           qk_nope_dim=spec.head_dim - rope, v_head_dim=spec.v_head_dim, **common)
    return ModelConfig(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                       attention_sinks=spec.attention_sinks, alternating_window=True,
                       sliding_window=ENGINE_WINDOW if spec.sliding_window is not None else None, **common)


def model_and_prompts(case: Case, device: torch.device, lengths: tuple[int, ...]):
    """``model_for(case)`` with seeded random weights, and prompts of these lengths from the same seed."""
    from reference_engine.model import LlamaModel

    config = model_for(case)
    model = LlamaModel.random(config, case.seed, case.spec.dtype, device)
    generator = torch.Generator().manual_seed(case.seed)
    return model, [torch.randint(0, config.vocab_size, (length,), generator=generator).tolist() for length in lengths]


def engine_skip_reason(backend_cls: type[AttentionBackend], case: Case, device: torch.device,
                       prefill_backend: str = AUTO) -> str | None:
    """Why the engine cannot run ``model_for(case)`` through this backend, or None. The case's
    own layer first: an MLA case is an MLA backend's, MLA prefill's layer a backend's that claims it."""
    spec = case.spec
    reason = backend_cls.unsupported_reason(spec, device)
    if reason:
        return reason
    if is_mla_prefill_layer(spec) and spec.num_kv_heads != spec.num_heads:
        return ("the engine runs a value head dim other than the key's as MLA prefill's layer, which has as many KV "
                f"heads as query heads (this layer: {spec.num_kv_heads} over {spec.num_heads})")
    try:  # a backend serving only some batches (decode-only, uniform-only) needs a companion
        plan_attention(backend_cls, model_for(case), spec.dtype, spec.block_size, spec.kv_cache_dtype, device, prefill_backend)
    except ValueError as error:
        return str(error)
    return None


class EngineCheck(Check):
    name = "engine"
    question = "Does the reference engine, async and sync, produce the same tokens through this backend, with no host syncs?"
    evidence_labels = {
        "near_ties": "near-tie flips (explained, not failures)",
        "verified_drafts_digest": "verified drafts' digest",
        "accepted_drafts": "accepted drafts per prompt",
        "host_sync_sources": "host syncs in the async loop",
        "attention_routing": "batches and tokens each backend served (prefill/decode split)",
    }

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.covered: dict[tuple, str] = {}

    def case_skip_reason(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> str | None:
        key = layout_key(case, device, self.options.get("suite"))
        if key in self.covered:
            return f"layout covered by {self.covered[key]}"
        reason = engine_skip_reason(backend_cls, engine_case(backend_cls, case, device), device,
                                    self.options.get("prefill_backend", AUTO))
        if reason:
            return reason
        self.covered[key] = case.id
        return None

    def details(self) -> dict[str, Any]:
        return {"spec_tokens": SPEC_TOKENS, "drafter": DRAFTER, "attention_drafter": ATTENTION_DRAFTER, "near_tie_logits": NEAR_TIE,
                "sync_detector": self.options.get("sync_detector", "auto")}

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> CaseResult:
        routings: list[Routing] = []  # a split backend's: which backend served the attention calls of each engine run
        ran = engine_case(backend_cls, case, device)
        result = dataclasses.replace(self._run_engines(backend_cls, ran, device, routings), case=case.id)
        if ran is not case:
            result.reason += " (the model in fp32: a CPU run)"
        served = Routing.total(routings)
        if served.batches:
            result.evidence["attention_routing"] = served.to_dict()
            if result.verdict == Verdict.PASS:
                result.reason += "; " + served.summary()
        return result

    def _run_engines(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device,
                     routings: list[Routing]) -> CaseResult:
        from reference_engine.batched_engine import BatchedEngine, InputCheckFailed
        from reference_engine.core import EngineConfig
        from reference_engine.metrics import measure
        from reference_engine.sampling import SamplingParams

        spec = case.spec
        model, prompts = model_and_prompts(case, device, (5, 23, 40, 64))
        model_config = model.config
        params = SamplingParams(max_tokens=32, ignore_eos=True)
        backend_ref = f"{backend_cls.__module__}:{backend_cls.__qualname__}"  # the class under test, however it was named
        base = EngineConfig(model=model_config, backend=backend_ref, device=str(device), dtype=spec.dtype,
                            block_size=spec.block_size, num_blocks=64, max_num_reqs=4, max_num_tokens=128,
                            **cache_config(case))

        def engine_for(**changes):
            engine = BatchedEngine(dataclasses.replace(base, prefill_backend=self.options.get("prefill_backend", AUTO),
                                                       **changes), model)
            routings.extend(engine.backend.routings())
            return engine

        def run(**changes):
            return engine_for(**changes).generate(prompts, params)

        def run_drafting(rebuild: bool = False):
            """A synchronous run drafting through the backend: its outputs, and the digest of every
            token it verified (the drafts it proposed, as the target saw them)."""
            engine = engine_for(num_spec_tokens=SPEC_TOKENS, drafter=ATTENTION_DRAFTER, async_scheduling=False,
                                cuda_graphs=graphs, check_inputs=True, rebuild_draft_metadata=rebuild)
            return engine.generate(prompts, params), engine.verified_digest()

        plain = [out.tokens for out in run(num_spec_tokens=0, drafter="none", async_scheduling=False)]
        comparisons = []
        plans = plan_attention(backend_cls, model_config, spec.dtype, spec.block_size, spec.kv_cache_dtype, device,
                               self.options.get("prefill_backend", AUTO))
        if any(plan.prefill_cls is not None for plan in plans):
            # MLA's two paths must agree: prefills decompressed through this backend, and the same
            # requests absorbed (by the MLA decode backend: this one, or a built-in beside it).
            absorbed = [out.tokens for out in run(num_spec_tokens=0, drafter="none", async_scheduling=False,
                                                  decompressed_mla_prefill=False)]
            comparisons.append(("MLA prefill decompressed vs every request absorbed", plain, absorbed))
        sync = [out.tokens for out in run(num_spec_tokens=SPEC_TOKENS, drafter=DRAFTER, async_scheduling=False)]
        graphs = device.type == "cuda"
        try:
            overlapped = [out.tokens for out in run(num_spec_tokens=SPEC_TOKENS, drafter=DRAFTER, check_inputs=True)]
            drafted_outputs, drafted_digest = run_drafting()
            drafted_sync = [out.tokens for out in drafted_outputs]
            drafted_async = [out.tokens for out in run(num_spec_tokens=SPEC_TOKENS, drafter=ATTENTION_DRAFTER,
                                                       cuda_graphs=graphs, check_inputs=True)]
        except InputCheckFailed as error:
            return CaseResult(case.id, Verdict.FAIL, f"async loop: {error}", tag=case.tag)
        metrics: dict[str, Any] = {}
        evidence: dict[str, Any] = {}
        drafting = f"{ATTENTION_DRAFTER} drafting{' under CUDA graphs' if graphs else ''}"
        comparisons += [("spec (sync) vs plain", sync, plain), ("async vs sync", overlapped, sync),
                        (f"{drafting}, sync vs plain", drafted_sync, plain), (f"{drafting}, async vs plain", drafted_async, plain)]
        for label, got, expected in comparisons:
            problem = self._difference(label, got, expected, prompts, model, base, device, evidence)
            if problem:
                return CaseResult(case.id, Verdict.FAIL, problem, tag=case.tag, evidence=evidence)
        if backend_cls.capabilities.draft_step_update:
            problem = self._draft_update_problem(backend_cls, drafted_digest, run_drafting, drafting, evidence)
            if problem:
                return CaseResult(case.id, Verdict.FAIL, problem, tag=case.tag, evidence=evidence)
        if graphs:
            # Drafts never change a lossless engine's output, only what is accepted: the draft
            # steps under graphs (update_for_draft_step, or the replayed step graph) must accept
            # exactly what the same backend's eager draft steps (metadata rebuilt) accept.
            eager = run(num_spec_tokens=SPEC_TOKENS, drafter=ATTENTION_DRAFTER, async_scheduling=False, cuda_graphs=False)
            accepted = [out.accepted for out in drafted_outputs]
            expected = [out.accepted for out in eager]
            evidence["accepted_drafts"] = {"under_graphs": accepted, "eager": expected}
            if accepted != expected:
                return CaseResult(case.id, Verdict.FAIL, f"{drafting}: accepted drafts per prompt {accepted}, but {expected} "
                                  "with the same backend's eager draft steps: the draft steps under CUDA graphs attend "
                                  "differently (update_for_draft_step?)", tag=case.tag, evidence=evidence)
        # MLA prefill's layer: the backend under test serves the prefills, a built-in the decodes.
        decodes = all(plan.backend_cls is backend_cls for plan in plans)
        if device.type == "cuda" and decodes:
            # Steady-state steps must be the backend's own: a decode-only backend's k + 1 verify rows
            # would go to the companion, so it is measured decoding plainly.
            verifies = backend_cls.capabilities.query_len_reason(SPEC_TOKENS + 1) is None
            engine = engine_for(num_spec_tokens=SPEC_TOKENS if verifies else 0, drafter=DRAFTER if verifies else "none",
                                cuda_graphs=True, num_blocks=4 * -(-(64 + STEADY_TOKENS + SPEC_TOKENS + 1) // spec.block_size) + 1)
            engine.generate(prompts, SamplingParams(max_tokens=2 * SPEC_TOKENS + 4, ignore_eos=True))  # warm-up: JIT, graph captures
            # A long look: at least STEADY_STEPS steady steps (a backend syncing or re-planning
            # only every Nth step shows there), the prompts decoding far past the checked run.
            steady = SamplingParams(max_tokens=STEADY_TOKENS, ignore_eos=True)
            _, measured = measure(engine, prompts, steady, detect_syncs=True, strategy=self.options.get("sync_detector", "auto"))
            metrics = {key: measured.to_dict()[key] for key in ("tpot_ms", "gpu_idle_fraction", "host_syncs_per_steady_step",
                                                                 "steady_steps", "acceptance_length", "graph_replays")}
            if measured.steady_steps < STEADY_STEPS:
                return CaseResult(case.id, Verdict.ERROR, f"the measured run had {measured.steady_steps} steady-state steps, "
                                  f"fewer than the {STEADY_STEPS} the engine check watches", tag=case.tag, metrics=metrics)
            evidence["host_sync_sources"] = measured.host_sync_sources
            syncs = measured.host_syncs_per_steady_step
            if not backend_cls.capabilities.needs_cpu_seq_lens and syncs:
                return CaseResult(case.id, Verdict.FAIL, f"{syncs:.2f} host syncs per steady-state async step while claiming "
                                  f"needs_cpu_seq_lens=False: {'; '.join(measured.host_sync_sources[:2])}",
                                  tag=case.tag, metrics=metrics, evidence=evidence)
        reason = f"async == sync == plain, also with {drafting}" + (f"; {len(evidence['near_ties'])} near-tie flip(s)" if evidence.get("near_ties") else "")
        if device.type == "cuda" and not decodes:
            reason += "; steady-state steps not measured (a built-in decodes: this backend serves MLA's prefill)"
        if metrics.get("host_syncs_per_steady_step") is not None:
            reason += f"; {metrics['host_syncs_per_steady_step']:.2f} syncs/step, GPU idle {metrics['gpu_idle_fraction']:.1%}"
        return CaseResult(case.id, Verdict.PASS, reason, tag=case.tag, metrics=metrics, evidence=evidence)

    def _draft_update_problem(self, backend_cls, updated: int, run_drafting, drafting: str, evidence: dict) -> str | None:
        """A backend claiming draft_step_update must draft exactly what it drafts with its metadata
        built afresh for every draft step. Compared on the drafts themselves (through a digest of
        every verified token), not on what is accepted: a wrong draft is usually rejected anyway,
        so a stale length in one row's draft step hides in the acceptance counts."""
        _, rebuilt = run_drafting(rebuild=True)
        evidence["verified_drafts_digest"] = {"update_for_draft_step": updated, "metadata_rebuilt": rebuilt}
        if updated == rebuilt:
            return None
        if not backend_cls.capabilities.deterministic and run_drafting()[1] != updated:
            evidence["verified_drafts_digest"]["note"] = ("two identical runs drafted differently (determinism not "
                                                          "claimed): the update path could not be compared")
            return None
        return (f"{drafting}: update_for_draft_step drafts other tokens than the same steps with the metadata built "
                "afresh for every draft step (a stale or wrongly advanced length, block table or plan in the draft "
                "loop; the engine's output is still right because wrong drafts are rejected)")

    def _difference(self, label, got, expected, prompts, model, base, device, evidence) -> str | None:
        """None when equal or every difference is an explained near-tie; else the failure reason."""
        from reference_engine.core import EngineConfig
        from reference_engine.engine import Engine
        from reference_engine.equality import explain, first_divergence

        reference = None
        for index, (a, b) in enumerate(zip(expected, got)):
            at = first_divergence(a, b)
            if at is None:
                continue
            if at >= min(len(a), len(b)):
                return f"{label}: prompt {index} has {len(b)} tokens, expected {len(a)}"
            if reference is None:
                reference = Engine(EngineConfig(model=base.model, backend="torch_naive", device=str(device),
                                                dtype=torch.float32, block_size=base.block_size), copy.deepcopy(model).float())
            why = explain(reference, prompts[index], a[:at], a[at], b[at])
            where = (f"{label}: prompt {index}, output token {at}: {b[at]} instead of {a[at]} (fp32 margin {why.margin:.4f}, "
                     f"{why.behind_top:.4f} below the top logit, near-tie tolerance {why.tolerance(base.dtype):.4f})")
            if not why.is_near_tie(base.dtype):
                return where
            evidence.setdefault("near_ties", []).append(where)
        return None
