"""Where a wrong output is wrong: two small grids a report draws as pictures.

- **The error map**, token × head: each cell the worst element's distance past the tolerance
  (``|out - ref| / (atol + rtol·|ref|)``, the largest over channels; 1 is at the limit). One bad
  request, one bad head, a band of tokens past a block boundary or every token at once read at a
  glance.
- **The key map**, token × key position, for the request and head of the worst element: how well
  one key alone explains each token's error. If a kernel gave key ``j`` extra weight δ (or took
  some away), the output moves from ``ref`` towards ``v_j``: ``out ≈ ref + δ·(v_j − ref)``. The
  cell holds the fraction of the error that direction explains (cos² of the angle between
  ``out − ref`` and ``v_j − ref``), signed by δ: positive where the key got weight it should not
  have, negative where it lost weight. Beside the keys the oracle lets each token see, a window
  or causal edge moved by one shows as a line one cell outside the edge.

Both are pooled to at most ``MAX_ROWS`` × ``MAX_COLUMNS`` cells (the cell of largest magnitude of
each bin) so that a 32k-token failure stays a few kilobytes of evidence.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

from conformance.cases.oracle import visible_keys
from conformance.harness.stored_cache import attended_values

MAX_ROWS = 48
MAX_COLUMNS = 96


class Grid(TypedDict):
    """A pooled map as evidence: ``values[row][column]``; ``row_edges`` / ``column_edges`` the first
    index of each bin (and one past the last); ``visible`` (key map only) the fraction of each
    bin's cells the oracle lets a token see."""

    kind: str  # "error" | "key"
    title: str
    row_label: str
    column_label: str
    row_edges: list[int]
    column_edges: list[int]
    values: list[list[float]]
    visible: list[list[float]]


def _edges(length: int, bins: int) -> list[int]:
    bins = max(1, min(bins, length))
    return [round(i * length / bins) for i in range(bins + 1)]


def _pool(values: torch.Tensor, row_edges: list[int], column_edges: list[int]) -> list[list[float | None]]:
    """Each bin's value of largest magnitude, sign kept; None for a bin holding NaN or Inf (strict
    JSON has neither)."""
    values = values.double()
    values = torch.where(torch.isfinite(values), values, torch.full_like(values, float("inf")))
    pooled = []
    for r0, r1 in zip(row_edges, row_edges[1:]):
        row = []
        for c0, c1 in zip(column_edges, column_edges[1:]):
            cell = values[r0:r1, c0:c1].flatten()
            picked = float(cell[cell.abs().argmax()])
            row.append(None if abs(picked) == float("inf") else round(picked, 4))
        pooled.append(row)
    return pooled


def _mean(values: torch.Tensor, row_edges: list[int], column_edges: list[int]) -> list[list[float]]:
    return [
        [round(float(values[r0:r1, c0:c1].double().mean()), 3) for c0, c1 in zip(column_edges, column_edges[1:])]
        for r0, r1 in zip(row_edges, row_edges[1:])
    ]


def error_map(out: torch.Tensor, reference: torch.Tensor, atol: float, rtol: float, title: str) -> Grid:
    """Token × head: the tolerance ratio of each (token, head)'s worst channel."""
    out, reference = out.double().cpu(), reference.double().cpu()
    ratio = (out - reference).abs() / (atol + rtol * reference.abs())
    ratio = torch.where(torch.isfinite(out), ratio, torch.full_like(ratio, float("inf"))).amax(dim=-1)  # [T, H]
    rows, columns = _edges(ratio.shape[0], MAX_ROWS), _edges(ratio.shape[1], MAX_COLUMNS)
    return Grid(
        kind="error",
        title=title,
        row_label="token (every request's, in batch order)",
        column_label="head",
        row_edges=rows,
        column_edges=columns,
        values=_pool(ratio, rows, columns),
        visible=[],
    )


