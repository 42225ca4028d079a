"""Which cases make each layer parameter matter on each path.

A parameter is tested on a path only where the data make it matter there: a soft cap over logits
of a few units changes nothing (``cap · tanh(s / cap) ≈ s``), so a backend that drops the cap on
its decode path alone passes every such case. ``parameter_coverage`` finds, for every (parameter,
path), ``CASES_PER_CELL`` suite cases on whose rows of that path the oracle's answer *without* the
parameter (or with it mis-applied: the default scale, no cap, no window, an fp8 scale of 1) is at
least ``MARGIN`` times the tolerance away from the right one: two, because a defect may hide on
one case's particular data. A test fails when a cell has fewer.

The log-sum-exp's head index is such a parameter too (``LseHeadIndex``): an LSE written for
another query head of the KV group (the KV head's index, or the group's first head) must be
``MARGIN`` times the LSE's tolerance (``lse_pass``) away on the ``lse`` cases' rows of each path.

Paths: ``decode`` (rows of one new token), ``verify`` (2 to 8), ``prefill`` (more), ``mixed`` (a
batch holding decode and prefill rows), ``graphs`` (a batch of one query length, which every
graph-capable backend replays), ``draft-loop`` (the draft loop's batch drawn from a decode case:
``draft_loop.DraftLoop``, k = 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from conformance.cases.grammar import Case
from conformance.cases.kv_quantization import dequantize, quantize
from conformance.cases.oracle import layer_reference
from conformance.harness.batch import PagedBatch, materialize
from conformance.harness.comparison import TOLERANCES
from conformance.harness.lse_pass import LSE_ATOL, LSE_RTOL, query_rounding

MARGIN = 10.0  # how far (× the tolerance) the answer without the parameter must be
CASES_PER_CELL = 2  # distinct cases per (parameter, path): a defect may hide on one case's data
PATHS = ("decode", "verify", "prefill", "mixed", "graphs", "draft-loop")
DRAFT_STEPS = 2  # the draft loop's shortest run
MAX_QUERY_VERIFY = 8

Found = tuple[str, float]  # a case's id and how far (× the tolerance) its rows of the path move


@dataclass(frozen=True)
class Parameter:
    """Something of the layer a backend can get wrong on one path alone."""

    name: str
    applies: Callable[[Case], bool]  # the case sets it (other than its default)

    def how_wrong(self, batch: PagedBatch) -> torch.Tensor:
        """[ways, T]: for each way of getting it wrong, each token row's largest error over its
        tolerance. A cell needs every way to be far off."""
        raise NotImplementedError


@dataclass(frozen=True)
class LayerParameter(Parameter):
    """A layer option the output depends on."""

    # The oracle's keyword changes that drop or mis-apply it: (k scale, v scale) for an fp8 cache.
    dropped: Callable[[Case], dict]

    def how_wrong(self, batch: PagedBatch) -> torch.Tensor:
        right, wrong = answer(batch), answer(batch, **self.dropped(batch.case))
        atol, rtol = TOLERANCES[batch.spec.dtype]
        # A token left without any key (a sparse row with no entry once its window part is
        # dropped) has no answer: it is not counted, so the margin comes from the others alone.
        ratio = ((wrong - right).abs() / (atol + rtol * right.abs())).nan_to_num(nan=0.0)
        return ratio.amax(dim=(1, 2))[None]


@dataclass(frozen=True)
class LseHeadIndex(Parameter):
    """The log-sum-exp's query head: an LSE kept per KV head hands query head h another head's
    of its group. ``misreads``: (query heads, group size) → the head whose LSE each one gets."""

    misreads: tuple[Callable[[torch.Tensor, int], torch.Tensor], ...]

    def how_wrong(self, batch: PagedBatch) -> torch.Tensor:
        _, right = oracle(batch)
        allowed = LSE_ATOL + LSE_RTOL * right.abs() + query_rounding(batch)
        heads = torch.arange(batch.spec.num_heads)
        group = batch.spec.query_group_size
        return torch.stack(
            [((right[:, misread(heads, group)] - right).abs() / allowed).amax(dim=1) for misread in self.misreads]
        )


PARAMETERS: tuple[Parameter, ...] = (
    LayerParameter(
        "softmax scale",
        lambda case: case.spec.scale is not None and case.spec.kind == "mha",
        lambda case: {"scale": 1.0 / math.sqrt(case.spec.head_dim)},
    ),
    LayerParameter(
        "softmax scale, MLA",
        lambda case: case.spec.scale is not None and case.spec.kind == "mla",
        lambda case: {"scale": 1.0 / math.sqrt(case.spec.head_dim)},
    ),
    LayerParameter(
        "logits soft cap", lambda case: case.spec.logits_soft_cap is not None, lambda case: {"logits_soft_cap": None}
    ),
    LayerParameter(
        "sliding window", lambda case: case.spec.sliding_window is not None, lambda case: {"sliding_window": None}
    ),
    LayerParameter("fp8 k_scale", lambda case: case.kv_scales is not None, lambda case: {"k_scale": 1.0}),
    LayerParameter(
        "fp8 v_scale",
        lambda case: case.kv_scales is not None and case.spec.kind != "mla",
        lambda case: {"v_scale": 1.0},
    ),
    LayerParameter("fp8 q_scale", lambda case: case.q_scale is not None, lambda case: {"q_scale": 1.0}),
    LayerParameter("learned sinks", lambda case: case.spec.attention_sinks, lambda case: {"sinks": None}),
    LayerParameter(
        "sparse window part", lambda case: case.spec.sparse_window is not None, lambda case: {"sparse_window": None}
    ),
    LseHeadIndex(
        "log-sum-exp per query head",
        lambda case: case.lse and case.spec.query_group_size > 1,
        (
            lambda heads, group: heads // group,  # read or written with the KV head's index
            lambda heads, group: heads // group * group,  # one LSE per group: its first head's
        ),
    ),
)


def path_rows(case: Case) -> dict[str, list[int]]:
    """The token rows of each eager path the case has (``mixed``: every row of a batch that holds
    decode and prefill rows; ``graphs``: every row of a batch of one query length)."""
    rows: dict[str, list[int]] = {"decode": [], "verify": [], "prefill": []}
    start = 0
    for _, query in case.batch:
        path = "decode" if query == 1 else "verify" if query <= MAX_QUERY_VERIFY else "prefill"
        rows[path] += range(start, start + query)
        start += query
    everything = list(range(start))
    if rows["decode"] and rows["prefill"]:
        rows["mixed"] = everything
    if len({query for _, query in case.batch}) == 1 and case.dcp == 1:  # the graphs check skips DCP cases
        rows["graphs"] = everything
    return {path: indices for path, indices in rows.items() if indices}


def oracle(batch: PagedBatch, **changes) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's answer [T, H, Dv] and log-sum-exp [T, H] for ``batch`` with ``changes`` to the
    layer (an fp8 cache quantized as the contract says, then dequantized with the given or the
    case's scales)."""
    case, spec = batch.case, batch.spec
    k_scale, v_scale = case.kv_scales or (None, None)
    used_k, used_v = changes.pop("k_scale", k_scale), changes.pop("v_scale", v_scale)
    used_q = changes.pop("q_scale", None)
    outputs, sums = [], []
    for request, (context_len, _) in enumerate(case.batch):
        options = {**batch.oracle_inputs(request), **changes}
        start, end = batch.query_start_loc[request], batch.query_start_loc[request + 1]
        key, value = batch.keys[request], batch.values[request]
        if k_scale is not None:
            key = dequantize(quantize(key, k_scale, spec.kv_cache_dtype), used_k)
            value = None if value is None else dequantize(quantize(value, v_scale, spec.kv_cache_dtype), used_v)
        out, lse = layer_reference(
            spec,
            batch.query_values(start, end, used_q),
            key,
            value,
            context_len=context_len,
            return_lse=True,
            **options,
        )
        outputs.append(out)
        sums.append(lse)
    return torch.cat(outputs), torch.cat(sums)


