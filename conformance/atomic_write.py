"""Files a reader sees whole or not at all: results, reports and journals alike."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: str | Path, text: str) -> None:
    """Write a sibling temporary file and rename it over ``path``: a reader sees the old file or
    the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, 0o666 & ~_umask())  # mkstemp makes 0600: results are for the user's readers too
        # UTF-8 whatever the locale; a lone surrogate (an undecodable file name in a backend's
        # message) is written as its escape, never the reason a report is lost.
        with os.fdopen(handle, "w", encoding="utf-8", errors="backslashreplace") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
