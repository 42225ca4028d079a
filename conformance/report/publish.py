"""Publish real GPU results into ``reports/``: one JSON and one HTML report per backend (each with
the environment block of the run it came from), the bench run's JSON and HTML, and a
``reports/README.md`` table of verdicts and headline bench numbers.

    python -m conformance.report.publish RESULTS.json [RESULTS.json ...] [--bench BENCH.json ...] [--out reports]

A backend may come from several runs split by ``--check`` (so that backends can run side by side,
each check in its own process): its checks are merged, a later file winning for a check that
appears twice, and its wall time is the sum. All files must be of one suite. Several bench files
(backends that cannot share one process, such as FlashAttention's and FlashInfer's CuTe DSL
versions) publish as one table, under the first file's environment; a backend in several bench
files was run that many times, and its median run is published with every run's times beside it
(``bench_runs``). Without ``--bench`` the earlier ``README.md``'s bench section and the bench files
stay as they were (the checks and the bench run apart). Nothing is computed here that a run did
not measure.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.checks import CHECKS, default_checks
from conformance.report.bench_runs import BenchRunsError, fold_bench_runs
from conformance.report.html import write_html
from conformance.report.safe_text import markdown_inline
from conformance.results import BackendResult, CheckResult, RunResult, Verdict

HEADLINE_SHAPES = ("decode b64 ctx4096", "verify q=4 b64 ctx4096", "decode b256 ctx4096", "decode b1 ctx32768")


class PublishError(ValueError):
    pass


def file_stem(name: str) -> str:
    """A backend's name as a file name inside ``--out``: a name from a results file may hold
    anything (``../../x``, a slash, a control character), and must not write elsewhere."""
    stem = re.sub(r"[^A-Za-z0-9._:+-]", "_", name).lstrip(".")
    if not stem:
        raise PublishError(f"backend name {name!r} makes no file name")
    return stem


def split_by_backend(results: list[RunResult]) -> dict[str, RunResult]:
    suites = {result.suite for result in results}
    if len(suites) > 1:
        raise PublishError(f"results of different suites ({', '.join(sorted(suites))}): publish one suite at a time")
    per_backend: dict[str, RunResult] = {}
    for result in results:
        for backend in result.backends:
            earlier = per_backend.get(backend.name)
            if earlier is not None:
                if earlier.backends[0].available != backend.available:
                    raise PublishError(
                        f"backend {backend.name} is available in one results file and not in another: "
                        "publish runs made where it is the same"
                    )
                # Merged either way: an unavailable backend's SKIP of each check is a result too.
                backend = merged(earlier.backends[0], backend)
            checks = [check.name for check in backend.checks] or result.checks
            per_backend[backend.name] = RunResult(result.environment, [backend], result.suite, checks)
    return per_backend


def merged(earlier: BackendResult, later: BackendResult) -> BackendResult:
    """One backend's checks from two runs; the later run wins for a check in both."""
    names = {check.name for check in later.checks}
    checks = [check for check in earlier.checks if check.name not in names] + later.checks
    order = {name: index for index, name in enumerate(CHECKS)}
    checks.sort(key=lambda check: order.get(check.name, len(order)))
    return replace(later, checks=checks, wall_s=earlier.wall_s + later.wall_s, warm_s=earlier.warm_s + later.warm_s)


def table_checks(per_backend: dict[str, RunResult]) -> list[str]:
    """The table's columns: the default checks (one a backend lacks reads "not run") when the runs
    made any, and every opt-in check they made (``--check memory`` publishes a table of its own)."""
    ran = {check.name for result in per_backend.values() for check in result.backends[0].checks}
    defaults = set(default_checks()) if ran & set(default_checks()) else set()
    return [name for name in CHECKS if name in defaults or name in ran]


def own_kind_reason(backend: BackendResult, check: CheckResult) -> str:
    """Why a check ran none of its cases, as the cases of the layer kinds the backend serves say it
    (the most common reason among them; the rest say only that the kind is another)."""
    kinds = set(backend.claims.get("kinds") or ())
    reasons = Counter(case.reason for case in check.cases if case_kind(case.case) in kinds) or Counter(
        case.reason for case in check.cases
    )
    return reasons.most_common(1)[0][0] if reasons else check.summary


def case_kind(case_id: str) -> str | None:
    try:
        return parse_case(case_id).spec.kind
    except CaseSyntaxError:
        return None


def verdict_table(per_backend: dict[str, RunResult]) -> list[str]:
    checks = table_checks(per_backend)
    lines = ["| backend | GPU | " + " | ".join(checks) + " |", "|---" * (len(checks) + 2) + "|"]

    def spanning(name: str, gpu: str, text: str) -> str:
        """A row whose first check's cell says why no check has a verdict."""
        cells = [markdown_inline(text)] + [""] * (len(checks) - 1)
        return f"| {markdown_inline(name)} | {gpu} | " + " | ".join(cells) + " |"

    for name, result in sorted(per_backend.items()):
        backend = result.backends[0]
        gpu = result.environment.get("gpu", result.environment.get("device", ""))
        if not backend.available:
            lines.append(spanning(name, gpu, f"not available: {backend.reason}"))
            continue
        made = [check for check in map(backend.check, checks) if check is not None]
        if any(check.cases for check in made) and all(check.verdict == Verdict.SKIP for check in made):
            # A backend that claims none of the suite's cases: one reason for the row.
            first = next(check for check in made if check.cases)
            lines.append(spanning(name, gpu, f"every case SKIP: {own_kind_reason(backend, first)}"))
            continue
        cells = []
        for check_name in checks:
            check = backend.check(check_name)
            if check is None:
                cells.append("not run")
            elif check.ran:
                cells.append(f"{check.verdict.value} {check.passed}/{check.ran}")
            elif check.cases:
                cells.append(f"{check.verdict.value} ({markdown_inline(own_kind_reason(backend, check))})")
            else:
                cells.append(f"{check.verdict.value} ({markdown_inline(check.summary)})")
        lines.append(f"| {markdown_inline(name)} | {gpu} | " + " | ".join(cells) + " |")
    return lines


