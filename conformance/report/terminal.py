"""Terminal output with rich: a progress bar while running, then a backend x check table, then
each failure with its evidence."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from conformance.checks import check_class
from conformance.harness.evidence import plain_lines
from conformance.report.reproduce import reproduce_command
from conformance.report.safe_text import visible
from conformance.results import BackendResult, CaseResult, RunResult, Verdict
from conformance.run.runner import CUSTOM_SUITE
from conformance.run.runner import Progress as RunProgress

VERDICT_STYLES = {
    Verdict.PASS: "bold green",
    Verdict.FAIL: "bold red",
    Verdict.ERROR: "bold magenta",
    Verdict.CRASH: "bold white on red",
    Verdict.SKIP: "yellow",
}
MAX_FAILURES_SHOWN = 8
MAX_EVIDENCE_LINES = 24  # per case: the report stays readable with eight failures shown


def verdict_text(verdict: Verdict) -> Text:
    return Text(verdict.value, style=VERDICT_STYLES[verdict])


class RichProgress(RunProgress):
    """One progress bar per backend; the case being run is shown beside it."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("[dim]{task.fields[current]}"),
            console=console,
            transient=False,
        )
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> "RichProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def backend_started(self, name: str, num_checks: int, num_cases: int) -> None:
        self.tasks[name] = self.bar.add_task(
            escape(visible(name, one_line=True)), total=num_checks * num_cases, current=""
        )
        self.cases_per_check = num_cases

    def event(self, name: str, event: dict[str, Any]) -> None:
        task = self.tasks[name]
        if event["event"] == "start":
            self.bar.update(task, current=f"{event['check']} {event['case'][:70]}")
        elif event["event"] in ("result", "fatal"):
            self.bar.advance(task)
        elif event["event"] == "check_skipped":
            self.bar.advance(task, self.cases_per_check)

    def backend_finished(self, result: BackendResult) -> None:
        if result.name in self.tasks:  # an unavailable backend never started: the report says why
            task = self.tasks[result.name]
            self.bar.update(task, completed=self.bar.tasks[task].total, current=f"done in {result.wall_s:.1f} s")

    def warmed(self, units: int, seconds: float) -> None:
        self.bar.console.print(warmed_line(units, seconds))


