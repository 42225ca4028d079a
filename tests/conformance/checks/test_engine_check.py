"""The engine check on a CPU: torch_naive passes (async == sync == plain); a backend that trusts
max_seq_len as exact passes the attention checks but fails here, under async scheduling only; a
backend whose update_for_draft_step forgets the last row fails on its drafts, which its output
and its acceptance counts do not show. The steady-state window counts the steps right after a
request joined or left (synthetic step records; the measured workload on a CPU); on a GPU, a
backend that syncs only when the number of requests changes fails there."""

import collections
import dataclasses

import pytest
import torch

from backends import registry
from conformance.cases.grammar import parse_case
from conformance.checks.engine import EngineCheck
from conformance.checks.numerics import NumericsCheck
from conformance.harness.engine_runs import STEADY_STEPS, EngineRuns, TooFewSteadySteps
from conformance.results import RunResult, Verdict
from conformance.run.execution import judge
from reference_engine.batched_engine import StepRecord
from reference_engine.metrics import steady_iterations
from tests.planted import graph_backends
from tests.planted.steady_defects import SyncsWhenBatchChanges

CASE = parse_case("gqa-h4/2-d32-fp32-p16:30+1,9+1@0")


def test_engine_check_passes_torch_naive_once_per_layout():
    check = EngineCheck()
    cpu = torch.device("cpu")
    backend = registry.load("torch_naive")
    result = judge(check, backend, CASE, cpu)
    assert result.verdict == Verdict.PASS, result.reason
    assert "async == sync == plain" in result.reason
    assert check.case_skip_reason(backend, CASE, cpu) is None
    same_layout = parse_case("gqa-h4/2-d32-fp32-p16:12+1@3")  # another batch of the same layout
    plan = check.plan(backend, [CASE, same_layout], cpu)
    assert plan == {CASE.id: None, same_layout.id: f"layout covered by {CASE.id}"}
    assert check.plan(backend, [same_layout, CASE], cpu)[CASE.id] == f"layout covered by {same_layout.id}"


def test_engine_check_fails_a_backend_that_guesses_lengths_optimistically():
    backend = registry.load("tests.planted.defects:GuessesSeqLens")
    cpu = torch.device("cpu")
    assert judge(NumericsCheck(), backend, CASE, cpu).verdict == Verdict.PASS  # exact lengths: fine
    result = judge(EngineCheck(), backend, CASE, cpu)
    assert result.verdict == Verdict.FAIL
    assert "async vs sync" in result.reason and "fp32 margin" in result.reason  # re-scored by the fp32 copy


@pytest.mark.slow
@pytest.mark.xdist_group("smoke_run")  # under pytest -n: with the other tests of the shared run (tests/conftest.py)
def test_engine_check_is_listed_and_runs_from_the_cli(smoke_run):
    # The CLI's default checks on the smoke suite, torch_naive: the engine check among them.
    completed, out = smoke_run
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "engine" in completed.stdout
    engine = RunResult.load(out / "results.json").backends[0].check("engine")
    assert engine.verdict == Verdict.PASS and engine.cases, engine


class GraphSafeOnCpu(graph_backends.TorchGraphSafe):
    capabilities = dataclasses.replace(graph_backends.TorchGraphSafe.capabilities, devices=frozenset({"cpu", "cuda"}))


class ForgetsLastRowOnCpu(graph_backends.ForgetsLastRowInDraftUpdate):
    capabilities = GraphSafeOnCpu.capabilities


@pytest.mark.slow
def test_engine_check_compares_the_draft_update_path_with_rebuilt_metadata():
    cpu = torch.device("cpu")
    for dtype in ("fp32", "bf16"):
        case = parse_case(f"gqa-h4/2-d64-{dtype}-p16:30+1")
        result = judge(EngineCheck(), GraphSafeOnCpu, case, cpu)
        assert result.verdict == Verdict.PASS, result.reason
        digests = result.evidence["verified_drafts_digest"]
        assert digests["update_for_draft_step"] == digests["metadata_rebuilt"]
        result = judge(EngineCheck(), ForgetsLastRowOnCpu, case, cpu)
        assert result.verdict == Verdict.FAIL and "update_for_draft_step drafts other tokens" in result.reason, (
            result.reason
        )


def record(index: int, num_reqs: int, uniform_decode: bool = True, captured: bool = False) -> StepRecord:
    return StepRecord(index, 100 + index, num_reqs, num_reqs, uniform_decode, captured, 0.0, 0.0)


