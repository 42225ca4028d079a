"""The batched engine on a GPU with the Triton backend, CUDA graphs on: async == sync == plain
(or differing only at fp32-confirmed near-ties), graphs replayed, no host-blocking sync in a
steady-state async step, and the engine check passing."""

import dataclasses

import pytest
import torch

from backends import registry
from backends.features import EMPTY_REQUESTS
from backends.triton.backend import TritonAttentionBackend
from conformance.cases.grammar import parse_case
from conformance.checks.engine import EngineCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from reference_engine.batched_engine import BatchedEngine
from reference_engine.core import EngineConfig
from reference_engine.metrics import measure
from reference_engine.model import PRESETS, LlamaModel
from reference_engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("drafter", ["scripted:random:0.7", "layer-skip", "eagle", "ngram"])
def test_triton_async_equals_sync_with_graphs_and_no_syncs(drafter, temperature):
    if temperature and drafter.startswith("scripted"):
        pytest.skip("the scripted drafter follows greedy runs")
    device = torch.device("cuda")
    config = EngineConfig(
        model=PRESETS["tiny-d128"],
        backend="triton",
        device="cuda",
        dtype=torch.bfloat16,
        num_spec_tokens=3,
        drafter=drafter,
        max_num_reqs=8,
        num_blocks=256,
        cuda_graphs=True,
        check_inputs=True,
    )
    model = LlamaModel.random(config.model, 0, torch.bfloat16, device)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (5, 17, 33, 64, 9, 40, 21, 3)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=temperature, seed=3)
    sync = BatchedEngine(dataclasses.replace(config, async_scheduling=False), model).generate(prompts, params)
    engine = BatchedEngine(config, model)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    overlapped, metrics = measure(engine, prompts, params, detect_syncs=True)
    assert [o.tokens for o in overlapped] == [o.tokens for o in sync]
    assert engine.graphs.replays > 0 and engine.graphs.captures > 0
    assert metrics.steady_steps > 10
    assert metrics.host_syncs_per_steady_step == 0, metrics.host_sync_sources


def test_engine_check_passes_triton():
    case = parse_case("gqa-h8/2-d64-bf16-p16:30+1,9+1@0")
    result = judge(EngineCheck(), registry.load("triton"), case, torch.device("cuda"))
    assert result.verdict == Verdict.PASS, result.reason
    assert result.metrics["host_syncs_per_steady_step"] == 0


def test_engine_check_fails_a_backend_that_syncs_once_in_many_steady_steps():
    """A planted defect that claims needs_cpu_seq_lens=False and reads a length from the device on
    every 64th build: only the long steady-state look (at least STEADY_STEPS steps) sees it."""
    from tests.planted.steady_defects import SyncsEveryNthBuild

    case = parse_case("gqa-h8/2-d64-bf16-p16:30+1,9+1@0")
    result = judge(EngineCheck(), SyncsEveryNthBuild, case, torch.device("cuda"))
    assert result.verdict == Verdict.FAIL, result.reason
    assert "host syncs per steady-state async step while claiming needs_cpu_seq_lens=False" in result.reason


def test_engine_check_skips_the_steady_measurement_where_syncs_are_allowed():
    """torch_naive claims needs_cpu_seq_lens: its steady-state syncs could not fail the check, so
    the long measured runs are not made (and the reason says so)."""
    case = parse_case("gqa-h8/2-d64-bf16-p16:30+1,9+1@0")
    result = judge(EngineCheck(), registry.load("torch_naive"), case, torch.device("cuda"))
    assert result.verdict == Verdict.PASS, result.reason
    assert "host_syncs_per_steady_step" not in result.metrics
    assert "steady-state steps not measured (the backend claims needs_cpu_seq_lens" in result.reason


class TritonWithoutDraftStepUpdate(TritonAttentionBackend):
    """triton claiming no ``draft_step_update``: the engine must capture ONE draft step and replay it
    k times, rebuilding metadata on the host between replays (how flashinfer-like backends draft)."""

    name = "triton_without_draft_step_update"
    capabilities = dataclasses.replace(TritonAttentionBackend.capabilities, draft_step_update=False)


@pytest.mark.parametrize("drafter", ["layer-skip", "eagle"])
def test_one_draft_step_graph_replayed_k_times(drafter):
    device = torch.device("cuda")
    config = EngineConfig(
        model=PRESETS["tiny-d128"],
        backend=f"{__name__}:TritonWithoutDraftStepUpdate",
        device="cuda",
        dtype=torch.bfloat16,
        num_spec_tokens=3,
        drafter=drafter,
        max_num_reqs=8,
        num_blocks=256,
        cuda_graphs=True,
        check_inputs=True,
    )
    model = LlamaModel.random(config.model, 0, torch.bfloat16, device)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (12, 30, 7, 50)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    sync = BatchedEngine(dataclasses.replace(config, async_scheduling=False), model).generate(prompts, params)
    engine = BatchedEngine(config, model)
    overlapped = engine.generate(prompts, params)
    assert [o.tokens for o in overlapped] == [o.tokens for o in sync]
    keys = {key[0] for key in engine.graphs.graphs}
    assert "draft step" in keys and "draft loop" not in keys and "verify" in keys, keys


class TritonPaddingRowsOnly(TritonAttentionBackend):
    """triton claiming only padding rows of its own: the engine pads its graphs as SGLang does."""

    name = "triton_padding_rows_only"
    capabilities = dataclasses.replace(
        TritonAttentionBackend.capabilities,
        features=TritonAttentionBackend.capabilities.features - {EMPTY_REQUESTS},
    )


PLANTED = "tests.planted.graph_backends"


@pytest.mark.parametrize(
    "backend,twin,equal",
    [
        ("triton", f"{__name__}:TritonPaddingRowsOnly", True),
        (f"{PLANTED}:WritesLastTokenOfEmptyRequests", f"{PLANTED}:GraphSafeEmptyRequests", False),
    ],
)
def test_graph_padding_with_vllms_empty_requests(backend, twin, equal):
    """Three prompts under graphs of four rows: every decode step padded with one request, which
    for a backend claiming vLLM's style is empty (query and seq_len 0, block-table row -1). Right
    kernels emit what they emit padded with rows; a kernel whose empty request writes over the
    previous request's last token emits other tokens than its twin without that defect."""
    device = torch.device("cuda")
    config = EngineConfig(
        model=PRESETS["tiny-d128"],
        backend=backend,
        device="cuda",
        dtype=torch.bfloat16,
        max_num_reqs=4,
        num_blocks=128,
        num_spec_tokens=3,
        drafter="layer-skip",
        cuda_graphs=True,
    )
    model = LlamaModel.random(config.model, 0, torch.bfloat16, device)
    prompts = [[3, 14, 15, 92, 65], list(range(40, 73)), list(range(7, 19))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = BatchedEngine(config, model)
    tokens = [o.tokens for o in engine.generate(prompts, params)]
    assert engine.graphs.replays > 0
    assert any(buffers.verify_padding is not None for buffers in engine._buffers.values())
    reference = [
        o.tokens for o in BatchedEngine(dataclasses.replace(config, backend=twin), model).generate(prompts, params)
    ]
    assert (tokens == reference) == equal
