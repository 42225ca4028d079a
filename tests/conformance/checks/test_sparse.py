"""DeepSeek's sparse attention (DSA) in the contract: the case grammar, the indexer-like index rows,
the oracle's key sets, torch_naive's and triton_mla's sparse reads, the planted sparse defects,
and the checks that say they do not drive it yet."""

import os
import subprocess
import sys

import pytest
import torch

from backends.base import AttentionSpec, DeviceInfo
from backends.features import SPARSE_TOPK, SPARSE_WINDOW
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.case_data import topk_indices
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.cases.oracle import layer_reference
from conformance.cases.suites import standard_suite
from conformance.checks.engine import EngineCheck
from conformance.checks.numerics import NumericsCheck
from conformance.checks.steady import SteadyCheck
from conformance.harness.batch import case_generator, materialize
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import sparse_defects

CPU = torch.device("cpu")
VERIFY = "mla-h4-d32+16-bf16-p16-topk16-win8-messyidx:200+3x2,9+4"  # verify, window part, messy rows
DECODE = "mla-h4-d32+16-bf16-p16-topk16:300+1x3,6+1"  # decode past and within top-k


def test_the_grammar_reads_and_writes_a_sparse_layer():
    case = parse_case("mla-h16-d512+64-topk2048-win128-messyidx:5000+1")
    assert (case.spec.sparse_topk, case.spec.sparse_window, case.messy_indices) == (2048, 128, True)
    assert parse_case(case.id) == case
    assert SPARSE_TOPK.asked(case.needs) and SPARSE_WINDOW.asked(case.needs)


@pytest.mark.parametrize(
    "text,words",
    [
        ("gqa-topk64:100+1", "is an MLA layer's"),
        ("mla-win64:100+1", "give topkN too"),
        ("mla-topk64-w64:100+1", "write win64"),
        ("mla-messyidx:100+1", "a sparse MLA layer's data"),
        ("mla-topk0:100+1", "at least 1"),
    ],
)
def test_a_sparse_attribute_out_of_place_is_a_syntax_error_that_says_why(text, words):
    with pytest.raises(CaseSyntaxError, match=words):
        parse_case(text)


def test_an_mha_spec_refuses_top_k():
    with pytest.raises(ValueError, match="MLA layer's"):
        AttentionSpec(kind="mha", num_heads=4, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16, sparse_topk=8)


def test_index_rows_are_an_indexers_top_k_over_each_tokens_own_positions():
    case = parse_case("mla-h4-d32+16-topk8-win4:20+3,0+5,1+1")
    rows = topk_indices(case, case_generator(case))
    assert rows.shape == (9, 8) and rows.dtype == torch.int32
    token = 0
    for context_len, query_len in case.batch:
        for i in range(query_len):
            position = context_len + i
            listed = [int(x) for x in rows[token] if x >= 0]
            assert len(listed) == len(set(listed)) == min(8, max(0, position - 4 + 1))
            assert all(x <= position - 4 for x in listed)  # older than the window part: disjoint from it
            token += 1
    assert torch.equal(rows, topk_indices(case, case_generator(case)))  # seeded by the case


def test_messy_rows_hold_entries_to_ignore_and_keep_one_to_attend():
    case = parse_case("mla-h4-d32+16-topk16-messyidx:200+3x2,9+4")
    rows = topk_indices(case, case_generator(case)).long()
    positions = torch.tensor([200, 201, 202] * 2 + [9, 10, 11, 12])
    past = rows > positions[:, None]
    assert past.any() and (rows >= 215).any()  # past the token, and past the sequence
    assert ((rows[:, :-1] == -1) & (rows[:, 1:] >= 0)).any()  # -1 between entries
    assert ((rows >= 0) & ~past).any(dim=1).all()  # every token keeps a key


def test_the_oracle_with_every_position_listed_is_dense_attention():
    dense = parse_case("mla-h4-d32+16-fp32-p16:30+3,5+1")
    sparse = parse_case("mla-h4-d32+16-fp32-p16-topk64:30+3,5+1")
    batch = materialize(dense, "cpu")
    every = torch.arange(64).expand(4, 64).clone()  # every position of each request, and more: ignored past each token
    for request, (context_len, query_len) in enumerate(dense.batch):
        rows = every[:query_len]
        args = (batch.query[batch.query_start_loc[request] : batch.query_start_loc[request + 1]],)
        args += (batch.keys[request], None)
        expected = layer_reference(dense.spec, *args, context_len=context_len)
        got = layer_reference(sparse.spec, *args, context_len=context_len, topk_indices=rows)
        assert torch.allclose(expected, got, atol=1e-12)


