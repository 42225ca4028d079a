"""Strings from a backend (reasons, tracebacks, stderr tails, names) rendered so that they show
what they say and do nothing else: no terminal escape sequence runs, no XML report becomes
unparsable, no Markdown table or heading is injected.
"""
from __future__ import annotations

import re

# ANSI/VT sequences: CSI (colours, cursor moves, screen clears), OSC (window titles, links, ended
# by BEL or ST), and the two-character escapes.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 (but tab and newline), DEL, C1
# What XML 1.0 forbids (besides the controls above): lone surrogates and the two non-characters.
_XML_FORBIDDEN = re.compile("[\ud800-\udfff\ufffe\uffff]")


def _escaped(match: re.Match) -> str:
    return f"\\x{ord(match.group()):02x}"


def strip_ansi(text: str) -> str:
    """Colour and cursor sequences removed (a traceback printed by a colouring logger)."""
    return _ANSI.sub("", text)


def visible(text: str, *, one_line: bool = False) -> str:
    """Escape sequences removed, every other control character shown as ``\\xNN``; with
    ``one_line``, newlines shown as ``⏎`` (a reason must not fake a second line)."""
    text = _CONTROL.sub(_escaped, strip_ansi(str(text)))
    return text.replace("\n", " ⏎ ") if one_line else text


def xml_safe(text: str) -> str:
    """Legal in an XML 1.0 document (ElementTree escapes the markup characters itself)."""
    return _XML_FORBIDDEN.sub(lambda m: f"\\u{ord(m.group()):04x}", visible(text))


_MARKDOWN_INLINE = re.compile(r"([\\`*_\[\]|~])")  # emphasis, code, links, table cells, strikethrough
_MARKDOWN_BLOCK_START = re.compile(r"^(\s*)([#+\-=]|\d+[.)])")  # a heading, list or rule where a line starts


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
