"""The engine runs one engine-check case compares, each made once, when a claim first needs it
(``EngineCheck._claims``), and the claims that need more than two runs' tokens.

Every run is a fresh ``BatchedEngine`` over the same model and prompts; they differ in speculation
(none, the scripted drafter, drafting through the backend), scheduling (sync or async), CUDA graphs
and MLA's decompressed prefill. All but one run through the backend under test; the reference run
goes through torch_naive, the suite's independent reference, so that an error the backend makes the
same way in every run (a first layer's state kept for every layer) has something to differ from. A
run is deterministic given those, so the order in which claims ask for them does not change what
they hold.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from backends.base import AttentionBackend
from conformance.cases.grammar import Case
from conformance.harness.engine_model import cache_config, model_and_prompts, query_config
from reference_engine.attention_split import AUTO, Routing
from reference_engine.loop_tokens import StepBatch, batched_apart, parted_at, steps_of
from reference_engine.model_attention import plan_attention

SPEC_TOKENS = 3
# The independent reference: plain PyTorch, one request at a time, sharing no kernel with any
# other backend (imported only when a case runs: the run's own process never imports backends).
REFERENCE = "torch_naive"
STEADY_STEPS = 128  # the measured run's steady-state steps, at least
# The measured run's requests: the four prompts twice, each with its own max_tokens, through the
# engine's four request slots, so the batch changes inside the measured window as continuous
# batching changes it. The first four finish one by one and each finish lets a waiting request
# join; the joiners finish one by one with none waiting, so the batch shrinks 4 → 3 → 2 → 1. At
# 1 + k = 4 tokens a step at most, these give well over STEADY_STEPS decode steps (about 200 at
# the scripted drafter's acceptance, twice as many at k = 0); every request fits in 512 positions.
STEADY_MAX_TOKENS = (60, 120, 180, 240, 300, 200, 100, 150)
WARM_UP_MAX_TOKENS = (10, 20, 30, 40)  # finishing apart: every padded graph size, 4, 2 and 1, seen twice
DRAFTER = "scripted:random:0.5"
ATTENTION_DRAFTER = "layer-skip"  # drafts through the backend under test
# A token-tree layout's runs: EAGLE with a head made of the target's first layer (its guesses
# agree with the target often, so paths leave the first branch and accepted KV moves), drafting
# a dynamic top-4 tree of 8 (EAGLE-2, SGLang's shape) and a static binary tree of depth 2, both
# through the backend under test; tree steps run eagerly.
TREE_DRAFTER = "eagle"
TREE_SHAPES = ("topk=4", "-1.0.0.1.1.2.2")
TREE_SPEC_TOKENS = (8, 6)


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
            **query_config(case),
            dcp=case.dcp,
        )
        self.prefill_backend = options.get("prefill_backend", AUTO)
        self.plans = plan_attention(
            backend_cls,
            self.model.config,
            spec.dtype,
            spec.block_size,
            cache_config(self.case).get("kv_cache_dtype"),
            device,
            self.prefill_backend,
            decompressed_prefill=case.dcp == 1,  # a DCP rank's rows are decodes: MLA runs absorbed
            kv_scale_block=cache_config(self.case).get("kv_scale_block"),
            query_dtype=case.spec.query_dtype,
        )
        self.trees = bool(case.trees)  # a token-tree layout: its engines draft and verify trees
        self.graphs = device.type == "cuda" and not self.trees
        self.drafting = (
            "EAGLE token trees (top-k 4 of 8, and static) drafted and verified through the backend"
            if self.trees
            else f"{ATTENTION_DRAFTER} drafting{' under CUDA graphs' if self.graphs else ''}"
        )
        self.metrics: dict[str, Any] = {}
        self.evidence: dict[str, Any] = {}

    # What the plan says -------------------------------------------------------------------------

    @property
    def decompressed_prefill(self) -> bool:
        """An MLA model whose prefills run decompressed through a backend claiming that layer."""
        return any(plan.prefill_cls is not None for plan in self.plans)

    @property
    def decodes(self) -> bool:
        """The backend under test serves every layer of its case's role each step: the attention
        (MLA prefill's layer: a built-in decodes), or a sparse model's indexer."""
        indexes = not self.case.spec.layout.attends
        return all(plan.backend_cls is self.backend_cls for plan in self.plans if plan.indexes == indexes)

    @property
    def measures_steady_steps(self) -> bool:
        """Only where the count can fail: a backend claiming it needs host lengths may sync, so
        its long steady-state runs (the timed one and the one under the detector, the most
        expensive part of the check: 70 % of torch_naive's engine time) would gate nothing."""
        return self.device.type == "cuda" and self.decodes and not self.backend_cls.capabilities.needs_cpu_seq_lens

    @functools.cached_property
    def reference_missing(self) -> str | None:
        """Why the plain run is not compared with the same run through torch_naive, or None: the
        backend under test is torch_naive itself, or torch_naive cannot run this model here."""
        from backends import registry

        reference_cls = registry.load(REFERENCE)
        if self.backend_cls is reference_cls and self.case.dcp == 1:  # under DCP: torch_naive without it
            return f"the backend under test is {REFERENCE} itself"
        spec = self.case.spec
        try:
            plan_attention(
                reference_cls,
                self.model.config,
                spec.dtype,
                spec.block_size,
                cache_config(self.case).get("kv_cache_dtype"),
                self.device,
                AUTO,
                self.decompressed_prefill,
                kv_scale_block=cache_config(self.case).get("kv_scale_block"),
                query_dtype=spec.query_dtype,
            )
        except ValueError as error:
            return f"{REFERENCE} cannot run this model here: {error}"
        return None

    # The runs -----------------------------------------------------------------------------------

    def engine_for(self, **changes):
        from reference_engine.batched_engine import BatchedEngine
        from reference_engine.model import EagleHead

        head = EagleHead.from_target(self.model) if changes.get("draft_tree") else None
        engine = BatchedEngine(
            dataclasses.replace(self.base, prefill_backend=self.prefill_backend, **changes), self.model, head
        )
        self.routings.extend(engine.backend.routings())
        return engine

    def run(self, **changes) -> tuple[list[list[int]], list[StepBatch] | None]:
        """A run's tokens per prompt, and its steps as recorded (``loop_tokens.steps_of``)."""
        engine = self.engine_for(**changes)
        outputs = engine.generate(self.prompts, self.params)
        return [out.tokens for out in outputs], steps_of(engine)

    def tokens(self, **changes) -> list[list[int]]:
        return self.run(**changes)[0]

    @functools.cached_property
    def plain(self) -> list[list[int]]:
        """Plain decoding (no speculation), synchronous: the reference."""
        return self.tokens(num_spec_tokens=0, drafter="none", async_scheduling=False)

    @functools.cached_property
    def reference(self) -> list[list[int]]:
        """``plain`` through torch_naive: the same model, prompts, dtype, block size, KV-cache format
        and scales, sampling, and MLA prefill path (decompressed where the backend's plan
        decompresses it: torch_naive claims that layer too); without DCP, so that a DCP layout's
        merged ranks are held to attention over whole requests. Not in ``routings``: what
        torch_naive served is not the backend's."""
        from reference_engine.batched_engine import BatchedEngine

        config = dataclasses.replace(
            self.base,
            backend=REFERENCE,
            prefill_backend=AUTO,
            num_spec_tokens=0,
            drafter="none",
            async_scheduling=False,
            decompressed_mla_prefill=self.decompressed_prefill,
            dcp=1,
        )
        return [out.tokens for out in BatchedEngine(config, self.model).generate(self.prompts, self.params)]

    @functools.cached_property
    def absorbed(self) -> list[list[int]]:
        """Plain decoding with every request absorbed (no decompressed MLA prefill)."""
        return self.tokens(num_spec_tokens=0, drafter="none", async_scheduling=False, decompressed_mla_prefill=False)

    @functools.cached_property
    def sync_run(self) -> tuple[list[list[int]], list[StepBatch] | None]:
        return self.run(num_spec_tokens=SPEC_TOKENS, drafter=DRAFTER, async_scheduling=False)

    @property
    def sync(self) -> list[list[int]]:
        return self.sync_run[0]

    @functools.cached_property
    def overlapped_run(self) -> tuple[list[list[int]], list[StepBatch] | None]:
        """The async loop with the debug input checks on (InputCheckFailed propagates)."""
        return self.run(num_spec_tokens=SPEC_TOKENS, drafter=DRAFTER, check_inputs=True)

    @property
    def overlapped(self) -> list[list[int]]:
        return self.overlapped_run[0]

    def loops_batched_apart(self, prompt: int, index: int) -> bool | None:
        """Whether the sync and the async loop batched ``prompt``'s steps up to its output token
        ``index`` differently (``loop_tokens.batched_apart``): only then may a near tie flip between them."""
        (sync, sync_steps), (overlapped, overlapped_steps) = self.sync_run, self.overlapped_run
        return batched_apart(sync_steps, overlapped_steps, prompt, index, parted_at(sync, overlapped))

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

    def tree_config(self, shape: int = 0) -> dict[str, Any]:
        """An engine drafting token tree ``TREE_SHAPES[shape]`` through the backend."""
        from reference_engine.draft_tree import DraftTree

        spec_tokens = TREE_SPEC_TOKENS[shape]
        return dict(
            num_spec_tokens=spec_tokens,
            drafter=TREE_DRAFTER,
            draft_tree=DraftTree.parse(TREE_SHAPES[shape], spec_tokens),
        )

    def tree_tokens(self, label: str, shape: int, **changes) -> list[list[int]]:
        """A tree run's tokens; its accepted drafts per prompt and how many accepted nodes' KV moved
        (a path off the first branch: what only a tree engine does) go into the evidence."""
        engine = self.engine_for(**self.tree_config(shape), **changes)
        outputs = engine.generate(self.prompts, self.params)
        self.evidence.setdefault("token_trees", {})[label] = {
            "accepted_drafts": [out.accepted for out in outputs],
            "accepted_nodes_moved": engine.moved_nodes(),
        }
        return [out.tokens for out in outputs]

    @functools.cached_property
    def tree_sync(self) -> list[list[int]]:
        return self.tree_tokens("top-k 4, sync", 0, async_scheduling=False)

    @functools.cached_property
    def tree_async(self) -> list[list[int]]:
        return self.tree_tokens("top-k 4, async", 0, check_inputs=True)

    @functools.cached_property
    def static_tree_async(self) -> list[list[int]]:
        return self.tree_tokens(f"static {TREE_SHAPES[1]}, async", 1, check_inputs=True)

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
        """The async loop measured over at least STEADY_STEPS steady-state steps, under CUDA graphs,
        with requests joining and leaving among them (``STEADY_MAX_TOKENS``): host syncs per step
        must be 0 for a backend claiming needs_cpu_seq_lens=False. A backend that syncs only when
        the batch changes shows only where it changes. A decode-only backend's k + 1 verify rows
        would go to the companion, so it is measured decoding plainly."""
        from reference_engine.metrics import measure, steady_iterations

        engine = self.steady_engine()
        # Warm-up: JIT, and the graph captures of every padded batch size the measured run reaches.
        engine.generate(self.prompts, steady_params(WARM_UP_MAX_TOKENS))
        prompts, params = self.steady_workload()
        _, measured = measure(
            engine, prompts, params, detect_syncs=True, strategy=self.options.get("sync_detector", "auto")
        )
        changes = list(steady_iterations(engine).values())  # the detector's pass: the engine's last run
        self.record_steady(measured, changes)
        self.require_steady_window(measured.steady_steps, changes)
        self.evidence["host_sync_sources"] = measured.host_sync_sources
        syncs = measured.host_syncs_per_steady_step
        if self.backend_cls.capabilities.needs_cpu_seq_lens or not syncs:
            return None
        return (
            f"{syncs:.2f} host syncs per steady-state async step while claiming needs_cpu_seq_lens=False "
            f"(over {measured.steady_steps} steps, {len(changes) - changes.count('')} of them right after a "
            f"request joined or left): {'; '.join(measured.host_sync_sources[:2])}"
        )

    def steady_engine(self):
        """The measured engine: async, CUDA graphs, the scripted drafter (plain decoding for a
        backend that cannot verify k + 1 tokens), a pool no request can run out of."""
        slots = self.base.max_num_reqs
        blocks = slots * -(-self.model.config.max_model_len // self.base.kv_block_size) + 1
        if self.trees:  # the dynamic tree: its shape is chosen on the device, the host never sees it
            return self.engine_for(**self.tree_config(), cuda_graphs=True, num_blocks=blocks)
        verifies = self.backend_cls.capabilities.query_len_reason(SPEC_TOKENS + 1) is None
        return self.engine_for(
            num_spec_tokens=SPEC_TOKENS if verifies else 0,
            drafter=DRAFTER if verifies else "none",
            cuda_graphs=True,
            num_blocks=blocks,
        )

    def steady_workload(self) -> tuple[list[list[int]], list]:
        """The measured run's prompts (the check's, again and again) and their sampling, one
        ``STEADY_MAX_TOKENS`` entry each; a tree engine's, the entries twice over: it accepts more
        tokens a step (its path through top-4 of 8), and once over left as few as 125 steady
        steps (trtllm's tree case with sinks, H200), short of ``STEADY_STEPS``."""
        max_tokens = STEADY_MAX_TOKENS * (2 if self.trees else 1)
        count = len(max_tokens)
        return [self.prompts[index % len(self.prompts)] for index in range(count)], steady_params(max_tokens)

    def record_steady(self, measured, changes: list[str]) -> None:
        """The measured figures, and how many measured steps came right after the batch changed."""
        figures = measured.to_dict()
        for key in (
            "tpot_ms",
            "gpu_idle_fraction",
            "host_syncs_per_steady_step",
            "steady_steps",
            "acceptance_length",
            "graph_replays",
        ):
            self.metrics[key] = figures[key]
        self.metrics.update(
            {
                "composition_changes_measured": len(changes) - changes.count(""),
                "joins_measured": changes.count("join"),
                "leaves_measured": changes.count("leave"),
            }
        )

    @staticmethod
    def require_steady_window(steady_steps: int, changes: list[str]) -> None:
        """The window must hold what the claim watches: STEADY_STEPS steps (a backend syncing or
        re-planning only every Nth step shows there), a join and a leave among them; else ERROR."""
        if steady_steps < STEADY_STEPS:
            raise TooFewSteadySteps(
                f"the measured run had {steady_steps} steady-state steps, fewer than the "
                f"{STEADY_STEPS} the engine check watches"
            )
        missing = [word for change, word in (("join", "joined"), ("leave", "left")) if change not in changes]
        if missing:
            raise TooFewSteadySteps(
                f"none of the measured run's {steady_steps} steady-state steps came right after a request "
                f"{' or '.join(missing)}: the engine check watches the steps where the batch changes too"
            )


def steady_params(max_tokens: tuple[int, ...]):
    """One greedy SamplingParams per request, with these max_tokens."""
    from reference_engine.sampling import SamplingParams

    return [SamplingParams(max_tokens=tokens, ignore_eos=True) for tokens in max_tokens]
