"""One self-contained HTML report: inline CSS and inline SVG, no script, no network, opens from disk.

Summary matrix (backend x check, verdict colours) → unavailable backends → per backend and check,
every non-PASS case with its evidence (error statistics and worst location, sync events with
their lines and stacks, the graph batch that broke a replay, the failing draft step, a crash's
stderr tail) and all cases folded → bench tables with SVG bars (forward µs per backend per shape,
roofline fraction) → the environment block.
"""

from __future__ import annotations

import html
import json
import math
import re
from typing import Any

from conformance.atomic_write import write_atomically
from conformance.checks import check_class
from conformance.report.reproduce import reproduce_command
from conformance.report.safe_text import visible
from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict


def escape(text: Any) -> str:
    """Any text as HTML shows it: markup escaped, control characters and lone surrogates shown as
    their escapes (a raw NUL, ESC or BEL from a backend's message would otherwise reach the page)."""
    return html.escape(visible(str(text)))


def breakable(text: Any) -> str:
    """A backend's (or case's) name, escaped, allowed to break after its separators only
    (``pkg.module:Class`` breaks at "." and ":", not mid-word)."""
    return re.sub(r"([.:_/,+@-])", r"\1<wbr>", escape(text))


def _shown(value: Any) -> str:
    """An environment value as the page shows it: an unknown one (None) as a dash, not "None"."""
    return "—" if value is None or value == "" else escape(value)


def _key_values(data: dict[str, Any]) -> str:
    """A check's details as a two-column table: nested values as compact JSON."""
    rows = "".join(
        f"<tr><th>{escape(key)}</th><td>{escape(value if isinstance(value, str) else json.dumps(value))}</td></tr>"
        for key, value in data.items()
    )
    return f"<table class='numbers details'>{rows}</table>"


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
pre { background: #fafafa; border: 1px solid #eee; padding: 6px; font-size: 12px; max-height: 24em;
overflow: auto; white-space: pre-wrap; }
code { font-size: 12px; overflow-wrap: anywhere; }
details { margin: 0.4em 0; }
/* The summary fits a 1,280 px window whatever the number of checks: fixed columns, text wraps. */
#summary { table-layout: fixed; width: 100%; max-width: 1200px; }
#summary th, #summary td { overflow-wrap: break-word; font-size: 13px; }
#summary td.verdict span { white-space: normal; }
#summary th:first-child { width: 11em; }
table.failures { width: 100%; max-width: 1200px; }
table.numbers td, table.numbers th { white-space: nowrap; font-size: 12px; padding: 1px 6px; border:
none; text-align: right; }
table.numbers td:first-child { text-align: left; }
figure.map { margin: 0.4em 0; }
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
        label = breakable(backend.name) + (
            "" if backend.available else f"<br><span class='dim'>{escape(backend.reason)}</span>"
        )
        rows.append(f"<tr><th>{label}</th>{''.join(cells)}</tr>")
    return f"<table id='summary'><tr><th>backend</th>{head}</tr>{''.join(rows)}</table>"


MAPS_PER_CHECK = 8  # failures of one backend's check whose maps are drawn (each is tens of kB)


def _evidence(check_name: str, case: CaseResult, draw_maps: bool = True) -> str:
    parts = []
    for item in check_class(check_name).describe_evidence(case.evidence):
        label = f"{escape(item.label)}:" if item.label else ""
        if item.grid and draw_maps:
            parts.append(f"<p>{label} <span class='dim'>{escape(item.text)}</span></p>{heatmap(item.grid)}")
        else:
            parts.append(
                f"<p>{label}</p><pre>{escape(item.text)}</pre>"
                if item.block
                else f"<p>{label} <code>{escape(item.text)}</code></p>"
            )
    if case.metrics:
        parts.append(
            f"<details><summary>metrics</summary><pre>{escape(json.dumps(case.metrics, indent=1))}</pre></details>"
        )
    return "".join(parts)


MAP_WIDTH, MAP_HEIGHT = 560, 300  # px of cells; a map's cells shrink to fit


def _error_cell(value: float | None) -> tuple[str, float]:
    """(colour, opacity) of a tolerance ratio: green up to the tolerance, red darkening by decade
    past it (1000× is full), black for NaN/Inf (None)."""
    if value is None:
        return "#000000", 1.0
    if value <= 1:
        return "#2e7d32", 0.08 + 0.25 * value
    return "#c62828", min(1.0, 0.3 + 0.7 * math.log10(value) / 3)


KEY_MAP_NOISE = 0.2  # explained fractions below this are drawn blank: a random direction in d
# dimensions explains about 1/d of an error by chance