def test_the_oracles_window_part_alone_is_a_sliding_window():
    window = parse_case("mla-h4-d32+16-fp32-p16-w8:40+3")
    sparse = parse_case("mla-h4-d32+16-fp32-p16-topk4-win8:40+3")
    batch = materialize(window, "cpu")
    args = (batch.query, batch.keys[0], None)
    expected = layer_reference(window.spec, *args, context_len=40)
    none_listed = torch.full((3, 4), -1)
    assert torch.allclose(expected, layer_reference(sparse.spec, *args, context_len=40, topk_indices=none_listed))


def test_a_sparse_oracle_without_index_rows_refuses():
    case = parse_case("mla-h4-d32+16-fp32-topk4:10+1")
    batch = materialize(case, "cpu")
    with pytest.raises(ValueError, match="index rows"):
        layer_reference(case.spec, batch.query, batch.keys[0], None, context_len=10)


@pytest.mark.parametrize(
    "case_text",
    [
        VERIFY,
        DECODE,
        "mla-h4-d32+16-bf16-p16-topk16-win8-lse:0+30,40+4,0+0,7+1",  # prefill, the LSE, an empty request
        "mla-h4-d32+16-bf16-fp8e4m3-p16-topk16-edges:60+1,20+4",  # an fp8 cache, dominant edge keys
    ],
)
def test_torch_naive_serves_sparse_layers_on_every_path(case_text):
    result = judge(NumericsCheck(), TorchNaiveBackend, parse_case(case_text), CPU)
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.parametrize(
    "defect,case_text",
    [
        (sparse_defects.IgnoresTheIndices, DECODE),
        (sparse_defects.MinusOneIsSlotMinusOne, DECODE),
        (sparse_defects.AttendsPastItsPosition, "mla-h4-d32+16-bf16-p16-topk16-messyidx-edges:200+3x2,9+4"),
        (sparse_defects.WindowOfTheRequestsLastToken, VERIFY),
        (sparse_defects.DropsTheWindowPart, VERIFY),
    ],
)
def test_planted_sparse_defects_fail_numerics_by_a_wide_margin(defect, case_text):
    result = judge(NumericsCheck(), defect, parse_case(case_text), CPU)
    assert result.verdict == Verdict.FAIL and result.metrics["tolerance_ratio"] > 5, result.metrics


def test_the_planted_defects_base_gathers_correctly():
    for case_text in (VERIFY, DECODE):
        result = judge(NumericsCheck(), sparse_defects.GathersItsKeys, parse_case(case_text), CPU)
        assert result.verdict == Verdict.PASS, result.reason


def test_a_backend_without_the_claim_skips_a_sparse_case_saying_so():
    from backends.flashmla import FlashMLABackend

    case = parse_case("mla-h16-d512+64-p64-topk2048:4000+1")
    reason = FlashMLABackend.capabilities.feature_reason(case.needs, DeviceInfo("cuda", "H200", (9, 0)))
    assert reason.startswith("sparse attention over 2048 indexed positions a token (DeepSeek's DSA) not supported")


def test_the_steady_look_hands_each_admitted_token_its_row():
    """Continuous batching over a sparse layer with a window part (the steady look's schedule,
    driven on the CPU): torch_naive right at every step; a window placed per request fails at the
    first step with a verify row."""
    from conformance.checks.steady import steady_look

    case = parse_case("mla-h4-d32+16-bf16-p16-topk16-win8:60+1,20+1,9+1")
    assert steady_look(TorchNaiveBackend, case, CPU, steps=40, strategy="torch").verdict == Verdict.PASS
    result = steady_look(sparse_defects.WindowOfTheRequestsLastToken, case, CPU, steps=40, strategy="torch")
    assert result.verdict == Verdict.FAIL and "differs from the oracle" in result.reason, result.reason


@pytest.mark.parametrize(
    "backend,passes",
    [
        (TorchNaiveBackend, True),
        (sparse_defects.WindowOfTheRequestsLastToken, False),
        (sparse_defects.DropsTheWindowPart, False),
        (sparse_defects.IgnoresTheIndices, False),
    ],
)
def test_the_engine_runs_a_sparse_model_through_the_backend(backend, passes):
    """The engine check's model for a sparse layer is sparse (its rows from each layer's lightning
    indexer): a backend that gets the rows or the window part wrong decodes other tokens than
    torch_naive does."""
    case = parse_case("mla-h4-d32+16-bf16-p16-topk16-win8:40+1x2")
    assert EngineCheck().case_skip_reason(backend, case, CPU) is None
    result = judge(EngineCheck(), backend, case, CPU)
    assert (result.verdict == Verdict.PASS) == passes, result.reason


