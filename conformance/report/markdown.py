"""A Markdown summary for a pull-request comment or a CI step summary ($GITHUB_STEP_SUMMARY)."""

from __future__ import annotations

from conformance.checks import check_class
from conformance.harness.evidence import DRAWN_IN_HTML
from conformance.report.reproduce import reproduce_command
from conformance.report.safe_text import markdown_code, markdown_inline
from conformance.results import RunResult

MAX_FAILURES = 20
MAX_EVIDENCE_ITEMS = 3  # per failure
ICONS = {"PASS": "✅", "FAIL": "❌", "ERROR": "⚠️", "CRASH": "💥", "SKIP": "⏭️"}


def render(run: RunResult) -> str:
    gpu = run.environment.get("gpu") or run.environment.get("device", "")
    lines = [f"### conformance: {markdown_inline(run.suite)} suite on {markdown_inline(gpu)}", ""]
    if run.interrupted:
        lines += [f"**{run.INTERRUPTED_NOTE}**", ""]
    lines += ["| backend | " + " | ".join(run.checks) + " |", "|---" * (len(run.checks) + 1) + "|"]
    for backend in run.backends:
        cells = []
        for name in run.checks:
            check = backend.check(name)
            if check is None:
                cells.append("")
                continue
            detail = f" {check.passed}/{check.ran}" if check.cases else ""
            cells.append(f"{ICONS[check.verdict.value]} {check.verdict.value}{detail}")
        label = markdown_inline(
            backend.name if backend.available else f"{backend.name} (not available: {backend.reason})"
        )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    failures = [
        (backend.name, check.name, case)
        for backend in run.backends
        for check in backend.checks
        for case in check.cases
        if case.verdict.is_failure
    ]
    if failures:
        lines += ["", f"#### Failures ({len(failures)})", ""]
        for backend, check, case in failures[:MAX_FAILURES]:
            lines.append(
                f"- **{case.verdict.value}** {markdown_code(backend)} / {check} {markdown_code(case.case)}: "
                f"{markdown_inline(case.reason)}"
            )
            lines.append(f"  - reproduce: {markdown_code(reproduce_command(run, backend, check, case.case))}")
            # A block's label alone (a sync event's line to change): a stack or a traceback belongs in
            # the HTML report, not in a pull-request comment.
            items = check_class(check).describe_evidence(case.evidence)[:MAX_EVIDENCE_ITEMS]
            lines += [
                f"  - {markdown_inline(item.label)}"
                if item.block
                else f"  - {markdown_inline(item.label)}: {markdown_code(item.text)}"
                + (markdown_inline(DRAWN_IN_HTML) if item.grid else "")
                for item in items
            ]
        if len(failures) > MAX_FAILURES:
            lines.append(f"- … and {len(failures) - MAX_FAILURES} more in the JSON results")
    lines += [
        "",
        f"<sub>{markdown_inline(run.environment.get('command', ''))} · "
        f"{markdown_inline(run.environment.get('git_sha') or run.environment.get('version') or '')}</sub>",
        "",
    ]
    return "\n".join(lines)
