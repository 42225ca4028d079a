"""docs/performance.md's kernel table from the runs of ``bash reports/regenerate.sh kernels RUNS``:
``python -m conformance.tuning.kernel_table RUNS/kernels-*.json``. Per shape: our forward µs and
the vendor's, median (min–max) over the runs, and the ratio, taken within each run (both kernels
timed in the same process) and then its median (min–max)."""

import statistics
import sys

from conformance.results import RunResult

PAIRS = {"gqa": ("triton", "flashinfer"), "mla": ("triton_mla", "flashmla")}


def forward_micros(path: str) -> dict[tuple[str, str], float]:
    """(backend, case) -> forward µs of one bench run."""
    run = RunResult.load(path)
    return {
        (backend.name, case.case): case.metrics["forward_us"]
        for backend in run.backends
        for case in backend.bench_cases()
    }


def spread(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def main(paths: list[str]) -> None:
    if not paths:
        print("usage: python -m conformance.tuning.kernel_table RUNS/kernels-*.json", file=sys.stderr)
        sys.exit(2)
    try:
        runs = [forward_micros(path) for path in paths]
    except (OSError, ValueError, KeyError, TypeError) as error:  # a missing file, or not a bench JSON
        print(f"kernel_table: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(2)
    cases = sorted({case for run in runs for _, case in run}, key=lambda case: (case[:3], case))
    print(f"{len(runs)} runs\n| shape | ours µs | vendor µs | ratio |\n|---|---|---|---|")
    for case in cases:
        ours, vendor = PAIRS[case[:3]]
        pairs = [
            (run[(ours, case)], run[(vendor, case)]) for run in runs if (ours, case) in run and (vendor, case) in run
        ]
        if pairs:
            print(
                f"| {case} | {ours} {spread([o for o, _ in pairs], 0)} | {vendor} {spread([v for _, v in pairs], 0)} "
                f"| {spread([o / v for o, v in pairs], 2)}× |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
