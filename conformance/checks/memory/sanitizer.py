"""compute-sanitizer around one sanitized child, and its report read back as findings.

The child (``conformance.checks.memory.sanitized_case``) prints ``@@phase NAME`` before each backend call
and synchronizes after it, so every report the tool prints lands under the phase that launched
the kernel. The tool's host backtrace carries the Python frames of the launch (``Host Frame: fn
in file.py:line``); those are kept, the native frames dropped.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from conformance.harness.allocation_map import AllocationMap

TOOLS = ("memcheck", "initcheck")
PHASE_MARKER = "@@phase "
PREFIX = "========="
# Reports printed per run (the ERROR SUMMARY counts them all). A report not read back fails the case,
# and initcheck prints a host copy of never-written memory once per 32 bytes (4,096 for a backend
# copying a 128 KiB output that a TMA-storing kernel wrote): the limit must hold what a clean run
# sets aside.
PRINT_LIMIT = 20_000
API_COPIES_OPTION = "--check-api-memory-access"
# What the tool prints when it cannot run on this machine (gVisor refuses the device).
UNSUPPORTED_MARKERS = ("Device not supported", "Unable to find injection library", "not supported on this platform")
MAX_FINDINGS = 8
# The tool's own notes among its records' first lines.
NOTES = re.compile(r"^(COMPUTE-SANITIZER|Target application returned|ERROR SUMMARY|Warning:|\d+ errors were skipped)")
# Triton's launch machinery: the frames above it say which backend call launched the kernel.
LAUNCHER_FILES = ("driver.py", "jit.py", "autotuner.py")


def find_tool() -> str | None:
    """compute-sanitizer on PATH, else in the CUDA toolkit ($CUDA_HOME, /usr/local/cuda)."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "bin", "compute-sanitizer").is_file():
            return str(Path(root, "bin", "compute-sanitizer"))
    return None


@dataclass
class Report:
    """One error the tool printed."""

    what: str  # "Invalid __global__ read of size 4 bytes", "Uninitialized __global__ memory read of size 2 bytes"
    phase: str = ""
    kernel: str = ""
    address: int | None = None
    nearest: int | None = None  # memcheck: the start of the allocation nearest an out-of-bounds address
    detail: str = ""  # memcheck's own words on where the address lies
    frames: list[str] = field(default_factory=list)  # Python frames of the launch, outermost first

    @property
    def is_host_api(self) -> bool:
        return self.what.startswith("Host API")

    def launched_from(self, file_name: str) -> bool:
        return any(frame.rsplit(" in ", 1)[-1].startswith(file_name + ":") for frame in self.frames)

    @property
    def is_api_error(self) -> bool:
        """A CUDA API call that returned an error."""
        return self.what.startswith("Program hit")

    @property
    def is_entry_point_probe(self) -> bool:
        """A failed driver entry-point lookup: libraries ask ``cuGetProcAddress`` for symbols the
        driver may not have and handle the answer (flash-attn-4's CuTe DSL runtime: 34 a process)."""
        return self.is_api_error and "cuGetProcAddress" in self.what

    @property
    def is_kernel_fault(self) -> bool:
        return not (self.is_api_error or self.is_host_api)

    def is_set_aside(
        self, where: AllocationMap, backend_file: str | None, tool: str, after_fault: bool = False
    ) -> bool:
        """Not a finding: an API error that follows a kernel fault (``after_fault``: a consequence,
        the fault is its own report) or is an entry-point probe; the harness's own copy (a host API
        report with no frame in ``backend_file``); or, under initcheck, the backend copying out of
        its *own* memory: that is what initcheck says of a vendor kernel's fresh output on Hopper
        (flash-attn-4's, which numerics proves written, read as never written when its adapter
        copied it out: initcheck does not appear to follow the kernel's bulk-async stores), and the
        output it feeds is numerics' to judge. Any other failing API call counts (a library that
        ignores its own failed call), and so does a memcheck report of the backend's copy (out of
        bounds), whoever's memory it started in."""
        if self.is_api_error:
            return after_fault or self.is_entry_point_probe
        if not self.is_host_api:
            return False
        if bool(backend_file) and not self.launched_from(backend_file):
            return True
        if tool != "initcheck":
            return False
        return self.address is None or not where.holds(self.address)


@dataclass
class SanitizerRun:
    tool: str
    returncode: int
    reports: list[Report]
    error_count: int | None  # the tool's ERROR SUMMARY
    unsupported: str | None = None  # the tool's reason when it could not check this device
    output_tail: str = ""
    written: dict | None = None  # what the child wrote to its OUT.json


def parse(text: str) -> tuple[list[Report], int | None, str | None]:
    """(reports, the ERROR SUMMARY count, why the tool could not run) from the combined output."""
    reports: list[Report] = []
    phase, current, error_count, unsupported = "", None, None, None
    for raw in text.splitlines():
        if raw.startswith(PHASE_MARKER):
            phase, current = raw[len(PHASE_MARKER) :].strip(), None
            continue
        if not raw.startswith(PREFIX):
            continue
        line = raw[len(PREFIX) + 1 :]  # a record's first line follows one space, its details more
        body = line.strip()
        if any(marker in body for marker in UNSUPPORTED_MARKERS):
            unsupported = unsupported or body
        if not body:
            current = None
            continue
        if not line.startswith(" "):  # a record's first line, or the tool's own notes
            summary = re.fullmatch(r"ERROR SUMMARY: (\d+) errors?", body)  # not "... N errors were not printed"
            if summary:
                error_count = int(summary.group(1))
                current = None
            elif NOTES.match(body):
                current = None
            else:
                current = Report(body, phase)
                reports.append(current)
            continue
        if current is None:
            continue
        _read_detail(current, body)
    return reports, error_count, unsupported


