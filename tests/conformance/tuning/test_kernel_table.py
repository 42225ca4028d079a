"""``conformance.tuning.kernel_table``: the kernel table's medians come from several bench runs, and
each ratio is taken inside one run (ours against the vendor timed in the same process)."""

import subprocess
import sys

import pytest

from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict
from conformance.tuning.kernel_table import main


def bench_run(path, micros: dict[tuple[str, str], float]) -> str:
    cases: dict[str, list[CaseResult]] = {}
    for (backend, case), forward_us in micros.items():
        cases.setdefault(backend, []).append(CaseResult(case, Verdict.PASS, metrics={"forward_us": forward_us}))
    backends = [
        BackendResult(name, True, checks=[CheckResult("bench", Verdict.PASS, "", rows)]) for name, rows in cases.items()
    ]
    RunResult({}, backends, "bench", ["bench"]).save(path)
    return str(path)


def test_medians_and_ratios_within_each_run(tmp_path, capsys):
    case = "mla-h128-d512+64-bf16-p64:4096+1x64@0"
    runs = [(200.0, 100.0), (150.0, 100.0), (300.0, 250.0)]  # in-run ratios 2.0, 1.5, 1.2
    paths = [
        bench_run(tmp_path / f"kernels-{i}.json", {("triton_mla", case): ours, ("flashmla", case): vendor})
        for i, (ours, vendor) in enumerate(runs)
    ]
    main(paths)
    row = next(line for line in capsys.readouterr().out.splitlines() if case in line)
    assert "triton_mla 200 (150–300)" in row and "flashmla 100 (100–250)" in row
    # The median of the in-run ratios (1.5), not the ratio of the medians (2.0).
    assert "1.50 (1.20–2.00)×" in row


@pytest.mark.parametrize("args", [[], ["/nonexistent/kernels-1.json"], ["README.md"]])
def test_bad_input_is_one_line_and_exit_2(args):
    completed = subprocess.run(
        [sys.executable, "-m", "conformance.tuning.kernel_table", *args], capture_output=True, text=True
    )
    assert completed.returncode == 2
    assert len(completed.stderr.strip().splitlines()) == 1 and "Traceback" not in completed.stderr
