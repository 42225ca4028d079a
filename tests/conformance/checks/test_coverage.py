"""Every layer parameter matters on every path in two standard cases (by the margin), and
docs/checks.md shows that matrix as it is."""

from pathlib import Path

import pytest

from conformance.cases.suites import suite
from conformance.harness.coverage import CASES_PER_CELL, MARGIN, coverage_table, parameter_coverage
from conformance.run.execution import judge

CHECKS_DOC = Path(__file__).resolve().parents[3] / "docs" / "checks.md"


@pytest.mark.slow
def test_every_parameter_matters_on_every_path_and_the_docs_show_the_matrix():
    coverage = parameter_coverage(suite("standard"))
    short = {cell: found for cell, found in coverage.items() if len({case_id for case_id, _ in found}) < CASES_PER_CELL}
    assert not short, f"fewer than {CASES_PER_CELL} standard cases make these matter by {MARGIN}×: {short}"
    assert all(ratio >= MARGIN for found in coverage.values() for _, ratio in found)
    text = CHECKS_DOC.read_text()
    section = text[text.index("### Every parameter at work on every path") :]
    assert "\n".join(coverage_table(coverage)) in section, "docs/checks.md's parameter × path matrix is stale"


@pytest.mark.slow
def test_a_cap_over_small_logits_covers_nothing():
    """Why the cap's cases hold large logits: the suite's other cap cases (logits of a few units)
    leave every cell of the cap empty."""
    small = [case for case in suite("standard") if case.spec.logits_soft_cap is None or case.data == "normal"]
    coverage = parameter_coverage(small)
    assert all(not found for (name, _), found in coverage.items() if name == "logits soft cap")


def test_a_parameter_dropped_on_one_path_fails_on_the_case_the_matrix_names():
    import torch

    from conformance.cases.grammar import parse_case
    from conformance.checks.numerics import NumericsCheck
    from conformance.results import Verdict
    from tests.planted import input_defects

    cpu = torch.device("cpu")
    for defect, case_text in (
        (input_defects.DropsCapOnDecode, "gqa-h8/2-d128-bf16-p16-cap30-outliers:1+1,500+1,3000+1"),
        (input_defects.RecomputesScale, "mla-h16-d512+64-bf16-p64-scale0.13524:1+1,700+1,2500+1"),
        (input_defects.RecomputesScale, "gqa-h8/2-d128-bf16-p16-scale0.25:500+4,30+4"),
    ):
        case = parse_case(case_text)
        result = judge(NumericsCheck(), defect, case, cpu)
        assert result.verdict == Verdict.FAIL and result.metrics["tolerance_ratio"] > 10, (defect, result.reason)
    # The cap dropped on decode rows hides behind the suite's cap over small logits.
    small = parse_case("gqa-h8/2-d128-bf16-p16-cap30:1000+1,20+1")
    assert judge(NumericsCheck(), input_defects.DropsCapOnDecode, small, cpu).verdict == Verdict.PASS