def _key_cell(value: float | None) -> tuple[str, float]:
    """(colour, opacity) of a signed explained fraction: red = extra weight, blue = missing."""
    if value is None:
        return "#000000", 1.0
    return ("#c62828" if value > 0 else "#1565c0"), max(0.0, (abs(value) - KEY_MAP_NOISE) / (1 - KEY_MAP_NOISE))


def _span(edges: list[int], index: int) -> str:
    first, last = edges[index], edges[index + 1] - 1
    return f"{first}" if first == last else f"{first}–{last}"


def heatmap(grid: dict[str, Any]) -> str:
    """A map (``conformance.harness.error_map.Grid``) as inline SVG: one rectangle per cell with a
    hover title, axis ranges at the ends, a legend; on the key map, the keys the oracle lets a
    token see shaded grey beneath, so a misplaced edge shows beside the real one."""
    values, rows, columns = grid["values"], grid["row_edges"], grid["column_edges"]
    if not values or not values[0]:
        return ""
    cell_w = max(2.0, min(16.0, MAP_WIDTH / len(values[0])))
    cell_h = max(2.0, min(12.0, MAP_HEIGHT / len(values)))
    left, top = 70, 18
    width, height = cell_w * len(values[0]), cell_h * len(values)
    colour_of = _error_cell if grid["kind"] == "error" else _key_cell
    unit = "× the tolerance" if grid["kind"] == "error" else "of the error explained"
    cells = []
    for r, row in enumerate(values):
        for c, value in enumerate(row):
            x, y = left + c * cell_w, top + r * cell_h
            seen = grid["visible"][r][c] if grid.get("visible") else 0
            if seen:
                cells.append(
                    f"<rect x='{x:.1f}' y='{y:.1f}' width='{cell_w:.1f}' height='{cell_h:.1f}' fill='#9e9e9e' "
                    f"fill-opacity='{0.35 * seen:.2f}'/>"
                )
            colour, opacity = colour_of(value)
            if opacity < 0.02:
                continue
            shown = "NaN/Inf" if value is None else f"{value:.3g}"
            cells.append(
                f"<rect x='{x:.1f}' y='{y:.1f}' width='{cell_w:.1f}' height='{cell_h:.1f}' fill='{colour}' "
                f"fill-opacity='{opacity:.2f}'><title>{escape(grid['row_label'])} {_span(rows, r)}, "
                f"{escape(grid['column_label'])} {_span(columns, c)}: {shown} {unit}</title></rect>"
            )
    legend = (
        "green: within tolerance · red: past it, darker by decade (full at 1000×) · black: NaN/Inf"
        if grid["kind"] == "error"
        else "grey: keys the token may see · red: a key with weight it should not have · blue: a key missing "
        "weight · strength: the fraction of the error that key alone explains · blank rows: tokens within "
        "tolerance"
    )
    axes = (
        f"<text x='{left}' y='12' font-size='11'>{escape(grid['column_label'])} {columns[0]} → {columns[-1] - 1}</text>"
        f"<text x='0' y='{top + 10}' font-size='11'>{rows[0]}</text>"
        f"<text x='0' y='{top + height}' font-size='11'>{rows[-1] - 1}</text>"
        f"<text x='0' y='{top + height / 2 + 4:.1f}' font-size='11'>{escape(grid['row_label'].split(' ')[0])}</text>"
        f"<rect x='{left}' y='{top}' width='{width:.1f}' height='{height:.1f}' fill='none' stroke='#757575'/>"
    )
    return (
        f"<figure class='map'><figcaption class='dim'>{escape(grid['title'])}</figcaption>"
        f"<svg class='map' role='img' width='{left + width + 10:.0f}' height='{top + height + 4:.0f}'>"
        f"{axes}{''.join(cells)}</svg><figcaption class='dim'>{escape(legend)}</figcaption></figure>"
    )


def _case_rows(check_name: str, cases: list[CaseResult], with_evidence: bool, reproduce=None) -> str:
    """``reproduce(case)``: the command that runs a failing case alone, shown above its evidence."""
    rows = []
    for index, case in enumerate(cases):
        evidence = _evidence(check_name, case, draw_maps=index < MAPS_PER_CHECK) if with_evidence else ""
        if reproduce is not None:
            evidence = f"<p>reproduce: <code class='repro'>{escape(reproduce(case))}</code></p>{evidence}"
        rows.append(
            f"<tr>{_verdict_cell(case.verdict)}<td><code>{breakable(case.case)}</code><br><span "
            f"class='dim'>{escape(case.tag)}</span></td>"
            f"<td>{escape(case.reason)}{evidence}</td></tr>"
        )
    return "".join(rows)


