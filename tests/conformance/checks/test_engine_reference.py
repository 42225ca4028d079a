"""The engine check against an independent reference, on a CPU: a backend that keeps its first
layer's learned sinks or fp8 scales for every layer is wrong the same way in every engine run, so
the check's self-comparisons (spec vs plain, async vs sync, drafting vs plain) all pass it; its
plain decoding differs from the same run through torch_naive, and the check fails it there, first.
torch_naive and correct backends pass; a layout torch_naive cannot run is said, not skipped."""

import dataclasses

import pytest
import torch

from backends import registry
from backends.features import FP8_KV_CACHES
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import parse_case
from conformance.checks.engine import REFERENCE_LABEL, EngineCheck
from conformance.harness.engine_runs import EngineRuns
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.conformance.checks.test_engine_check import GraphSafeOnCpu
from tests.planted.layer_defects import KeepsFirstLayerSinks, KeepsFirstScalesInACopy

CPU = torch.device("cpu")
SINKS = parse_case("gqa-h4/2-d32-fp32-p16-attnsinks:30+1")  # gpt-oss's layout, small
FP8 = parse_case("gqa-h4/2-d32-fp32-fp8e4m3-p16:30+1")


class SelfComparisonsOnly(EngineCheck):
    """The engine check without the independent reference: what it judged before."""

    def _claims(self, backend_cls, runs):
        return [(label, claim) for label, claim in super()._claims(backend_cls, runs) if label != REFERENCE_LABEL]


class NaiveUnderAnotherName(TorchNaiveBackend):
    """torch_naive's code as another backend: compared with torch_naive, and equal to it."""

    name = "test_naive_under_another_name"


@pytest.mark.slow
@pytest.mark.parametrize(("defect", "case"), [(KeepsFirstLayerSinks, SINKS), (KeepsFirstScalesInACopy, FP8)])
def test_first_layer_state_kept_for_every_layer_passes_the_self_comparisons_and_fails_the_reference(defect, case):
    result = judge(SelfComparisonsOnly(), defect, case, CPU)
    assert result.verdict == Verdict.PASS, result.reason
    result = judge(EngineCheck(), defect, case, CPU)
    assert result.verdict == Verdict.FAIL, result.reason
    assert result.reason.startswith(f"{REFERENCE_LABEL}: prompt "), result.reason


def test_the_reference_claim_is_judged_first():
    runs = EngineRuns(KeepsFirstLayerSinks, SINKS, CPU, [], {})
    labels = [label for label, _ in EngineCheck()._claims(KeepsFirstLayerSinks, runs)]
    assert labels[0] == REFERENCE_LABEL and labels.count(REFERENCE_LABEL) == 1


@pytest.mark.parametrize("case", [SINKS, FP8], ids=["sinks", "fp8"])
@pytest.mark.slow
def test_torch_naive_and_a_copy_of_it_pass(case):
    result = judge(EngineCheck(), registry.load("torch_naive"), case, CPU)
    assert result.verdict == Verdict.PASS, result.reason
    assert "not compared with torch_naive (the backend under test is torch_naive itself)" in result.reason
    result = judge(EngineCheck(), NaiveUnderAnotherName, case, CPU)
    assert result.verdict == Verdict.PASS, result.reason
    assert "plain == torch_naive" in result.reason
    assert result.evidence["independent_reference"] == "plain decoding gave torch_naive's tokens"


@pytest.mark.slow
def test_a_graph_safe_backend_with_an_fp8_cache_passes():
    """Another implementation of the math (device lengths, one batched product, the layer's device
    scales) gives torch_naive's tokens, scale for scale, layer by layer."""
    result = judge(EngineCheck(), GraphSafeOnCpu, FP8, CPU)
    assert result.verdict == Verdict.PASS, result.reason
    assert "plain == torch_naive" in result.reason


def test_a_layout_torch_naive_cannot_run_is_said_not_skipped(monkeypatch):
    """Were an fp8 cache beyond torch_naive's claims, the claim says so (evidence and reason)
    instead of passing silently; no engine run is made for it."""
    naive = TorchNaiveBackend.capabilities
    monkeypatch.setattr(
        TorchNaiveBackend, "capabilities", dataclasses.replace(naive, features=naive.features - FP8_KV_CACHES)
    )
    runs = EngineRuns(GraphSafeOnCpu, FP8, CPU, [], {})
    label, claim = EngineCheck()._claims(GraphSafeOnCpu, runs)[0]
    assert label == REFERENCE_LABEL and claim() is None
    assert runs.evidence["independent_reference"].startswith("not compared: torch_naive cannot run this model here: ")
    assert "plain" not in runs.__dict__  # nothing ran
    assert "not compared with torch_naive (torch_naive cannot run" in EngineCheck._pass_reason(runs)


def test_every_layer_of_the_engines_model_has_sinks_and_fp8_scales_of_its_own():
    """What the claim relies on: the engine's model for a sinks case has different sinks in each
    layer, and an fp8 engine gives each layer scales of its own."""
    runs = EngineRuns(registry.load("torch_naive"), SINKS, CPU, [], {})
    sinks = [layer.sinks for layer in runs.model.layers]
    assert len(sinks) == 2 and not torch.equal(sinks[0], sinks[1])
    engine = EngineRuns(registry.load("torch_naive"), FP8, CPU, [], {}).engine_for()
    scales = [(scale.k_scale, scale.v_scale) for scale in engine.kv_scales]
    assert len(scales) == 2 and scales[0] != scales[1]
