"""One self-contained HTML report: inline CSS and inline SVG, no script, no network, opens from disk.

Summary matrix (backend x check, verdict colours) → unavailable backends → per backend and check,
every non-PASS case with its evidence (error statistics and worst location, sync events with
their lines and stacks, the graph batch that broke a replay, the failing draft step, a crash's
stderr tail) and all cases folded → bench tables with SVG bars (forward µs per backend per shape,
roofline fraction) → the environment block.
"""
from __future__ import annotations

import json
from html import escape
from typing import Any

from conformance.checks import check_class
from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict
from conformance.report.output_paths import write_atomically
from conformance.report.reproduce import reproduce_command

VERDICT_COLOURS = {
    Verdict.PASS: "#2e7d32",
    Verdict.FAIL: "#c62828",
    Verdict.ERROR: "#8e24aa",
    Verdict.CRASH: "#000000",
    Verdict.SKIP: "#9e9e9e",
}
BAR_COLOURS = ["#1565c0", "#ef6c00", "#2e7d32", "#6a1b9a", "#00838f", "#ad1457", "#4e342e", "#546e7a"]

STYLE = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 2em; color: #212121; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.warn { color: #b45309; border: 1px solid #f59e0b; padding: 0.4em 0.8em; }
table { border-collapse: collapse; margin: 0.6em 0; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; font-size: 14px; }
th { background: #f5f5f5; }
td.verdict { color: white; font-weight: bold; white-space: nowrap; }
.PASS { background: #2e7d32; } .FAIL { background: #c62828; } .ERROR { background: #8e24aa; }
.CRASH { background: #000000; } .SKIP { background: #9e9e9e; }
.dim { color: #757575; font-size: 12px; }
pre { background: #fafafa; border: 1px solid #eee; padding: 6px; font-size: 12px; max-height: 24em; overflow: auto; white-space: pre-wrap; }
code { font-size: 12px; }
details { margin: 0.4em 0; }
"""


def _verdict_cell(verdict: Verdict, detail: str = "") -> str:
    extra = f"<br><span style='font-weight:normal;font-size:12px'>{escape(detail)}</span>" if detail else ""
    return f"<td class='verdict {verdict.value}'>{verdict.value}{extra}</td>"


def _check_detail(check: CheckResult) -> str:
    if not check.cases:
        return check.summary
    return check.tally()


def summary_matrix(run: RunResult) -> str:
    head = "".join(f"<th>{escape(check)}</th>" for check in run.checks)
    rows = []
    for backend in run.backends:
        cells = []
        for name in run.checks:
            check = backend.check(name)
            cells.append(_verdict_cell(check.verdict, _check_detail(check)) if check else "<td></td>")
        label = escape(backend.name) + ("" if backend.available else f"<br><span class='dim'>{escape(backend.reason)}</span>")
        rows.append(f"<tr><th>{label}</th>{''.join(cells)}</tr>")
    return f"<table id='summary'><tr><th>backend</th>{head}</tr>{''.join(rows)}</table>"


def _evidence(check_name: str, case: CaseResult) -> str:
    parts = []
    for item in check_class(check_name).describe_evidence(case.evidence):
        label = f"{escape(item.label)}:" if item.label else ""
        parts.append(f"<p>{label}</p><pre>{escape(item.text)}</pre>" if item.block
                     else f"<p>{label} <code>{escape(item.text)}</code></p>")
    if case.metrics:
        parts.append(f"<details><summary>metrics</summary><pre>{escape(json.dumps(case.metrics, indent=1))}</pre></details>")
    return "".join(parts)


def _case_rows(check_name: str, cases: list[CaseResult], with_evidence: bool, reproduce=None) -> str:
    """``reproduce(case)``: the command that runs a failing case alone, shown above its evidence."""
    rows = []
    for case in cases:
        evidence = _evidence(check_name, case) if with_evidence else ""
        if reproduce is not None:
            evidence = f"<p>reproduce: <code class='repro'>{escape(reproduce(case))}</code></p>{evidence}"
        rows.append(
            f"<tr>{_verdict_cell(case.verdict)}<td><code>{escape(case.case)}</code><br><span class='dim'>{escape(case.tag)}</span></td>"
            f"<td>{escape(case.reason)}{evidence}</td></tr>"
        )
    return "".join(rows)


def check_section(backend: BackendResult, check: CheckResult, run: RunResult) -> str:
    failing = [case for case in check.cases if case.verdict.is_failure]
    details = f"<details><summary>check details</summary><pre>{escape(json.dumps(check.details, indent=1))}</pre></details>" if check.details else ""
    parts = [f"<h3 id='{escape(backend.name)}-{escape(check.name)}'>{escape(backend.name)} / {escape(check.name)}: "
             f"{check.verdict.value}</h3><p>{escape(check.summary)}</p>{details}"]
    if failing:
        parts.append(f"<table class='failures'><tr><th>verdict</th><th>case</th><th>evidence</th></tr>{_case_rows(check.name, failing, True, lambda case: reproduce_command(run, backend.name, check.name, case.case))}</table>")
    if check.cases:
        parts.append(f"<details><summary>all {len(check.cases)} cases</summary><table>{_case_rows(check.name, check.cases, False)}</table></details>")
    return "".join(parts)


def _bars(values: list[tuple[str, float]], unit: str, width: int = 420) -> str:
    """Horizontal bars, inline SVG, one per (label, value)."""
    if not values:
        return ""
    top = max(value for _, value in values) or 1.0
    row = 18
    bars = []
    for index, (label, value) in enumerate(values):
        length = max(1.0, (width - 160) * value / top)
        y = index * row
        bars.append(
            f"<text x='0' y='{y + 13}' font-size='12'>{escape(label)}</text>"
            f"<rect x='110' y='{y + 3}' width='{length:.1f}' height='12' fill='{BAR_COLOURS[index % len(BAR_COLOURS)]}'/>"
            f"<text x='{114 + length:.1f}' y='{y + 13}' font-size='11'>{value:.3g} {escape(unit)}</text>"
        )
    return f"<svg width='{width + 60}' height='{row * len(values) + 4}'>{''.join(bars)}</svg>"


def bench_section(run: RunResult) -> str:
    shapes: dict[str, dict[str, dict[str, Any]]] = {}
    for backend in run.backends:
        for case in backend.bench_cases():
            shapes.setdefault(case.case, {})[backend.name] = {**case.metrics, "tag": case.tag}
    if not shapes:
        return ""
    rows = []
    for case_id, by_backend in shapes.items():
        tag = next(iter(by_backend.values()))["tag"]
        latency = _bars([(name, m["forward_us"]) for name, m in by_backend.items()], "µs")
        roofline = _bars([(name, 100 * m["roofline_fraction"]) for name, m in by_backend.items()], "% roofline")
        numbers = "<br>".join(
            f"{escape(name)}: {m['forward_us']:.1f} µs (×{m.get('ratio_to_fastest', 1):.2f}), {m['GBps']:.0f} GB/s, "
            f"build {m['build_us']:.1f} µs" + (f", graph {m['replay_us']:.1f} µs" if m.get("replay_us") else "")
            for name, m in by_backend.items()
        )
        rows.append(f"<tr><td>{escape(tag)}<br><code class='dim'>{escape(case_id)}</code></td><td>{latency}</td><td>{roofline}</td><td class='dim'>{numbers}</td></tr>")
    return ("<h2 id='bench'>Bench</h2><table class='bench'><tr><th>shape</th><th>forward latency</th>"
            f"<th>roofline fraction</th><th>numbers</th></tr>{''.join(rows)}</table>")


def render(run: RunResult) -> str:
    environment = "".join(f"<tr><th>{escape(str(k))}</th><td>{escape(str(v))}</td></tr>" for k, v in run.environment.items())
    sections = []
    for backend in run.backends:
        if not backend.available:
            continue
        for check in backend.checks:
            if check.name != "bench":
                sections.append(check_section(backend, check, run))
    unavailable = "".join(
        f"<li><b>{escape(b.name)}</b>: {escape(b.reason)}</li>" for b in run.backends if not b.available
    )
    title = f"conformance — {escape(run.suite)} — {escape(str(run.environment.get('gpu') or run.environment.get('device', '')))}"
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{title}</title><style>{STYLE}</style></head><body>"
        f"<h1>{title}</h1><p class='dim'>{escape(str(run.environment.get('command', '')))} · {escape(str(run.environment.get('time', '')))}</p>"
        + (f"<p class='warn'><b>{escape(run.INTERRUPTED_NOTE)}</b></p>" if run.interrupted else "")
        + f"<h2>Summary</h2>{summary_matrix(run)}"
        + (f"<h2>Not run here</h2><ul>{unavailable}</ul>" if unavailable else "")
        + f"<h2>Checks</h2>{''.join(sections)}"
        + bench_section(run)
        + f"<h2>Environment</h2><table id='environment'>{environment}</table>"
        "</body></html>\n"
    )


def write_html(run: RunResult, path) -> None:
    write_atomically(path, render(run))
