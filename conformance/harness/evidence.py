"""What a report shows of a case's evidence, in one form every report renders.

A check writes its evidence as a plain dict (it travels as JSON from the isolated child) and
describes it as a list of ``EvidenceItem`` (``Check.describe_evidence``); the terminal, HTML,
Markdown and JUnit reports and the pytest plugin render those items and know no evidence key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, TypedDict

from conformance.harness.error_map import summary

SHORT_TEXT = 120  # characters: a structured value up to this long stays on one line


@dataclass(frozen=True)
class EvidenceItem:
    """A label and its text. ``block`` text is preformatted (a stack, a traceback): HTML shows it
    whole, the terminal its last lines, the Markdown summary only its label."""

    label: str
    text: str
    block: bool = False
    grid: dict[str, Any] | None = None  # an ``error_map.Grid``: HTML draws it, the others show ``text``


class WorstElement(TypedDict):
    """The output element furthest past the tolerance (``compare_with_oracle``)."""

    request: int
    token: int  # within the request
    head: int
    channel: int
    got: float
    expected: float


class SyncEventRecord(TypedDict, total=False):
    """``host_syncs.events.SyncEvent.to_dict()``."""

    kind: str
    api: str
    blocking: bool
    num_bytes: int | None
    phase: str
    source: str | None
    stack: list[str]


def without(evidence: dict[str, Any], *keys: str) -> dict[str, Any]:
    """The evidence a check has not described, for the base description."""
    return {key: value for key, value in evidence.items() if key not in keys}


def worst_element(worst: WorstElement | None) -> list[EvidenceItem]:
    if not worst:
        return []
    return [EvidenceItem("worst element", ", ".join(f"{key} {value}" for key, value in worst.items()))]


MAP_KEYS = {"error_map": "error map", "key_map": "key map"}  # the ``error_map`` grids a comparison writes
DRAWN_IN_HTML = " (the HTML report draws the map)"  # after a map's summary, where no picture is drawn


def maps(evidence: dict[str, Any]) -> list[EvidenceItem]:
    """One item per map: its one-line summary as text, the grid for the HTML report to draw."""
    return [
        EvidenceItem(label, summary(evidence[key]), grid=evidence[key])
        for key, label in MAP_KEYS.items()
        if evidence.get(key)
    ]


def sync_events(label: str, events: Iterable[SyncEventRecord] | None) -> list[EvidenceItem]:
    """One item per event: what it was and the line to change, its stack as the block."""
    items = []
    for event in events or []:
        size = f" {event['num_bytes']} B" if event.get("num_bytes") is not None else ""
        items.append(
            EvidenceItem(
                f"{label}: {event.get('kind', '?')} ({event.get('api', '?')}{size}) in {event.get('phase') or '?'} "
                f"at {event.get('source') or 'unknown frame'}",
                "\n".join(event.get("stack") or []),
                block=True,
            )
        )
    return items


def labelled(label: str, value: Any) -> list[EvidenceItem]:
    """``value`` under ``label``, as it is (JSON when structured: one line when short), so nothing a
    check did not describe is hidden; nothing for an empty value."""
    if value in (None, "", [], {}):
        return []
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if not isinstance(value, str) and len(text) > SHORT_TEXT:  # too long for one line: indented
        text = json.dumps(value, indent=1, default=str)
    return [EvidenceItem(label, text, block="\n" in text)]


def plain_lines(items: Iterable[EvidenceItem], block_lines: int | None = None) -> list[str]:
    """The items as text lines (terminal, JUnit, pytest): a block indented under its label, cut to
    its last ``block_lines`` lines where given (a traceback's end is where the error is)."""
    lines = []
    for item in items:
        if not item.block:
            text = item.text + (DRAWN_IN_HTML if item.grid else "")
            lines.append(f"{item.label}: {text}" if item.label else text)
            continue
        if item.label:
            lines.append(f"{item.label}:")
        body = item.text.strip().splitlines()
        if block_lines is not None and len(body) > block_lines:
            body = ["…"] + body[-block_lines:]
        lines += ["  " + line for line in body]
    return lines
