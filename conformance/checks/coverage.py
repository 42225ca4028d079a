"""Which case makes each layer parameter matter on each path.

A parameter is tested on a path only where the data make it matter there: a soft cap over logits
of a few units changes nothing (``cap · tanh(s / cap) ≈ s``), so a backend that drops the cap on
its decode path alone passes every such case. ``parameter_coverage`` finds, for every (parameter,
path), a suite case on whose rows of that path the oracle's answer *without* the parameter (or
with it mis-applied: the default scale, no cap, no window, an fp8 scale of 1) is at least
``MARGIN`` times the tolerance away from the right one. A test fails when a cell has no case.

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
from conformance.checks.comparison import TOLERANCES
from conformance.harness.batch import PagedBatch, materialize

MARGIN = 10.0  # how far (× the tolerance) the answer without the parameter must be
PATHS = ("decode", "verify", "prefill", "mixed", "graphs", "draft-loop")
DRAFT_STEPS = 2  # the draft loop's shortest run
MAX_QUERY_VERIFY = 8


@dataclass(frozen=True)
class Parameter:
    name: str
    applies: Callable[[Case], bool]  # the case sets it (other than its default)
    # The oracle's keyword changes that drop or mis-apply it: (k scale, v scale) for an fp8 cache.
    dropped: Callable[[Case], dict]


PARAMETERS = (
    Parameter(
        "softmax scale",
        lambda case: case.spec.scale is not None and case.spec.kind == "mha",
        lambda case: {"scale": 1.0 / math.sqrt(case.spec.head_dim)},
    ),
    Parameter(
        "softmax scale, MLA",
        lambda case: case.spec.scale is not None and case.spec.kind == "mla",
        lambda case: {"scale": 1.0 / math.sqrt(case.spec.head_dim)},
    ),
    Parameter(
        "logits soft cap", lambda case: case.spec.logits_soft_cap is not None, lambda case: {"logits_soft_cap": None}
    ),
    Parameter(
        "sliding window", lambda case: case.spec.sliding_window is not None, lambda case: {"sliding_window": None}
    ),
    Parameter("fp8 k_scale", lambda case: case.kv_scales is not None, lambda case: {"k_scale": 1.0}),
    Parameter(
        "fp8 v_scale",
        lambda case: case.kv_scales is not None and case.spec.kind != "mla",
        lambda case: {"v_scale": 1.0},
    ),
    Parameter("learned sinks", lambda case: case.spec.attention_sinks, lambda case: {"sinks": None}),
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
    if len({query for _, query in case.batch}) == 1:
        rows["graphs"] = everything
    return {path: indices for path, indices in rows.items() if indices}


def answer(batch: PagedBatch, **changes) -> torch.Tensor:
    """The oracle's answer for ``batch`` [T, H, Dv] with ``changes`` to the layer (an fp8 cache
    quantized as the contract says, then dequantized with the given or the case's scales)."""
    case, spec = batch.case, batch.spec
    k_scale, v_scale = case.kv_scales or (None, None)
    used_k, used_v = changes.pop("k_scale", k_scale), changes.pop("v_scale", v_scale)
    options = {"sinks": batch.sinks, **changes}
    outputs = []
    for request, (context_len, _) in enumerate(case.batch):
        start, end = batch.query_start_loc[request], batch.query_start_loc[request + 1]
        key, value = batch.keys[request], batch.values[request]
        if k_scale is not None:
            key = dequantize(quantize(key, k_scale, spec.kv_cache_dtype), used_k)
            value = None if value is None else dequantize(quantize(value, v_scale, spec.kv_cache_dtype), used_v)
        outputs.append(layer_reference(spec, batch.query[start:end], key, value, context_len=context_len, **options))
    return torch.cat(outputs)


def how_far(case: Case, parameter: Parameter) -> dict[str, float]:
    """Per path of the case: the largest |answer without the parameter − answer| over the
    tolerance, on that path's rows."""
    batch = materialize(case, "cpu")
    right, wrong = answer(batch), answer(batch, **parameter.dropped(case))
    atol, rtol = TOLERANCES[case.spec.dtype]
    ratio = ((wrong - right).abs() / (atol + rtol * right.abs())).amax(dim=(1, 2))
    return {path: float(ratio[rows].max()) for path, rows in path_rows(case).items()}


def draft_case(case: Case) -> Case | None:
    """The draft loop's batch drawn from a decode case (each request gains DRAFT_STEPS tokens;
    boundary data unless the case has a profile of its own), or None for other cases."""
    if any(query != 1 for _, query in case.batch):
        return None
    return replace(
        case,
        batch=tuple((context, DRAFT_STEPS) for context, _ in case.batch),
        data="edges" if case.data == "normal" else case.data,
    )


def parameter_coverage(cases: list[Case]) -> dict[tuple[str, str], tuple[str, float] | None]:
    """(parameter, path) → (the smallest case that makes it matter there by MARGIN, its ratio), or
    None. Smallest first: a cell is settled by the cheapest case that settles it."""
    cases = sorted(cases, key=lambda case: case.kv_elements)
    coverage: dict[tuple[str, str], tuple[str, float] | None] = {
        (parameter.name, path): None for parameter in PARAMETERS for path in PATHS
    }
    for parameter in PARAMETERS:
        for case in cases:
            if not parameter.applies(case) or case.big_pool:
                continue
            wanted = [path for path in PATHS if coverage[parameter.name, path] is None]
            if not wanted:
                break
            for path, ratio in how_far(case, parameter).items():
                if path in wanted and ratio >= MARGIN:
                    coverage[parameter.name, path] = (case.id, ratio)
            drafted = draft_case(case)
            if "draft-loop" in wanted and drafted is not None:
                ratio = how_far(drafted, parameter)["verify"]
                if ratio >= MARGIN:
                    coverage[parameter.name, "draft-loop"] = (case.id, ratio)
    return coverage


def coverage_table(coverage: dict[tuple[str, str], tuple[str, float] | None]) -> list[str]:
    """The matrix as Markdown rows (docs/checks.md, "Every parameter at work on every path")."""
    lines = ["| parameter | " + " | ".join(PATHS) + " |", "|---" * (len(PATHS) + 1) + "|"]
    for parameter in PARAMETERS:
        cells = []
        for path in PATHS:
            found = coverage[parameter.name, path]
            cells.append("**none**" if found is None else f"`{found[0]}` ({found[1]:.0f}×)")
        lines.append(f"| {parameter.name} | " + " | ".join(cells) + " |")
    return lines
