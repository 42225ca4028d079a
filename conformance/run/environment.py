"""The environment block of a results document: enough to tell two runs apart."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command_output(command: list[str], cwd: Path | None = None) -> str | None:
    try:
        completed = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return completed.stdout.strip() if completed.returncode == 0 else None


def git_sha() -> str | None:
    # A checkout copied without .git (a GPU runner) can be told its commit.
    given = os.environ.get("CONFORMANCE_GIT_SHA", "").strip()
    if given:
        return given
    sha = _command_output(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT)
    if sha and _command_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT):
        sha += "-dirty"
    return sha


def collect_environment(device: torch.device) -> dict[str, Any]:
    environment: dict[str, Any] = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["conformance", *sys.argv[1:]]),
        "git_sha": git_sha(),
        "version": _version("specdec-conformance"),  # what an installed copy (no git checkout) can say
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "flashinfer": _version("flashinfer-python"),
        "flash_mla": _version("sgl-flash-mla"),
        "cupti": _version("cupti-python"),
        "device": device.type,
    }
    if device.type == "cuda" and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(device)
        environment.update(
            gpu=properties.name,
            compute_capability=f"{properties.major}.{properties.minor}",
            gpu_memory_gib=round(properties.total_memory / 2**30, 1),
            cuda_runtime=torch.version.cuda,
            driver=_command_output(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(device.index or 0)]
            ),
        )
    return environment