def test_the_standard_suite_has_deepseeks_sparse_layers():
    sparse = [case for case in standard_suite() if case.spec.sparse_topk]
    assert {case.spec.num_heads for case in sparse} >= {16, 128}
    assert any(case.spec.sparse_window for case in sparse) and any(case.messy_indices for case in sparse)
    assert any(case.spec.fp8_kv_cache for case in sparse) and any(case.lse for case in sparse)


POSITIONS_SCRIPT = """
import torch
from backends.base import BackendLimits, CommonAttentionMetadata
from conformance.cases.grammar import parse_case
from {module} import {backend} as Backend

spec = parse_case("mla-h4-d32+16-bf16-p16-topk16-win8:1+1").spec
backend = Backend(spec, BackendLimits(4, 16, 256), torch.device("cpu"))
table = torch.arange(12, dtype=torch.int32).view(3, 4)

def common(seq_lens):
    return CommonAttentionMetadata.from_lengths(
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.zeros(3, dtype=torch.int64),
        query_starts=[0, 1, 2, 3],
        host_seq_lens=seq_lens,
        lengths_known=False,
    )

metadata = backend.build(common([5, 40, 17]))
print(metadata.token_position[:3].tolist())
metadata = backend.update_for_draft_step(metadata, common([6, 41, 18]))
print(metadata.token_position[:3].tolist())
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "module,backend,advanced",
    [
        ("backends.triton.mla_backend", "TritonMLABackend", True),
        ("tests.planted.sparse_defects", "StalePositionsInDraftSteps", False),
    ],
)
def test_triton_mla_advances_its_token_positions_in_a_draft_step(module, backend, advanced):
    """Each token's position is metadata ``build`` makes on the device; ``update_for_draft_step``
    remakes it from the advanced lengths (the planted defect keeps the first step's: vLLM #41162)."""
    completed = subprocess.run(
        [sys.executable, "-c", POSITIONS_SCRIPT.format(module=module, backend=backend)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert completed.returncode == 0, completed.stderr
    first, second = completed.stdout.split("\n")[:2]
    assert first == "[4, 39, 16]"
    assert second == ("[5, 40, 17]" if advanced else "[4, 39, 16]")


@pytest.mark.gpu
def test_the_steady_look_runs_a_sparse_layer_on_a_gpu():
    """Continuous batching over a sparse layer with a window part: each admitted token is handed
    its own index row, every step judged."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from backends.triton.mla_backend import TritonMLABackend

    case = parse_case("mla-h16-d512+64-bf16-p64-topk64-win32:300+1,100+1,40+1")
    result = judge(SteadyCheck(), TritonMLABackend, case, torch.device("cuda"))
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.gpu
def test_the_draft_loop_catches_stale_sparse_positions_on_a_gpu():
    """vLLM #41162's class on its own layer: a sparse layer with a window part whose positions are
    not advanced between draft steps fails the draft loop at a later step; triton_mla passes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from backends.triton.mla_backend import TritonMLABackend
    from conformance.checks.draft_loop import DraftLoopCheck

    case = parse_case("mla-h16-d512+64-bf16-p64-topk64-win128:1000+1,190+1,60+1")
    cuda = torch.device("cuda")
    assert judge(DraftLoopCheck(), TritonMLABackend, case, cuda).verdict == Verdict.PASS
    result = judge(DraftLoopCheck(), sparse_defects.StalePositionsInDraftSteps, case, cuda)
    assert result.verdict == Verdict.FAIL and "step" in result.reason, result.reason


@pytest.mark.parametrize(
    "backend,clean",
    [(TorchNaiveBackend, True), (sparse_defects.MinusOneIsSlotMinusOne, False)],
)
def test_the_memory_checks_nan_poison_pass_sees_an_index_read_outside_the_requests_slots(backend, clean):
    """The memory check's NaN-poison pass over a sparse layer (rows with -1 entries: a top-k
    wider than the context): a -1 read as slot -1 takes the pool's last slot, NaN there, and the
    output turns NaN; the reference reads only its requests' slots."""
    from conformance.harness.nan_poison import nan_poison_pass
    from conformance.harness.step import prepare_case

    case = parse_case("mla-h4-d32+16-bf16-p16-topk64:40+1,20+4")
    findings, _ = nan_poison_pass(prepare_case(backend, case, CPU))
    assert (not findings) == clean, findings
