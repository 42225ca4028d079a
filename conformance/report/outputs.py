"""A run's files, written so that none is lost to another's failure and none is left half-made.

Every report is rendered to text before any file is written: a results file this version cannot
draw (evidence of a shape no check writes) is refused whole, with no partial output. Then each
file is written on its own (atomically: ``conformance.atomic_write``); one that cannot be (a full
disk, a mount gone read-only) is named in one line and the others are still written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from conformance.atomic_write import write_atomically
from conformance.report import html, junit, markdown
from conformance.results import RunResult

RENDERERS = {"html": html.render, "junit": junit.render, "markdown": markdown.render}


class UndrawableResults(ValueError):
    """A results file whose contents no report of this version can draw; one line."""


def render_reports(result: RunResult, paths: dict[str, str | Path | None]) -> dict[Path, str]:
    """Each asked-for report (kind -> path, None when not asked) as text."""
    texts = {}
    for kind, path in paths.items():
        if not path:
            continue
        try:
            texts[Path(path)] = RENDERERS[kind](result)
        except (TypeError, KeyError, ValueError, AttributeError, IndexError, RecursionError) as error:
            raise UndrawableResults(
                f"cannot draw the {kind} report from these results ({type(error).__name__}: {error}): "
                "a file this version of the suite did not write"
            ) from None
    return texts


@dataclass
class Written:
    """Which files were written, and one line for each that could not be."""

    written: list[Path] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def write(self, path: Path, text: str) -> None:
        try:
            write_atomically(path, text)
            self.written.append(path)
        except OSError as error:
            self.failed.append(f"{path}: {error.strerror or error}")

    def summary(self) -> str:
        """The one line a run prints when something could not be written."""
        kept = ", ".join(map(str, self.written)) or "none"
        return f"could not write {'; '.join(self.failed)} (written: {kept})"


def write_outputs(result: RunResult, results_path: Path | None, reports: dict[str, str | Path | None]) -> Written:
    """The results JSON (where asked) and every report, each on its own."""
    texts = render_reports(result, reports)
    written = Written()
    if results_path is not None:
        written.write(results_path, result.to_json())
    for path, text in texts.items():
        written.write(path, text)
    return written