def bench_table(bench: RunResult) -> list[str]:
    names = [backend.name for backend in bench.backends]
    lines = ["| shape | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for shape in HEADLINE_SHAPES:
        for layer in ("gqa", "mla"):
            cells, any_value = [], False
            for backend in bench.backends:
                case = next((c for c in backend.bench_cases() if c.tag == shape and c.case.startswith(layer)), None)
                if case is None:
                    cells.append("")
                    continue
                any_value = True
                cells.append(f"{case.metrics['forward_us']:.0f} µs ({case.metrics['GBps']:.0f} GB/s)")
            if any_value:
                lines.append(f"| {layer.upper()} {shape} | " + " | ".join(cells) + " |")
    return lines


KEPT_FROM = "## How this publication was made"  # this heading and all below it are written by hand


def kept_notebook(readme: Path) -> str:
    """What a republish keeps of an earlier ``README.md``: its hand-written part, from
    ``KEPT_FROM`` on (how the publication was made, and the notebook of measurements after it);
    nothing where there is no earlier file or no such heading."""
    if not readme.exists():
        return ""
    text = readme.read_text()
    start = text.find("\n" + KEPT_FROM)
    return text[start + 1 :] if start >= 0 else ""


BENCH_HEADING = "## Bench numbers"


def kept_bench(readme: Path) -> list[str]:
    """A republish without bench results keeps the earlier ``README.md``'s bench section as it
    was (``bench.json`` and ``bench.html`` stay too): checks and the bench run apart, and the
    section names its own GPU and runs. Nothing where there was none."""
    if not readme.exists():
        return []
    text = readme.read_text()
    start = text.find("\n" + BENCH_HEADING)
    if start < 0:
        return []
    end = text.find("\n## ", start + 1)
    return ["", *text[start + 1 : end if end >= 0 else len(text)].rstrip("\n").split("\n")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+")
    parser.add_argument(
        "--bench", nargs="+", help="bench results; several files are one table (their backends side by side)"
    )
    parser.add_argument("--out", default="reports")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        per_backend = split_by_backend([RunResult.load(path) for path in args.results])
        stems = {name: file_stem(name) for name in per_backend}
    except (PublishError, OSError, ValueError) as error:
        parser.exit(2, f"conformance.report.publish: {error}\n")
    clashing = sorted({stem for stem in stems.values() if list(stems.values()).count(stem) > 1})
    if clashing:
        parser.exit(
            2,
            f"conformance.report.publish: backend names that make one file name {clashing[0]!r}: "
            "publish them separately\n",
        )
    for name, result in per_backend.items():
        result.save(out / f"{stems[name]}.json")
        write_html(result, out / f"{stems[name]}.html")
    suite = next(iter(per_backend.values())).suite if per_backend else ""
    has_bench = bool(kept_bench(out / "README.md"))
    lines = [
        "# Published results",
        "",
        "Real GPU runs of the built-in backends: per backend a JSON (with the environment block",
        "of its run) and a self-contained HTML report"
        + ("; `bench.json` / `bench.html` for the benchmark run." if args.bench or has_bench else "."),
        "Regenerate on a GPU machine with `bash reports/regenerate.sh`.",
        "",
        f"## Verdicts ({suite} suite)",
        "",
        *verdict_table(per_backend),
    ]
    if args.bench:
        try:
            bench, repeats = fold_bench_runs([RunResult.load(path) for path in args.bench])
        except (BenchRunsError, OSError, ValueError) as error:
            parser.exit(2, f"conformance.report.publish: {error}\n")
        bench.save(out / "bench.json")
        write_html(bench, out / "bench.html")
        ceilings = next(
            (c.metrics for b in bench.backends for ch in b.checks for c in ch.cases if c.metrics.get("copy_GBps")), {}
        )
        runs = (
            "one `conformance bench` run" + "; not repeated: read them as one measurement, not as headline figures"
            if repeats < 2
            else f"the median of {repeats} `conformance bench` runs; `bench.json` keeps every run's"
        )
        lines += [
            "",
            f"{BENCH_HEADING} ({bench.environment.get('gpu', '')}, {runs})",
            "",
            f"Forward time, CUDA events, L2 flushed, median. Ceilings measured in the same run: copy "
            f"{ceilings.get('copy_GBps', 0):.0f} GB/s (read + write), "
            f"bf16 matmul {ceilings.get('bf16_TFLOPs', 0):.0f} TFLOP/s.",
            "",
            *bench_table(bench),
        ]
    readme = out / "README.md"
    if not args.bench:
        lines += kept_bench(readme)
    kept = kept_notebook(readme)
    readme.write_text("\n".join(lines) + "\n" + (f"\n{kept}" if kept else ""))
    print(f"wrote {len(per_backend)} backend files and README.md to {out}")


if __name__ == "__main__":
    main()