def key_map(
    out: torch.Tensor,
    reference: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    tokens: list[int],
    wrong: torch.Tensor,
    title: str,
) -> Grid | None:
    """Token × key for one request and one head. ``out``, ``reference`` [n, Dv]: the request's
    tokens ``tokens`` (indices among its new tokens, ascending; every one, or an even sample of a
    long request) at that head; ``values`` [s, Dv]: the value each key carries to that head;
    ``visible`` [n, s] bool: the keys the oracle lets each of those tokens see; ``wrong`` [n] bool:
    the tokens past the tolerance (the others' rows are left 0: their error is rounding). None
    where an output is not finite (no direction to explain)."""
    out, reference, values = out.double().cpu(), reference.double().cpu(), values.double().cpu()
    if not bool(torch.isfinite(out).all()):
        return None
    error = out - reference  # [q, Dv]
    # d[t, j] = v_j - ref_t; <e_t, d_tj> and |d_tj|^2 expanded so that no [q, s, Dv] tensor is made.
    along = error @ values.T - (error * reference).sum(-1, keepdim=True)  # [q, s]
    length = (
        (values * values).sum(-1)[None, :] - 2 * reference @ values.T + (reference * reference).sum(-1, keepdim=True)
    ).clamp_min(0)
    # Nothing to explain where the error is 0, no direction where a key's value is the output (a
    # token that sees one key): 0 there, not 0/0 (a NaN that a summary took for the worst cell).
    denominator = length * (error * error).sum(-1, keepdim=True)
    explained = torch.where(denominator > 0, along.square() / denominator.clamp_min(1e-300), torch.zeros_like(along))
    signed = torch.where(wrong.cpu()[:, None], explained.clamp(max=1.0) * along.sign(), torch.zeros_like(along))
    rows, columns = _edges(signed.shape[0], MAX_ROWS), _edges(signed.shape[1], MAX_COLUMNS)
    return Grid(
        kind="key",
        title=title,
        row_label="new token of the request",
        column_label="key position",
        row_edges=[tokens[edge] for edge in rows[:-1]] + [tokens[-1] + 1],
        column_edges=columns,
        values=_pool(signed, rows, columns),
        visible=_mean(visible.cpu(), rows, columns),
    )


def failure_maps(
    prepared,
    out: torch.Tensor,
    reference: torch.Tensor,
    worst: dict[str, Any],
    atol: float,
    rtol: float,
    what: str,
    case_request: int | None = None,
    negated: bool = False,
) -> dict[str, Grid]:
    """The evidence maps of a failed comparison of ``prepared``'s step output (``out`` and the
    oracle's ``reference``, [T, H, Dv]; ``negated``: of a step run negated, both negated back)
    whose worst element is ``worst`` (request numbered as in its batch; ``case_request``: its
    number in the case, where the step reordered them): ``{"error_map": ..., "key_map": ...}``,
    the key map for that request and head over the values the oracle attended (an fp8 layer's as
    stored)."""
    batch = prepared.batch
    maps: dict[str, Grid] = {"error_map": error_map(out, reference, atol, rtol, f"{what}: |error| / tolerance")}
    request, head = worst["request"], worst["head"]
    start, end = batch.query_start_loc[request], batch.query_start_loc[request + 1]
    context_len = batch.case.batch[request][0]
    count = end - start
    tokens = sorted(
        set(torch.linspace(0, count - 1, min(count, 4 * MAX_ROWS)).round().long().tolist()) | {worst["token"]}
    )
    spec = batch.spec
    visible = visible_keys(context_len, range(count), context_len + count, spec.sliding_window)[tokens]
    picked = torch.tensor(tokens) + start
    got, expected = (
        out[picked.to(out.device), head].double().cpu(),
        reference[picked.to(reference.device), head].double().cpu(),
    )
    wrong = ((got - expected).abs() > atol + rtol * expected.abs()).any(dim=-1)
    grid = key_map(
        got,
        expected,
        attended_values(prepared, request, head, negated=negated),
        visible,
        tokens,
        wrong,
        f"{what}: request {request if case_request is None else case_request}, "
        f"head {head}: which key's weight explains each token's error",
    )
    if grid is not None:
        maps["key_map"] = grid
    return maps


def summary(grid: dict[str, Any]) -> str:
    """The map in one line, for the reports that draw no pictures."""
    values = [float("inf") if value is None else value for row in grid["values"] for value in row]
    if grid["kind"] == "error":
        beyond = sum(1 for value in values if value > 1)
        worst = "NaN/Inf" if max(values) == float("inf") else f"{max(values):.3g}× the tolerance"
        return f"{beyond} of {len(values)} (token, head) cells past the tolerance; worst {worst}"
    finite = [index for index, value in enumerate(values) if value != float("inf")]
    if not finite or not any(values[index] for index in finite):
        return "no single key explains the error"
    best = max(finite, key=lambda index: abs(values[index]))
    row, column = divmod(best, len(grid["values"][0]))
    keys = grid["column_edges"][column], grid["column_edges"][column + 1] - 1
    tokens = grid["row_edges"][row], grid["row_edges"][row + 1] - 1
    what = "extra" if values[best] > 0 else "missing"
    return (
        f"{what} weight on keys {keys[0]}–{keys[1]} explains {abs(values[best]):.0%} of the error of tokens "
        f"{tokens[0]}–{tokens[1]}"
    )
