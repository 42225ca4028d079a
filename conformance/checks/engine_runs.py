"""The engine runs one engine-check case compares, each made once, when a claim first needs it
(``EngineCheck._claims``), and the claims that need more than two runs' tokens.

Every run is a fresh ``BatchedEngine`` over the same model, prompts and backend; they differ in
speculation (none, the scripted drafter, drafting through the backend), scheduling (sync or
async), CUDA graphs and MLA's decompressed prefill. A run is deterministic given those, so the order
in which claims ask for them does not change what they hold.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from backends.base import AttentionBackend
from conformance.cases.grammar import Case
from conformance.checks.engine_model import cache_config, model_and_prompts
from reference_engine.attention_split import AUTO, Routing
from reference_engine.model_attention import plan_attention

SPEC_TOKENS = 3
STEADY_STEPS = 128  # the measured run's steady-state steps, at least
STEADY_TOKENS = 400  # tokens per prompt that give them: at most k + 1 = 4 a step, prompts of up to 64 in 512
DRAFTER = "scripted:random:0.5"
ATTENTION_DRAFTER = "layer-skip"  # drafts through the backend under test


class TooFewSteadySteps(Exception):
    """The measured run had fewer steady-state steps than the check watches: an ERROR, not a verdict."""


class EngineRuns:
    def __init__(
        self,
        backend_cls: type[AttentionBackend],
        case: Case,
        device: torch.device,
        routings: list[Routing],
        options: dict[str, Any],
    ) -> None:
        from reference_engine.core import EngineConfig
        from reference_engine.sampling import SamplingParams

        self.backend_cls, self.case, self.device, self.routings, self.options = (
            backend_cls,
            case,
            device,
            routings,
            options,
        )
        spec = case.spec
        self.model, self.prompts = model_and_prompts(case, device, (5, 23, 40, 64))
        self.params = SamplingParams(max_tokens=32, ignore_eos=True)
        backend_ref = (
            f"{backend_cls.__module__}:{backend_cls.__qualname__}"  # the class under test, however it was named
        )
        self.base = EngineConfig(
            model=self.model.config,
            backend=backend_ref,
            device=str(device),
            dtype=spec.dtype,
            block_size=spec.block_size,
            num_blocks=64,
            max_num_reqs=4,
            max_num_tokens=128,
            **cache_config(case),
        )
        self.prefill_backend = options.get("prefill_backend", AUTO)
        self.plans = plan_attention(
            backend_cls,
            self.model.config,
            spec.dtype,
            spec.block_size,
            spec.kv_cache_dtype,
            device,
            self.prefill_backend,
        )
        self.graphs = device.type == "cuda"
        self.drafting = f"{ATTENTION_DRAFTER} drafting{' under CUDA graphs' if self.graphs else ''}"
        self.metrics: dict[str, Any] = {}
        self.evidence: dict[str, Any] = {}

    # What the plan says -------------------------------------------------------------------------

    @property
    def decompressed_prefill(self) -> bool:
        """An MLA model whose prefills run decompressed through a backend claiming that layer."""
        return any(plan.prefill_cls is not None for plan in self.plans)

    @property
    def decodes(self) -> bool:
        """The backend under test decodes every layer (MLA prefill's layer: a built-in decodes)."""
        return all(plan.backend_cls is self.backend_cls for plan in self.plans)

    @property
    def measures_steady_steps(self) -> bool:
        """Only where the count can fail: a backend claiming it needs host lengths may sync, so
        its long steady-state runs (the timed one and the one under the detector, the most
        expensive part of the check: 70 % of torch_naive's engine time) would gate nothing."""
        return self.device.type == "cuda" and self.decodes and not self.backend_cls.capabilities.needs_cpu_seq_lens

    # The runs -----------------------------------------------------------------------------------

    def engine_for(self, **changes):
        from reference_engine.batched_engine import BatchedEngine

        engine = BatchedEngine(
            dataclasses.replace(self.base, prefill_backend=self.prefill_backend, **changes), self.model
        )
        self.routings.extend(engine.backend.routings())
        return engine

    def tokens(self, **changes) -> list[list[int]]:
        return [out.tokens for out in self.engine_for(**changes).generate(self.prompts, self.params)]

    @functools.cached_property
    def plain(self) -> list[list[int]]:
        """Plain decoding (no speculation), synchronous: the reference."""
        return self.tokens(num_spec_tokens=0, drafter="none", async_scheduling=False)

    @functools.cached_property
    def absorbed(self) -> list[list[int]]:
        """Plain decoding with every request absorbed (no decompressed MLA prefill)."""
        return self.tokens(num_spec_tokens=0, drafter="none", async_scheduling=False, decompressed_mla_prefill=False)

    @functools.cached_property
    def sync(self) -> list[list[int]]:
        return self.tokens(num_spec_tokens=SPEC_TOKENS, drafter=DRAFTER, async_scheduling=False)

    @functools.cached_property
    def overlapped(self) -> list[list[int]]:
        """The async loop with the debug input checks on (InputCheckFailed propagates)."""
        return self.tokens(num_spec_tokens=SPEC_TOKENS, drafter=DRAFTER, check_inputs=True)

    def drafting_run(self, rebuild: bool = False):
        """A synchronous run drafting through the backend: its outputs, and the digest of every
        token it verified (the drafts it proposed, as the target saw them)."""
        engine = self.engine_for(
            num_spec_tokens=SPEC_TOKENS,
            drafter=ATTENTION_DRAFTER,
            async_scheduling=False,
            cuda_graphs=self.graphs,
            check_inputs=True,
            rebuild_draft_metadata=rebuild,
        )
        return engine.generate(self.prompts, self.params), engine.verified_digest()

    @functools.cached_property
    def drafted(self):
        return self.drafting_run()

    @property
    def drafted_sync(self) -> list[list[int]]:
        return [out.tokens for out in self.drafted[0]]

    @functools.cached_property
    def drafted_async(self) -> list[list[int]]:
        return self.tokens(
            num_spec_tokens=SPEC_TOKENS, drafter=ATTENTION_DRAFTER, cuda_graphs=self.graphs, check_inputs=True
        )

    # Claims over more than two runs' tokens -----------------------------------------------------

    def draft_update_problem(self) -> str | None:
        """A backend claiming draft_step_update must draft exactly what it drafts with its metadata
        built afresh for every draft step. Compared on the drafts themselves (through a digest of
        every verified token), not on what is accepted: a wrong draft is usually rejected anyway,
        so a stale length in one row's draft step hides in the acceptance counts."""
        updated = self.drafted[1]
        _, rebuilt = self.drafting_run(rebuild=True)
        self.evidence["verified_drafts_digest"] = {"update_for_draft_step": updated, "metadata_rebuilt": rebuilt}
        if updated == rebuilt:
            return None
        if not self.backend_cls.capabilities.deterministic and self.drafting_run()[1] != updated:
            self.evidence["verified_drafts_digest"]["note"] = (
                "two identical runs drafted differently (determinism not "
                "claimed): the update path could not be compared"
            )
            return None
        return (
            f"{self.drafting}: update_for_draft_step drafts other tokens than the same steps with the metadata built "
            "afresh for every draft step (a stale or wrongly advanced length, block table or plan in the draft "
            "loop; the engine's output is still right because wrong drafts are rejected)"
        )

    def graph_acceptance_problem(self) -> str | None:
        """Drafts never change a lossless engine's output, only what is accepted: the draft steps
        under graphs (update_for_draft_step, or the replayed step graph) must accept exactly what
        the same backend's eager draft steps (metadata rebuilt) accept."""
        eager = self.engine_for(
            num_spec_tokens=SPEC_TOKENS, drafter=ATTENTION_DRAFTER, async_scheduling=False, cuda_graphs=False
        ).generate(self.prompts, self.params)
        accepted = [out.accepted for out in self.drafted[0]]
        expected = [out.accepted for out in eager]
        self.evidence["accepted_drafts"] = {"under_graphs": accepted, "eager": expected}
        if accepted == expected:
            return None
        return (
            f"{self.drafting}: accepted drafts per prompt {accepted}, but {expected} with the same backend's eager "
            "draft steps: the draft steps under CUDA graphs attend differently (update_for_draft_step?)"
        )

    def steady_problem(self) -> str | None:
        """The async loop measured over at least STEADY_STEPS steady-state steps, under CUDA graphs:
        host syncs per step must be 0 for a backend claiming needs_cpu_seq_lens=False. A decode-only
        backend's k + 1 verify rows would go to the companion, so it is measured decoding plainly."""
        from reference_engine.metrics import measure
        from reference_engine.sampling import SamplingParams

        capabilities = self.backend_cls.capabilities
        verifies = capabilities.query_len_reason(SPEC_TOKENS + 1) is None
        block = self.case.spec.block_size
        engine = self.engine_for(
            num_spec_tokens=SPEC_TOKENS if verifies else 0,
            drafter=DRAFTER if verifies else "none",
            cuda_graphs=True,
            num_blocks=4 * -(-(64 + STEADY_TOKENS + SPEC_TOKENS + 1) // block) + 1,
        )
        engine.generate(
            self.prompts, SamplingParams(max_tokens=2 * SPEC_TOKENS + 4, ignore_eos=True)
        )  # warm-up: JIT, graph captures
        # A long look: at least STEADY_STEPS steady steps (a backend syncing or re-planning only
        # every Nth step shows there), the prompts decoding far past the checked run.
        steady = SamplingParams(max_tokens=STEADY_TOKENS, ignore_eos=True)
        _, measured = measure(
            engine, self.prompts, steady, detect_syncs=True, strategy=self.options.get("sync_detector", "auto")
        )
        self.metrics.update(
            {
                key: measured.to_dict()[key]
                for key in (
                    "tpot_ms",
                    "gpu_idle_fraction",
                    "host_syncs_per_steady_step",
                    "steady_steps",
                    "acceptance_length",
                    "graph_replays",
                )
            }
        )
        if measured.steady_steps < STEADY_STEPS:
            raise TooFewSteadySteps(
                f"the measured run had {measured.steady_steps} steady-state steps, fewer than the "
                f"{STEADY_STEPS} the engine check watches"
            )
        self.evidence["host_sync_sources"] = measured.host_sync_sources
        syncs = measured.host_syncs_per_steady_step
        if capabilities.needs_cpu_seq_lens or not syncs:
            return None
        return (
            f"{syncs:.2f} host syncs per steady-state async step while claiming needs_cpu_seq_lens=False: "
            f"{'; '.join(measured.host_sync_sources[:2])}"
        )
