"""The engine check on a CPU: torch_naive passes (async == sync == plain); a backend that trusts
max_seq_len as exact passes the attention checks but fails here, under async scheduling only; a
backend whose update_for_draft_step forgets the last row fails on its drafts, which its output
and its acceptance counts do not show."""

import dataclasses

import torch

from backends import registry
from conformance.cases.grammar import parse_case
from conformance.checks.engine import EngineCheck
from conformance.checks.numerics import NumericsCheck
from conformance.results import Verdict
from tests.planted import graph_backends

CASE = parse_case("gqa-h4/2-d32-fp32-p16:30+1,9+1@0")


def test_engine_check_passes_torch_naive_once_per_layout():
    check = EngineCheck()
    cpu = torch.device("cpu")
    backend = registry.load("torch_naive")
    result = check.run_case(backend, CASE, cpu)
    assert result.verdict == Verdict.PASS, result.reason
    assert "async == sync == plain" in result.reason
    assert check.case_skip_reason(backend, CASE, cpu) is None
    assert "covered by" in check.case_skip_reason(backend, CASE, cpu)


def test_engine_check_fails_a_backend_that_guesses_lengths_optimistically():
    backend = registry.load("tests.planted.defects:GuessesSeqLens")
    cpu = torch.device("cpu")
    assert NumericsCheck().run_case(backend, CASE, cpu).verdict == Verdict.PASS  # exact lengths: fine
    result = EngineCheck().run_case(backend, CASE, cpu)
    assert result.verdict == Verdict.FAIL
    assert "async vs sync" in result.reason


def test_engine_check_is_listed_and_runs_from_the_cli(tmp_path):
    import subprocess
    import sys

    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance.cli",
            "run",
            "--backend",
            "torch_naive",
            "--suite",
            "smoke",
            "--check",
            "engine",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "engine" in completed.stdout


class GraphSafeOnCpu(graph_backends.TorchGraphSafe):
    capabilities = dataclasses.replace(graph_backends.TorchGraphSafe.capabilities, devices=frozenset({"cpu", "cuda"}))


class ForgetsLastRowOnCpu(graph_backends.ForgetsLastRowInDraftUpdate):
    capabilities = GraphSafeOnCpu.capabilities


def test_engine_check_compares_the_draft_update_path_with_rebuilt_metadata():
    cpu = torch.device("cpu")
    for dtype in ("fp32", "bf16"):
        case = parse_case(f"gqa-h4/2-d64-{dtype}-p16:30+1")
        result = EngineCheck().run_case(GraphSafeOnCpu, case, cpu)
        assert result.verdict == Verdict.PASS, result.reason
        digests = result.evidence["verified_drafts_digest"]
        assert digests["update_for_draft_step"] == digests["metadata_rebuilt"]
        result = EngineCheck().run_case(ForgetsLastRowOnCpu, case, cpu)
        assert result.verdict == Verdict.FAIL and "update_for_draft_step drafts other tokens" in result.reason, (
            result.reason
        )
