"""The memory check on a real GPU under compute-sanitizer: our Triton backend is clean; each
planted defect fails memory, in the pass and the place it exists to show (numerics' NaN-poison
pass sees only those whose stray access lands on an unowned slot)."""

import pytest
import torch

from backends.triton.backend import TritonAttentionBackend
from conformance.cases.grammar import parse_case
from conformance.checks.memory import MemoryCheck, sanitizer
from conformance.checks.numerics import NumericsCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import memory as planted

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(sanitizer.find_tool() is None, reason="needs compute-sanitizer")]
CUDA = torch.device("cuda")
DECODE = parse_case("gqa-h8/2-d128-bf16-p16:1+1,15+1,16+1,40+1")  # the widest request last
VERIFY = parse_case("gqa-h8/2-d128-bf16-p16:30+4,17+4,0+20")


@pytest.fixture
def step_stage_only(monkeypatch):
    """A planted defect is in the step's kernels: the step stage shows it, at a third of the cost."""
    monkeypatch.setattr(MemoryCheck, "stages", staticmethod(lambda backend_cls, case, device: ["step"]))


def findings(backend_cls, case):
    result = judge(MemoryCheck(), backend_cls, case, CUDA)
    assert result.verdict == Verdict.FAIL, result.reason
    return {(finding["tool"], finding["place"].split(" (")[0]): finding for finding in result.evidence["findings"]}


def test_triton_is_clean_in_the_step_the_draft_loop_and_the_engine():
    result = judge(MemoryCheck(), TritonAttentionBackend, DECODE, CUDA)
    assert result.verdict == Verdict.PASS, result.reason
    assert result.metrics["memcheck draft-loop errors"] == 0 and result.metrics["initcheck step errors"] == 0
    assert result.metrics["memcheck engine errors"] == 0
    assert judge(MemoryCheck(), TritonAttentionBackend, VERIFY, CUDA).verdict == Verdict.PASS


def test_numerics_nan_pass_sees_a_masked_read_of_block_0():
    """Request 0's table entry past its last block is 0: the reserved block, NaN in numerics'
    second pass. Its loud pass alone passes the defect (0 × 16 = 0)."""
    result = judge(NumericsCheck(), planted.ReadsBlockPastEnd, DECODE, CUDA)
    assert result.verdict == Verdict.FAIL and "with NaN in every slot no request owns" in result.reason, result.reason
    assert result.metrics["mismatched"] == 0


def test_a_read_one_block_past_the_end_is_seen_three_ways(step_stage_only):
    found = findings(planted.ReadsBlockPastEnd, DECODE)
    assert found[("memcheck", "just past the end of block_table")]["phase"] == "forward"
    # Which of block 0's slots the tool prints first can depend on the order the threads ran in.
    in_block_0 = [
        finding
        for (tool, place), finding in found.items()
        if tool == "initcheck" and place.startswith("KV pool block 0 slot ")
    ]
    assert in_block_0 and in_block_0[0]["launch"][-1].startswith("forward in memory.py"), list(found)
    assert any(tool == "nan-poison" for tool, _ in found)


def test_a_read_of_the_next_table_row_is_seen(step_stage_only):
    found = findings(planted.ReadsNextTableRow, DECODE)  # the last request's "next row" lies past the table
    assert any(tool == "memcheck" and place.endswith("past the end of block_table") for tool, place in found), found


def test_a_write_kv_grid_one_row_too_large_is_seen(step_stage_only):
    found = findings(planted.WritesRowPastSlotMapping, DECODE)
    assert found[("memcheck", "just past the end of history slot_mapping")]["phase"] == "history write_kv"


@pytest.mark.parametrize("defect", [planted.ReadsWholeLastBlock, planted.WritesNextSlot])
def test_cpu_defects_fail_on_the_gpu_too(defect, step_stage_only):
    assert any(tool == "nan-poison" for tool, _ in findings(defect, VERIFY))


def test_a_backend_beside_its_companion_runs_the_engine_stage(monkeypatch):
    """triton_mla verifies at most 8 tokens: the engine's prefill chunks go to its companion."""
    from backends.triton.mla_backend import TritonMLABackend

    monkeypatch.setattr(MemoryCheck, "stages", staticmethod(lambda backend_cls, case, device: ["engine"]))
    result = judge(MemoryCheck(), TritonMLABackend, parse_case("mla-h16-d512+64-bf16-p64:1+1,700+1"), CUDA)
    assert result.verdict == Verdict.PASS, result.reason
    assert result.metrics["memcheck engine errors"] == 0
