"""The conformance smoke suite against ``template_backend.TemplateBackend``, through the pytest
plugin, in a pytest of its own: its items are the suite's (one per check and case), and it
passes only if every check passes or skips for a claim the backend does not make."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_the_smoke_suite_passes(tmp_path):
    # An empty folder to collect from: the plugin adds the conformance items itself.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "--conformance-backend",
            "template_backend:TemplateBackend",
            "--conformance-suite",
            "smoke",
            "--conformance-device",
            "cpu",
            str(tmp_path),
        ],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
