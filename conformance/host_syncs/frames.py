"""Which Python line caused a host sync: the first frame, innermost first, that is neither the
harness, nor the contract's own helpers, nor torch, nor the standard library. That is the line a
backend author must change."""
from __future__ import annotations

import linecache
import os
import sys
import sysconfig

import torch

from conformance.host_syncs.events import Frame

_CONFORMANCE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"])
# The contract's helpers (e.g. CommonAttentionMetadata.seq_lens_cpu) copy on behalf of the caller.
_CONTRACT_FILE = os.path.join(os.path.dirname(_CONFORMANCE_DIR), "backends", "base.py")

STACK_DEPTH = 16


def is_infrastructure(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(_CONFORMANCE_DIR + os.sep) or path == _CONTRACT_FILE or path.startswith(_TORCH_DIR + os.sep):
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
        source = Frame(source.filename, source.lineno, source.function, linecache.getline(source.filename, source.lineno))
    return frames[-STACK_DEPTH:], source