def _read_detail(report: Report, body: str) -> None:
    if body.startswith("at ") and not report.kernel:
        report.kernel = re.sub(r"\+0x[0-9a-f]+", "", body[3:]).strip()
    elif body.startswith(
        ("Address ", "Access to ", "Uninitialized access ")
    ):  # initcheck's words, memcheck's, a host API's
        match = re.match(r"(?:Address|Access to|Uninitialized access (?:at|to)) (0x[0-9a-fA-F]+)\s*(.*)", body)
        if match:
            report.address = int(match.group(1), 16)
            report.detail = match.group(2).strip()
    elif "nearest allocation at" in body:
        match = re.search(r"nearest allocation at (0x[0-9a-fA-F]+)", body)
        report.nearest = int(match.group(1), 16) if match else None
        report.detail = f"{report.detail} {body}".strip()
    elif body.startswith("Host Frame:"):
        frame = body[len("Host Frame:") :].strip()
        match = re.fullmatch(r"\S+ in (\S+\.py):\d+", frame)
        if match and match.group(1) not in LAUNCHER_FILES:
            report.frames.insert(0, frame)  # the tool prints the innermost frame first


def partition(
    reports: list[Report], where: AllocationMap, tool: str, backend_file: str | None = None
) -> tuple[list[Report], list[Report]]:
    """(reports that are findings, reports ``Report.is_set_aside`` names), read in the tool's order
    so that an API error counts as a consequence only after a kernel fault printed before it."""
    kept: list[Report] = []
    set_aside: list[Report] = []
    faulted = False
    for report in reports:
        (set_aside if report.is_set_aside(where, backend_file, tool, after_fault=faulted) else kept).append(report)
        faulted = faulted or report.is_kernel_fault
    return kept, set_aside


def findings(
    reports: list[Report], where: AllocationMap, tool: str, stage: str, backend_file: str | None = None
) -> list[dict]:
    """The reports ``partition`` keeps, as ``grouped`` findings."""
    return grouped(partition(reports, where, tool, backend_file)[0], where, tool, stage)


def grouped(kept: list[Report], where: AllocationMap, tool: str, stage: str) -> list[dict]:
    """Reports grouped by what, kernel, phase and the kind of place they hit (numbers left out of
    the grouping, so 6,000 reads of one reserved block are one finding with a count)."""
    groups: dict[tuple, dict] = {}
    for report in kept:
        place = where.describe(report.address, report.nearest) if report.address is not None else report.detail
        kernel = report.kernel[:200]
        key = (re.sub(r"\d+", "N", report.what), kernel, report.phase, re.sub(r"\d+", "N", place))
        if key in groups:
            groups[key]["count"] += 1
            continue
        groups[key] = {
            "tool": tool,
            "stage": stage,
            "what": report.what,
            "kernel": kernel,
            "phase": report.phase,
            "place": place,
            "address": None if report.address is None else hex(report.address),
            "sanitizer_detail": report.detail,
            "launch": report.frames[-6:],
            "count": 1,
        }
    return list(groups.values())[:MAX_FINDINGS]


@functools.cache
def has_option(tool_path: str, option: str) -> bool:
    """Whether this compute-sanitizer knows ``option`` (its --help lists it)."""
    try:
        listed = subprocess.run(
            [tool_path, "--help"], capture_output=True, text=True, timeout=60, errors="replace"
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return option in listed


def command(tool_path: str | None, tool: str, child_args: list[str], api_copies: bool = True) -> list[str]:
    """The child's command line, under ``tool`` (no tool: the child alone). ``api_copies=False``
    leaves cudaMemcpy/cudaMemset unchecked where the tool allows it: in a replayed graph their
    launch has no Python frame to say whose copy it was."""
    child = [sys.executable, "-m", "conformance.checks.memory.sanitized_case", *child_args]
    if tool_path is None:
        return child
    options = ["--tool", tool, "--print-limit", str(PRINT_LIMIT), "--show-backtrace", "host"]
    if not api_copies and has_option(tool_path, API_COPIES_OPTION):
        options += [API_COPIES_OPTION, "no"]
    return [tool_path, *options, *child]


def run(
    tool_path: str | None,
    tool: str,
    child_args: list[str],
    env: dict[str, str],
    timeout_s: float,
    api_copies: bool = True,
) -> SanitizerRun:
    """Run the child under ``tool``; its output is read whole (the reports and markers interleave
    on one stream). A child past ``timeout_s`` is killed and reported as such."""
    try:
        completed = subprocess.run(
            command(tool_path, tool, child_args, api_copies),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            timeout=timeout_s,
            text=True,
            errors="replace",
        )
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout if isinstance(expired.stdout, str) else (expired.stdout or b"").decode(errors="replace")
        return SanitizerRun(tool, -9, parse(output)[0], None, None, f"killed after {timeout_s:g} s\n" + output[-3000:])
    reports, error_count, unsupported = parse(completed.stdout)
    return SanitizerRun(tool, completed.returncode, reports, error_count, unsupported, completed.stdout[-3000:])
