"""Which Python line caused a host sync: the first frame, innermost first, that is not
infrastructure — this package, torch, the standard library, or what a tool built on it declares
(the conformance harness declares itself and the backend contract's helpers). That is the line a
backend or engine author must change."""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig

import torch

from host_syncs.events import Frame

_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"])
_INFRASTRUCTURE_DIRS = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__))]
_INFRASTRUCTURE_FILES: set[str] = set()

STACK_DEPTH = 16


def treat_as_infrastructure(*paths: str) -> None:
    """Frames in these directories or files are never blamed for a sync: a harness that calls the
    code under test, or helpers that copy on its behalf."""
    for path in map(os.path.abspath, paths):
        if os.path.isdir(path):
            if path not in _INFRASTRUCTURE_DIRS:
                _INFRASTRUCTURE_DIRS.append(path)
        else:
            _INFRASTRUCTURE_FILES.add(path)


def is_infrastructure(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path in _INFRASTRUCTURE_FILES or any(path.startswith(directory + os.sep) for directory in _INFRASTRUCTURE_DIRS):
        return True
    in_site_packages = "site-packages" in path or "dist-packages" in path
    return (path.startswith(_STDLIB_DIR + os.sep) and not in_site_packages) or filename.startswith("<")


def attribute(frames: list[Frame]) -> Frame | None:
    """The first non-infrastructure frame, walking from the innermost outwards."""
    for frame in reversed(frames):
        if not is_infrastructure(frame.filename):
            return frame
    return None


def capture_python_stack() -> tuple[list[Frame], Frame | None]:
    """The live Python stack (innermost last, at most STACK_DEPTH frames) and its source frame."""
    frames: list[Frame] = []
    frame = sys._getframe(1)
    while frame is not None:
        frames.append(Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    frames.reverse()
    source = attribute(frames)
    if source is not None:
        source = Frame(
            source.filename, source.lineno, source.function, linecache.getline(source.filename, source.lineno)
        )
    return frames[-STACK_DEPTH:], source
