"""Strings from a backend (reasons, tracebacks, stderr tails, names) rendered so that they show
what they say and do nothing else: no terminal escape sequence runs, no XML report becomes
unparsable, no Markdown table or heading is injected.
"""

from __future__ import annotations

import re

# ANSI/VT sequences: CSI (colours, cursor moves, screen clears), OSC (window titles, links, ended
# by BEL or ST), and the two-character escapes.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
# C0 (but tab and newline), DEL, C1; lone surrogates (no file encoding can hold them) and the two
# non-characters XML 1.0 forbids.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")


def _escaped(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def strip_ansi(text: str) -> str:
    """Colour and cursor sequences removed (a traceback printed by a colouring logger)."""
    return _ANSI.sub("", text)


def visible(text: str, *, one_line: bool = False) -> str:
    """Escape sequences removed, every other control character shown as ``\\xNN`` (``\\uNNNN``); with
    ``one_line``, newlines shown as ``⏎`` (a reason must not fake a second line)."""
    text = _CONTROL.sub(_escaped, strip_ansi(str(text)))
    return text.replace("\n", " ⏎ ") if one_line else text


def xml_safe(text: str) -> str:
    """Legal in an XML 1.0 document (ElementTree escapes the markup characters itself)."""
    return visible(text)


_MARKDOWN_INLINE = re.compile(r"([\\`*_\[\]|~])")  # emphasis, code, links, table cells, strikethrough
# A heading, list or rule where a line starts: the punctuation that makes it one is escaped ("1\." not "\1.",
# which shows its backslash: only punctuation takes one).
_MARKDOWN_BLOCK_START = re.compile(r"^(\s*(?:\d+)?)([#+\-=]|(?<=\d)[.)])")


def markdown_inline(text: str) -> str:
    """Plain text inside a Markdown paragraph, list item or table cell: one line, HTML and
    Markdown syntax escaped (readable as it is in the raw file: only what could act is escaped)."""
    text = visible(text, one_line=True)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _MARKDOWN_INLINE.sub(r"\\\1", text)
    return _MARKDOWN_BLOCK_START.sub(r"\1\\\2", text)


def markdown_code(text: str) -> str:
    """A code span (outside tables) that holds ``text`` whatever backticks it contains."""
    text = visible(text, one_line=True)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""  # CommonMark strips one space each side
    return f"{fence}{pad}{text}{pad}{fence}"
