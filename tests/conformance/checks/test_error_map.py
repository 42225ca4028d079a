"""The error maps of a numerics failure point where the defect is."""

import torch

from conformance.cases.grammar import parse_case
from conformance.checks.numerics import NumericsCheck
from conformance.harness.error_map import error_map, summary
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import defects, input_defects

CPU = torch.device("cpu")


def test_a_causal_off_by_one_shows_as_extra_weight_on_the_next_key():
    case = parse_case("gqa-h4/2-d32-fp32-p16-edges:10+12@0")
    result = judge(NumericsCheck(), defects.CausalOffByOne, case, CPU)
    assert result.verdict == Verdict.FAIL
    key_map = result.evidence["key_map"]
    assert key_map["row_edges"][-1] == 12 and key_map["column_edges"][-1] == 22  # every token, every key
    # Token t (position 10 + t) may see keys 0..10+t; the defect gives weight to key 11+t: the cell
    # one past the edge carries extra weight that explains nearly all of the error.
    for token in range(11):
        assert key_map["visible"][token][10 + token] == 1 and key_map["visible"][token][11 + token] == 0
        assert key_map["values"][token][11 + token] > 0.9, (token, key_map["values"][token])
    assert "extra weight on keys" in summary(key_map)
    error_grid = result.evidence["error_map"]
    assert len(error_grid["values"]) == 12 and len(error_grid["values"][0]) == 4
    assert error_grid["values"][-1][0] <= 1 < max(error_grid["values"][0])  # the last token has no next key


def test_the_error_map_pools_a_long_batch_and_marks_nan():
    out, reference = torch.zeros(1000, 3, 8), torch.zeros(1000, 3, 8)
    out[700, 2, 5] = float("nan")
    out[10, 0, 0] = 0.5
    grid = error_map(out, reference, 1e-3, 1e-3, "t")
    assert len(grid["values"]) == 48 and grid["row_edges"][-1] == 1000
    flat = [(r, c, v) for r, row in enumerate(grid["values"]) for c, v in enumerate(row) if v is None or v > 1]
    assert [(c, v) for _, c, v in flat] == [(0, 500.0), (2, None)]
    assert "worst NaN/Inf" in summary(grid)


def test_a_window_off_by_one_in_a_prefill_names_the_key_outside_the_window():
    # A prefill's first tokens see fewer keys than the window and are right (error exactly 0; token 0's
    # output is key 0's value): those rows once made 0/0, which the summary took for the worst cell.
    case = parse_case("gqa-h4/1-d64-bf16-p16-w24-cap20:0+40,50+4,3+1")
    result = judge(NumericsCheck(), input_defects.WindowOffByOne, case, CPU)
    key_map = result.evidence["key_map"]
    assert all(value is not None for row in key_map["values"] for value in row)
    line = summary(key_map)
    assert line.startswith("extra weight on keys 2–2 explains") and "of the error of tokens 26–26" in line, line
    assert "HTML" not in line  # the plain renderers add that; the HTML draws the map beside it
