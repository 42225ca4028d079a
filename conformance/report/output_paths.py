"""Output files are checked before any work starts, and written so that a reader never sees a
half-written file or an older run's file posing as this one.

A run takes minutes to hours on a GPU: finding at the end that ``--json`` names a directory, or a
place nobody may write, loses the results. ``check_writable`` tries what the write will do
(create the parent, create a file beside the target) and says in one line why it cannot.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class OutputPathError(ValueError):
    """An output path that cannot be written; the message names the option and the reason."""


def check_writable(option: str, path: str | Path) -> Path:
    """``path`` as a file that can be created or replaced; raises OutputPathError otherwise."""
    path = Path(path)
    if str(path) in ("", "."):
        raise OutputPathError(f"{option}: an empty path")
    if path.is_dir():
        raise OutputPathError(f"{option} {path}: is a directory; name a file")
    if path.exists() and not path.is_file():
        raise OutputPathError(f"{option} {path}: exists and is not a regular file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe") as probe:
            probe.write(b"x")  # a byte, flushed: a full disk is found now, not after the run
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        raise OutputPathError(f"{option} {path}: cannot write there ({error.strerror or error})") from None
    return path


def check_directory(option: str, path: str | Path) -> Path:
    """``path`` as a directory that exists or can be made, and can be written into."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{option} {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe."):
            pass
    except OSError as error:
        raise OutputPathError(f"{option} {path}: cannot write there ({error.strerror or error})") from None
    return path


def check_distinct(paths: dict[str, Path | None]) -> None:
    """Two options naming one file would overwrite each other's output."""
    seen: dict[Path, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        resolved = path.resolve()
        if resolved in seen:
            raise OutputPathError(f"{seen[resolved]} and {option} name the same file {path}")
        seen[resolved] = option


def companions(results: Path) -> dict[Path, str]:
    """The files a run keeps beside its results while it goes: its lock and its journal (an
    output written there would be deleted with them, or truncate them mid-run)."""
    return {
        results.with_name(results.name + ".lock"): f"the lock of {results}",
        results.with_name(results.name + ".journal"): f"the journal of {results}",
    }


def check_files(
    files: dict[str, str | Path | None],
    *,
    inputs: dict[str, str | Path] | None = None,
    results: Path | None = None,
) -> dict[str, Path | None]:
    """Each given file (option -> path, None when not asked for) writable, no two the same, none
    an input of the command (``inputs``: what it names, -> path) and none the lock or journal of
    the run's ``results``."""
    taken = {Path(path).resolve(): f"the input {path} ({what})" for what, path in (inputs or {}).items()}
    if results is not None:
        taken.update({path.resolve(): what for path, what in companions(results).items()})
    for option, path in files.items():
        if path and Path(path).resolve() in taken:
            raise OutputPathError(f"{option} {path}: is {taken[Path(path).resolve()]}; name another file")
    checked = {option: check_writable(option, path) if path else None for option, path in files.items()}
    check_distinct(checked)
    return checked