def test_steady_iterations_count_the_steps_right_after_a_request_joined_or_left():
    """Each counted iteration (the launching one, not the step's index) with the change it came
    right after; the prefill and mixed steps and the captures are not steady state."""
    steps = [
        record(0, 4, uniform_decode=False),  # the prompts' prefill
        record(1, 4),  # the first decode step: every request has just joined
        record(2, 4),
        record(3, 4, captured=True),
        record(4, 3),  # a request left
        record(5, 4, uniform_decode=False),  # a waiting one joins: its prefill beside the decodes
        record(6, 4),  # the first decode step after it
        record(7, 4),
        record(8, 2),
        record(9, 3),  # async: a request thought finished, awaiting its results, is back
        record(10, 1),
    ]
    steady = steady_iterations(type("Engine", (), {"steps": steps}))
    assert steady == {
        101: "join",
        102: "",
        104: "leave",
        106: "join",
        107: "",
        108: "leave",
        109: "join",
        110: "leave",
    }


def test_the_measured_window_must_hold_a_join_and_a_leave():
    EngineRuns.require_steady_window(STEADY_STEPS, ["", "join", "leave"])
    for changes in (["", "leave"], ["", "join"], [""]):
        with pytest.raises(TooFewSteadySteps, match="came right after a request"):
            EngineRuns.require_steady_window(STEADY_STEPS, changes)
    with pytest.raises(TooFewSteadySteps, match="fewer than the"):
        EngineRuns.require_steady_window(STEADY_STEPS - 1, ["join", "leave"])


@pytest.mark.slow
def test_the_measured_workload_has_requests_joining_and_leaving_among_its_steady_steps():
    """The measured run's workload, on a CPU (no graphs, no detector: the steps are the same):
    more requests than the engine's slots, each with its own max_tokens."""
    runs = EngineRuns(GraphSafeOnCpu, parse_case("gqa-h4/2-d32-fp32-p16:30+1"), torch.device("cpu"), [], {})
    engine = runs.steady_engine()
    outputs = engine.generate(*runs.steady_workload())
    assert len(outputs) > runs.base.max_num_reqs
    changes = collections.Counter(steady_iterations(engine).values())
    assert sum(changes.values()) >= STEADY_STEPS and changes["join"] and changes["leave"], changes
    EngineRuns.require_steady_window(sum(changes.values()), list(changes.elements()))


@pytest.mark.gpu
def test_engine_check_fails_a_backend_that_syncs_when_the_batch_changes():
    """Syncs exist only on CUDA. The planted backend reads a length back only when a build has
    another number of requests than the last: in no step of identical batches, so only the steps
    right after a request joined or left show it. Correct graph-safe backends (and torch_naive,
    whose syncs its needs_cpu_seq_lens claim allows) pass."""
    cuda = torch.device("cuda")
    case = parse_case("gqa-h8/2-d64-bf16-p16:30+1,9+1@0")
    result = judge(EngineCheck(), graph_backends.TorchGraphSafe, case, cuda)
    assert result.verdict == Verdict.PASS, result.reason
    assert result.metrics["host_syncs_per_steady_step"] == 0
    assert result.metrics["joins_measured"] and result.metrics["leaves_measured"], result.metrics
    result = judge(EngineCheck(), SyncsWhenBatchChanges, case, cuda)
    assert result.verdict == Verdict.FAIL, result.reason
    assert "host syncs per steady-state async step while claiming needs_cpu_seq_lens=False" in result.reason
    assert "steady_defects.py" in result.reason, result.reason
    assert judge(EngineCheck(), registry.load("torch_naive"), case, cuda).verdict == Verdict.PASS


@pytest.mark.parametrize(
    "apart, accepted, reason",
    [
        (None, True, ""),  # runs that differ in more than batching (plain against spec): a near tie is enough
        (lambda prompt, index: True, True, ""),
        (lambda prompt, index: False, False, "held the same rows and host lengths in both loops"),
        (lambda prompt, index: None, False, "no step records"),
    ],
)
def test_a_near_tie_between_the_loops_needs_the_prompts_steps_batched_apart(monkeypatch, apart, accepted, reason):
    """async vs sync: a near-tie flip is accepted only where the prompt's own steps up to the token
    were batched apart; after steps batched alike the loops had the same inputs."""
    from types import SimpleNamespace

    from reference_engine import equality

    near_tie = SimpleNamespace(
        margin=0.01, behind_top=0.01, tolerance=lambda dtype: 0.2, is_near_tie=lambda dtype: True
    )
    monkeypatch.setattr(equality, "fp32_reference", lambda model, **options: object())
    monkeypatch.setattr(equality, "explain", lambda *args: near_tie)
    base = SimpleNamespace(block_size=16, query_dtype=None, dtype=torch.bfloat16)
    evidence = {}
    problem = EngineCheck()._difference(
        "async vs sync", [[1, 2, 9]], [[1, 2, 3]], [[5, 6]], None, base, evidence, apart
    )
    assert (problem is None) == accepted and reason in (problem or "")
    assert len(evidence.get("near_ties", [])) == (1 if accepted else 0)