class LineProgress(RunProgress):
    """Progress for CI logs (no terminal): one line per check as it finishes, per backend, and a
    line at least every ``HEARTBEAT_S`` seconds while a backend runs (the check, cases done, the
    case running, elapsed), so a log shows life during a long run instead of nothing."""

    HEARTBEAT_S = 10.0

    def __init__(self, console: Console) -> None:
        self.console = console
        self.cases_per_check = 0
        self.counts: dict[tuple[str, str], dict[str, int]] = {}
        self.lock = threading.Lock()
        self.running: tuple[str, str, str] | None = None  # backend, check, case
        self.started = self.last_line = time.monotonic()
        self.stop = threading.Event()
        self.heartbeat: threading.Thread | None = None

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self._stop_heartbeat()

    def _print(self, text: str) -> None:
        with self.lock:
            self.console.print(text, highlight=False, markup=False)
            self.last_line = time.monotonic()

    def _beat(self) -> None:
        while not self.stop.wait(1.0):
            if time.monotonic() - self.last_line < self.HEARTBEAT_S or self.running is None:
                continue
            name, check, case = self.running
            done = sum(self.counts.get((name, check), {}).values())
            self._print(
                f"{visible(name)} / {check}: {done}/{self.cases_per_check} cases, running {case} "
                f"({time.monotonic() - self.started:.0f} s)"
            )

    def _stop_heartbeat(self) -> None:
        self.stop.set()
        if self.heartbeat is not None:
            self.heartbeat.join()
            self.heartbeat = None

    def backend_started(self, name: str, num_checks: int, num_cases: int) -> None:
        self.cases_per_check = num_cases
        self.started = time.monotonic()
        self._print(f"{visible(name)}: {num_checks} check(s) x {num_cases} case(s)")
        self.stop.clear()
        self.heartbeat = threading.Thread(target=self._beat, daemon=True)
        self.heartbeat.start()

    def event(self, name: str, event: dict[str, Any]) -> None:
        if event["event"] == "start":
            self.running = (name, event["check"], event["case"])
            return
        if event["event"] == "check_skipped":
            self._print(f"{visible(name)} / {event['check']}: SKIP ({visible(event['reason'], one_line=True)})")
            return
        if event["event"] not in ("result", "fatal"):
            return
        self.running = None
        verdicts = self.counts.setdefault((name, event["check"]), {})
        verdict = event["result"]["verdict"]
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
        if sum(verdicts.values()) == self.cases_per_check or event["event"] == "fatal":
            tally = ", ".join(f"{count} {verdict}" for verdict, count in sorted(verdicts.items()))
            self._print(f"{visible(name)} / {event['check']}: {tally}")

    def backend_finished(self, result: BackendResult) -> None:
        self._stop_heartbeat()
        self.running = None
        unloaded = next((check for check in result.checks if check.verdict.is_failure and not check.cases), None)
        if unloaded is not None:  # it could not even be loaded: say why, not "done"
            self._print(f"{visible(result.name)}: {unloaded.verdict.value} {visible(unloaded.summary, one_line=True)}")
        elif result.available:
            warm = f" (and {result.warm_s:.1f} s warming)" if result.warm_s else ""
            self._print(f"{visible(result.name)}: done in {result.wall_s:.1f} s{warm}")

    def warmed(self, units: int, seconds: float) -> None:
        self._print(warmed_line(units, seconds))


def warmed_line(units: int, seconds: float) -> str:
    return f"warmed in {seconds:.1f} s: each kernel layout's case once, {units} process(es), before the checks"


NAME_WIDTH = 40  # a backend's name stays on one line up to this many characters


def summary_table(run: RunResult) -> Table:
    table = Table(title="conformance results", title_justify="left")
    # A name is never cut (`triton` vs `triton_mla`) and kept whole up to NAME_WIDTH: past it, folded.
    longest = max((len(visible(backend.name, one_line=True)) for backend in run.backends), default=7)
    table.add_column("backend", style="bold", overflow="fold", min_width=min(longest, NAME_WIDTH))
    for check in run.checks:
        table.add_column(check, overflow="fold")
    for backend in run.backends:
        cells: list[Any] = [Text(visible(backend.name, one_line=True))]
        for check_name in run.checks:
            check = backend.check(check_name)
            if check is None:
                cells.append("")
                continue
            cell = verdict_text(check.verdict)
            if check.cases:
                cell.append(f"  {check.tally()}", style="dim")
            elif check.summary:
                cell.append(f"  {visible(check.summary, one_line=True)}", style="dim")
            cells.append(cell)
        table.add_row(*cells)
    return table


def _evidence_lines(check_name: str, case: CaseResult) -> list[str]:
    lines = plain_lines(check_class(check_name).describe_evidence(case.evidence), block_lines=12)
    if len(lines) > MAX_EVIDENCE_LINES:
        lines = lines[:MAX_EVIDENCE_LINES] + ["… the rest in the JSON results and the HTML report"]
    return ["    " + visible(line) for line in lines]


