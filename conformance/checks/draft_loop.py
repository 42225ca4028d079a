"""draft-loop: k EAGLE-style draft steps, each appending one token per request, under CUDA graphs,
every step against the oracle (the loop itself: ``harness.draft_loop``). A token-tree case's
loop drafts its trees level by level instead, each step extending every branch
(``harness.tree_draft_loop``); a DCP case's steps are sharded over its ranks, a graph a rank
(``harness.dcp_draft_loop``)."""

from __future__ import annotations

from typing import Any

import torch

from backends.base import AttentionBackend
from conformance.cases.grammar import Case
from conformance.checks.base import EVERY_KIND, Check
from conformance.harness.answers import answer_for
from conformance.harness.comparison import TOLERANCES
from conformance.harness.dcp_draft_loop import run_dcp_draft_loop
from conformance.harness.draft_loop import (
    DRAFT_RUNS,
    DRAFT_STEPS,
    DraftLoop,
    draft_padding,
    run_one_graph_loop,
    run_rebuilt_loop,
)
from conformance.harness.graph_batches import graph_class_reason
from conformance.harness.graphs import cuda_graph_skip_reason, step_layers
from conformance.harness.step import PoolFill
from conformance.harness.tree_draft_loop import grown_case, max_depth, run_tree_draft_loop
from conformance.results import Outcome, Verdict


class DraftLoopCheck(Check):
    name = "draft-loop"
    kinds = EVERY_KIND
    drives_trees = True  # a tree case's trees drafted level by level (``harness.tree_draft_loop``)
    drives_dcp = True  # a dcpN case's steps sharded over its ranks, a graph each (``harness.dcp_draft_loop``)
    question = "k draft steps under CUDA graphs, positions advanced on device: every step right?"

    def skip_reason(self, backend_cls: type[AttentionBackend], device: torch.device) -> str | None:
        return cuda_graph_skip_reason(backend_cls, device, "the draft loop runs under CUDA graphs")

    def case_skip_reason(self, backend_cls, case: Case, device) -> str | None:
        if case.trees:  # every step's batch: the graphs the backend claims must hold it
            return super().case_skip_reason(backend_cls, case, device) or self._tree_graph_reason(backend_cls, case)
        if any(query != 1 for _, query in case.batch):
            return "the draft loop starts from decode batches (query length 1), or from a token-tree case's trees"
        if case.dcp > 1 and case.spec.fp8_kv_cache:
            return "a DCP draft loop's oracle is over float keys: an fp8 cache's DCP steps are judged by numerics"
        return super().case_skip_reason(backend_cls, case, device)

    @staticmethod
    def _tree_graph_reason(backend_cls, case: Case) -> str | None:
        """Why a tree draft step cannot be captured under the claimed graph level (query lengths
        that differ within a step, for a backend claiming uniform batches only)."""
        for level in range(max_depth(case) + 1):
            reason = graph_class_reason(backend_cls.capabilities.cuda_graphs, grown_case(case, level))
            if reason:
                return f"tree draft step {level + 1}: {reason}"
        return None

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        if case.trees:
            return run_tree_draft_loop(backend_cls, case, device)
        if case.dcp > 1:
            return run_dcp_draft_loop(backend_cls, case, device)
        one_graph = backend_cls.capabilities.draft_step_update
        mode = (
            "one graph for all k steps (draft_step_update)"
            if one_graph
            else "one-step graph, metadata rebuilt on the host"
        )
        atol, rtol = TOLERANCES[case.spec.dtype]
        answer = answer_for(case.spec)
        metrics: dict[str, Any] = {"mode": mode}
        for num_steps, padding_row, warm, fill in DRAFT_RUNS:
            padding = draft_padding(backend_cls, num_steps)
            loop = DraftLoop(
                backend_cls,
                case,
                num_steps,
                device,
                padding_row=padding_row,
                fill=fill,
                padding=padding,
                layers=step_layers(case),
            )
            (run_one_graph_loop if one_graph else run_rebuilt_loop)(loop, warm=warm)
            failing, details = loop.first_failing_step(atol, rtol)
            layout = (
                f"padding last ({padding.value})" if padding_row else "no padding row (the last row a real request)"
            )
            layout += "" if warm else ", captured without warm-up"
            layout += ", NaN in every unowned slot" if fill == PoolFill.NAN else ""
            lse_problem = loop.lse_problem() if failing is None else None
            if lse_problem:
                return Outcome(
                    Verdict.FAIL,
                    f"k={num_steps} ({layout}): the LSE of the draft steps under graphs — {lse_problem} — {mode}",
                    metrics={**metrics, "k": num_steps},
                )
            if failing is not None:
                layer = f" (layer {details['layer']}: its own pool, scales and sinks)" if details["layer"] else ""
                reason = (
                    f"k={num_steps} ({layout}): draft step {failing + 1} of {num_steps}{layer} differs from the oracle "
                    f"({answer.count(details)}, worst at {answer.worst_place(details['worst'])}) — {mode}"
                )
                return Outcome(
                    Verdict.FAIL,
                    reason,
                    metrics={**metrics, "k": num_steps, "first_failing_step": failing + 1},
                    evidence={"worst": details.get("worst")},
                )
        padded = " and ".join(sorted({draft_padding(backend_cls, k).value for k, row, *_ in DRAFT_RUNS if row}))
        return Outcome(
            Verdict.PASS,
            f"k in {DRAFT_STEPS} (with and without padding ({padded}), captured with and "
            f"without warm-up, unowned slots loud and NaN): every step equal to the oracle — {mode}",
            metrics=metrics,
        )