def answer(batch: PagedBatch, **changes) -> torch.Tensor:
    """The oracle's answer for ``batch`` [T, H, Dv] with ``changes`` to the layer (``oracle``)."""
    return oracle(batch, **changes)[0]


def how_far(case: Case, parameter: Parameter) -> dict[str, float]:
    """Per path of the case: how far its rows of that path move when the parameter is got wrong
    (the largest error over the tolerance; of the ways to get it wrong, the one that moves them
    least)."""
    ratio = parameter.how_wrong(materialize(case, "cpu"))
    return {path: float(ratio[:, rows].amax(dim=1).amin()) for path, rows in path_rows(case).items()}


def draft_case(case: Case) -> Case | None:
    """The draft loop's batch drawn from a decode case (each request gains DRAFT_STEPS tokens;
    boundary data unless the case has a profile of its own), or None for other cases (and for a
    DCP case: the draft loop does not shard its steps)."""
    if any(query != 1 for _, query in case.batch) or case.dcp > 1:
        return None
    return replace(
        case,
        batch=tuple((context, DRAFT_STEPS) for context, _ in case.batch),
        data="edges" if case.data == "normal" else case.data,
    )


def parameter_coverage(cases: list[Case]) -> dict[tuple[str, str], list[Found]]:
    """(parameter, path) → the CASES_PER_CELL smallest cases that make it matter there by MARGIN
    (each with its ratio), fewer where the suite has fewer. Smallest first: a cell is settled by
    the cheapest cases that settle it."""
    cases = sorted(cases, key=lambda case: case.kv_elements)
    coverage: dict[tuple[str, str], list[Found]] = {
        (parameter.name, path): [] for parameter in PARAMETERS for path in PATHS
    }
    for parameter in PARAMETERS:
        for case in cases:
            if not parameter.applies(case) or case.big_pool:
                continue
            wanted = [path for path in PATHS if len(coverage[parameter.name, path]) < CASES_PER_CELL]
            if not wanted:
                break
            for path, ratio in how_far(case, parameter).items():
                if path in wanted and ratio >= MARGIN:
                    coverage[parameter.name, path].append((case.id, ratio))
            drafted = draft_case(case)
            if "draft-loop" in wanted and drafted is not None:
                ratio = how_far(drafted, parameter)["verify"]
                if ratio >= MARGIN:
                    coverage[parameter.name, "draft-loop"].append((case.id, ratio))
    return coverage


def coverage_table(coverage: dict[tuple[str, str], list[Found]]) -> list[str]:
    """The matrix as Markdown rows (docs/checks.md, "Every parameter at work on every path")."""
    lines = ["| parameter | " + " | ".join(PATHS) + " |", "|---" * (len(PATHS) + 1) + "|"]
    for parameter in PARAMETERS:
        cells = []
        for path in PATHS:
            found = coverage[parameter.name, path]
            cells.append(", ".join(f"`{case_id}` ({ratio:.0f}×)" for case_id, ratio in found) or "**none**")
        lines.append(f"| {parameter.name} | " + " | ".join(cells) + " |")
    return lines