def print_failures(console: Console, run: RunResult) -> None:
    tracebacks: dict[str, str] = {}  # a traceback's text -> the first case that printed it
    for backend in run.backends:
        for check in backend.checks:
            failures = [case for case in check.cases if case.verdict.is_failure]
            if not failures:
                continue
            console.print(
                f"\n[bold]{escape(visible(backend.name, one_line=True))} / {check.name}[/]: "
                f"{escape(visible(check.summary, one_line=True))}"
            )
            for case in failures[:MAX_FAILURES_SHOWN]:
                console.print(
                    Text("  ")
                    .append(verdict_text(case.verdict))
                    .append(f" {visible(case.case, one_line=True)}")
                    .append(f"  ({visible(case.tag, one_line=True)})" if case.tag else "", style="dim")
                )
                console.print(f"    {visible(case.reason, one_line=True)}", markup=False, highlight=False)
                console.print(
                    f"    reproduce: {visible(reproduce_command(run, backend.name, check.name, case.case))}",
                    markup=False,
                    highlight=False,
                )
                traceback = case.evidence.get("traceback")
                if isinstance(traceback, str) and traceback in tracebacks:  # the same error again: once is enough
                    shown = replace(
                        case, evidence={key: value for key, value in case.evidence.items() if key != "traceback"}
                    )
                    lines = _evidence_lines(check.name, shown) + [
                        f"    traceback: the same as for {tracebacks[traceback]} above"
                    ]
                else:
                    if isinstance(traceback, str):
                        tracebacks[traceback] = case.case
                    lines = _evidence_lines(check.name, case)
                for line in lines:
                    console.print(line, markup=False, highlight=False, style="dim")
            if len(failures) > MAX_FAILURES_SHOWN:
                console.print(f"  … and {len(failures) - MAX_FAILURES_SHOWN} more in the JSON results")


def bench_table(run: RunResult) -> Table | None:
    """Per shape: each backend's forward µs (× the fastest), GB/s and roofline fraction."""
    benched = [(backend.name, backend.check("bench")) for backend in run.backends if backend.check("bench")]
    rows: dict[str, dict[str, Any]] = {}
    for backend in run.backends:
        for case in backend.bench_cases():
            rows.setdefault(case.case, {"tag": case.tag})[backend.name] = case.metrics
    if not rows:
        return None
    table = Table(title="bench: forward µs (× fastest) · GB/s · roofline", title_justify="left")
    table.add_column("case", overflow="fold")
    names = [name for name, _ in benched]
    for name in names:
        table.add_column(name, justify="right")
    for case_id, row in rows.items():
        cells = [f"{row['tag'] or case_id}\n[dim]{escape(case_id.split(':')[0])}[/]"]
        for name in names:
            metrics = row.get(name)
            if metrics is None:
                cells.append("")
                continue
            ratio = metrics.get("ratio_to_fastest", 1.0)
            style = "bold green" if ratio <= 1.0001 else ""
            replay = f" · graph {metrics['replay_us']:.0f}" if metrics.get("replay_us") else ""
            cells.append(
                Text(f"{metrics['forward_us']:.1f} µs (×{ratio:.2f})", style=style).append(
                    f"\n{metrics['GBps']:.0f} GB/s · {100 * metrics['roofline_fraction']:.0f}%{replay} "
                    f"· build {metrics['build_us']:.0f} µs",
                    style="dim",
                )
            )
        table.add_row(*cells)
    return table


def print_report(console: Console, run: RunResult) -> None:
    console.print(summary_table(run))
    table = bench_table(run)
    if table is not None:
        console.print(table)
    for backend in run.backends:
        if not backend.available:
            console.print(
                f"[yellow]{escape(visible(backend.name, one_line=True))}[/] not run here: "
                f"{escape(visible(backend.reason, one_line=True))}",
                highlight=False,
            )
    if run.suite == CUSTOM_SUITE:  # cases named one by one: each that did not run says why
        print_skips(console, run)
    print_failures(console, run)


def print_skips(console: Console, run: RunResult) -> None:
    for backend in run.backends:
        for check in backend.checks:
            for case in check.cases:
                if case.verdict == Verdict.SKIP:
                    console.print(
                        f"{visible(backend.name, one_line=True)} / {check.name}: SKIP "
                        f"{visible(case.case, one_line=True)}: {visible(case.reason, one_line=True)}",
                        markup=False,
                        highlight=False,
                        style="dim",
                    )