def check_section(backend: BackendResult, check: CheckResult, run: RunResult) -> str:
    failing = [case for case in check.cases if case.verdict.is_failure]
    details = (
        f"<details><summary>check details</summary>{_key_values(check.details)}</details>" if check.details else ""
    )
    parts = [
        f"<h3 id='{escape(backend.name)}-{escape(check.name)}'>{breakable(backend.name)} / {escape(check.name)}: "
        f"{check.verdict.value}</h3><p>{escape(check.summary)}</p>{details}"
    ]
    if failing:
        rows = _case_rows(
            check.name, failing, True, lambda case: reproduce_command(run, backend.name, check.name, case.case)
        )
        parts.append(f"<table class='failures'><tr><th>verdict</th><th>case</th><th>evidence</th></tr>{rows}</table>")
    if check.cases:
        parts.append(
            f"<details><summary>all {len(check.cases)} "
            f"cases</summary><table>{_case_rows(check.name, check.cases, False)}</table></details>"
        )
    return "".join(parts)


def _bars(values: list[tuple[str, float]], unit: str, width: int = 420, log: bool = False) -> str:
    """Horizontal bars, inline SVG, one per (label, value). ``log``: lengths on a log scale from
    half the smallest value to the largest (a CPU baseline 100× slower would otherwise squash
    every GPU backend into a sliver); the axis says so."""
    if not values:
        return ""
    top = max(value for _, value in values) or 1.0
    positive = [value for _, value in values if value > 0]
    floor = min(positive) / 2 if positive else 1.0
    room = width - 160  # px for the longest bar: the label and the number take the rest

    def length(value: float) -> float:
        if not log:
            return max(1.0, room * value / top)
        if value <= 0:
            return 1.0
        return max(1.0, room * math.log(value / floor) / (math.log(top / floor) or 1.0))

    row = 18
    bars = []
    for index, (label, value) in enumerate(values):
        bar = length(value)
        y = index * row
        bars.append(
            f"<text x='0' y='{y + 13}' font-size='12'>{escape(label)}</text>"
            f"<rect x='110' y='{y + 3}' width='{bar:.1f}' height='12' fill='{BAR_COLOURS[index % len(BAR_COLOURS)]}'/>"
            f"<text x='{114 + bar:.1f}' y='{y + 13}' font-size='11'>{value:.3g} {escape(unit)}</text>"
        )
    axis = f"<text x='110' y='{row * len(values) + 12}' font-size='10' fill='#757575'>log scale</text>" if log else ""
    return f"<svg width='{width + 60}' height='{row * len(values) + (16 if log else 4)}'>{''.join(bars)}{axis}</svg>"


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
        latency = _bars([(name, m["forward_us"]) for name, m in by_backend.items()], "µs", log=True)
        roofline = _bars([(name, 100 * m["roofline_fraction"]) for name, m in by_backend.items()], "% roofline")
        numbers = (
            "<table class='numbers'><tr><th></th><th>µs</th><th>×fastest</th><th>GB/s</th><th>build µs</th>"
            "<th>graph µs</th></tr>"
            + "".join(
                f"<tr><td>{escape(name)}</td><td>{m['forward_us']:.1f}</td><td>{m.get('ratio_to_fastest', 1):.2f}</td>"
                f"<td>{m['GBps']:.0f}</td><td>{m['build_us']:.1f}</td>"
                f"<td>{format(m['replay_us'], '.1f') if m.get('replay_us') else '–'}</td></tr>"
                for name, m in by_backend.items()
            )
            + "</table>"
        )
        rows.append(
            f"<tr><td>{escape(tag)}<br><code "
            f"class='dim'>{escape(case_id)}</code></td><td>{latency}</td><td>{roofline}</td><td>{numbers}</td></tr>"
        )
    return (
        "<h2 id='bench'>Bench</h2><table class='bench'><tr><th>shape</th><th>forward latency</th>"
        f"<th>roofline fraction</th><th>numbers</th></tr>{''.join(rows)}</table>"
    )


def render(run: RunResult) -> str:
    environment = "".join(f"<tr><th>{escape(k)}</th><td>{_shown(v)}</td></tr>" for k, v in run.environment.items())
    sections = []
    for backend in run.backends:
        if not backend.available:
            continue
        for check in backend.checks:
            if check.name != "bench":
                sections.append(check_section(backend, check, run))
    unavailable = "".join(
        f"<li><b>{breakable(b.name)}</b>: {escape(b.reason)}</li>" for b in run.backends if not b.available
    )
    title = (
        f"conformance — {escape(run.suite)} — "
        f"{escape(str(run.environment.get('gpu') or run.environment.get('device', '')))}"
    )
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{title}</title><style>{STYLE}</style></head><body>"
        f"<h1>{title}</h1><p class='dim'>{escape(str(run.environment.get('command', '')))} "
        f"· {escape(str(run.environment.get('time', '')))}</p>"
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
