"""The memory check without a GPU: compute-sanitizer's output (real, recorded on an H100) read back
as findings placed in the harness's tensors, the NaN-poison pass on planted CPU defects, the
subset and the SKIP paths."""

from pathlib import Path

import pytest
import torch

from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import parse_case
from conformance.cases.suites import standard_suite
from conformance.checks import memory
from conformance.checks.memory import MemoryCheck, poison_pass, sanitizer
from conformance.checks.numerics import NumericsCheck
from conformance.harness.allocation_map import Allocation, AllocationMap, PoolLayout
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted.memory import ReadsWholeLastBlock, WritesNextSlot

OUTPUT = Path(__file__).parent / "sanitizer_output"
CPU = torch.device("cpu")
CASE = parse_case("gqa-h4/2-d64-bf16-p16:1+1,15+1,16+1,40+4,0+20")
MLA = parse_case("mla-h4-d64+16-bf16-p16:1+1,40+1,17+4")
# Where the recorded memcheck run's block table was (its map was not kept).
BLOCK_TABLE = Allocation("block_table", 0x7F620A887E00, 48)


def test_memcheck_output_becomes_one_finding_placed_past_the_block_table():
    reports, errors, unsupported = sanitizer.parse((OUTPUT / "memcheck-block-table-overread.txt").read_text())
    assert errors == 130 and unsupported is None
    real = [report for report in reports if not report.is_api_error]
    assert len(real) == 2 and len(reports) == 3  # the failed cudaDeviceSynchronize is a consequence
    first = real[0]
    assert first.what == "Invalid __global__ read of size 4 bytes" and first.phase == "forward"
    assert first.kernel == "masked_extra_read_kernel in memory.py:64"
    assert first.address == 0x7F620A887E30 and first.nearest == BLOCK_TABLE.start
    assert first.frames[-1] == "forward in memory.py:93"  # the backend call, not Triton's launcher
    [finding] = sanitizer.findings(reports, AllocationMap([BLOCK_TABLE]), "memcheck", "step")
    assert finding["place"] == "just past the end of block_table (48 bytes)" and finding["count"] == 2
    assert finding["launch"][-1] == "forward in memory.py:93"


def test_initcheck_output_is_placed_in_the_reserved_block():
    reports, errors, _ = sanitizer.parse((OUTPUT / "initcheck-reserved-block.txt").read_text())
    assert errors == 257 and len(reports) == 2
    where = AllocationMap.load(OUTPUT / "initcheck-reserved-block.map.json")
    [finding] = sanitizer.findings(reports, where, "initcheck", "step")
    assert finding["what"] == "Uninitialized __global__ memory read of size 16 bytes"
    assert finding["place"] == "KV pool block 0 slot 0 (block 0, reserved: no request owns it)"
    assert finding["phase"] == "forward" and finding["count"] == 2


def test_a_write_during_the_history_is_named_by_its_phase():
    reports, _, _ = sanitizer.parse((OUTPUT / "memcheck-history-write.txt").read_text())
    assert reports[0].phase == "history write_kv" and reports[0].what == "Invalid __global__ read of size 8 bytes"
    assert reports[0].frames[-1] == "write_kv in memory.py:119"


def test_a_device_the_tool_refuses_is_reported_as_such():
    text = "========= COMPUTE-SANITIZER\n========= Error: Device not supported. Please refer to the documentation.\n"
    assert sanitizer.parse(text)[2] == "Error: Device not supported. Please refer to the documentation."


def test_pool_addresses_are_placed_by_block_slot_and_owner():
    pool = torch.zeros(6, 2, 16, 2, 8)  # [blocks, K/V, page, heads, dim], FlashInfer's NHD
    layout = PoolLayout(4096, list(pool.shape), list(pool.stride()), 2, 16, 6, {"3": [[1, 16, 20]]})

    def address(block, plane, slot):
        return 4096 + 2 * (block * pool.stride(0) + plane * pool.stride(1) + slot * pool.stride(2))

    assert layout.describe(address(3, 1, 2)) == "KV pool block 3 slot 2 (request 1's position 18, within its length 20)"
    assert (
        layout.describe(address(3, 0, 4)) == "KV pool block 3 slot 4 (past request 1's length: position 20, length 20)"
    )
    assert layout.describe(address(5, 0, 0)) == "KV pool block 5 slot 0 (a block no request owns)"
    ambiguous = PoolLayout(4096, [16, 16, 8], [128, 8, 1], 2, 16, 16)  # 16 blocks of 16 slots: which is which?
    assert ambiguous.describe(4096 + 100) == "KV pool, byte 100"


def test_allocation_map_round_trips_and_places_addresses_outside_the_pool(tmp_path):
    where = AllocationMap(
        [Allocation("seq_lens", 1000, 16)], PoolLayout(5000, [4, 16, 8], [128, 8, 1], 2, 16, 4, {"1": [[0, 0, 5]]})
    )
    where.allocations.append(Allocation("KV pool", 5000, 4 * 128 * 2))
    where.save(tmp_path / "map.json")
    loaded = AllocationMap.load(tmp_path / "map.json")
    assert loaded.describe(1004) == "seq_lens, byte 4 of 16"
    assert loaded.describe(1020, nearest=1000) == "4 bytes past the end of seq_lens (16 bytes)"
    assert loaded.describe(5000 + 2 * 128) == "KV pool block 1 slot 0 (request 0's position 0, within its length 5)"
    assert loaded.describe(99).startswith("an allocation the harness did not make")
    AllocationMap(unmapped="outside the engine's pools").save(tmp_path / "engine.json")  # the engine stage's map
    assert AllocationMap.load(tmp_path / "engine.json").describe(99) == "outside the engine's pools"


@pytest.mark.parametrize("case", [CASE, MLA], ids=["gqa", "mla"])
def test_nan_poison_pass_is_clean_on_a_correct_backend(case):
    findings, metrics = poison_pass(TorchNaiveBackend, case, CPU)
    assert findings == [] and metrics["nan-poison slots written"] == case.num_tokens


@pytest.mark.parametrize("case", [CASE, MLA], ids=["gqa", "mla"])
def test_a_masked_read_past_the_length_turns_nan_in_memory_and_in_numerics(case):
    [finding] = poison_pass(ReadsWholeLastBlock, case, CPU)[0]
    assert "NaN/Inf outputs with NaN in every slot no request owns" in finding["what"]
    result = judge(NumericsCheck(), ReadsWholeLastBlock, case, CPU)  # its loud pass alone passes this
    assert result.verdict == Verdict.FAIL and "with NaN in every slot no request owns" in result.reason
    assert result.metrics["mismatched"] == 0 and result.metrics["nan-poison non-finite outputs"] > 0


@pytest.mark.parametrize("case", [CASE, MLA], ids=["gqa", "mla"])
def test_a_write_past_the_slot_mapping_inside_the_pool_is_placed(case):
    [finding] = poison_pass(WritesNextSlot, case, CPU)[0]
    assert finding["what"] == f"the pool changed outside the step's {case.num_tokens} slots"
    assert "past request 0's length: position 2, length 2" in finding["place"]
    result = judge(NumericsCheck(), WritesNextSlot, case, CPU)
    assert result.verdict == Verdict.FAIL and "past request 0's length" in result.reason
    assert result.metrics["mismatched"] == 0  # every output right: only the pool shows the write


def test_skips_on_a_cpu_and_without_the_tool(monkeypatch):
    check = MemoryCheck()
    assert check.skip_reason(TorchNaiveBackend, CPU).startswith("needs a CUDA device")
    monkeypatch.setattr(sanitizer, "find_tool", lambda: None)
    assert check.skip_reason(TorchNaiveBackend, torch.device("cuda")).startswith("compute-sanitizer not found")


def test_the_subset_is_the_first_layout_of_each_kind_and_a_given_case_always_runs():
    check = MemoryCheck()
    plan = check.plan(TorchNaiveBackend, standard_suite(), CPU)
    running = [case for case in standard_suite() if plan[case.id] is None]
    dense = [case for case in running if case.spec.sparse_topk is None and not case.trees]
    assert sorted({case.spec.kind for case in dense}) == ["mha", "mla"]
    assert len({(case.spec.kind, case.spec.dtype, case.spec.block_size, case.strided) for case in dense}) == 2
    assert {case.tag for case in dense} <= set(memory.MEMORY_TAGS) and len(dense) >= 7
    # DeepSeek's sparse layers: decode, MTP verify, the messy rows (indices past the causal edge), fp8_ds_mla.
    sparse = {case.tag for case in running if case.spec.sparse_topk is not None}
    assert sparse == {
        "sparse: decode past top-k",
        "sparse: spec-verify k=3 (MTP)",
        "messy index rows: decode and verify",
        "sparse, fp8_ds_mla: decode and MTP verify",
    }
    assert {case.tag for case in running if case.trees} == {"tree: with decodes, a prefill and a chain"}
    assert MemoryCheck().case_skip_reason(TorchNaiveBackend, parse_case("gqa-h4/2-d64-fp16:70+3"), CPU) is None


def test_the_subset_holds_the_indexers_decode_and_verify_and_each_one_case_tag_names_one_case():
    from backends.torch_indexer import TorchIndexerBackend

    plan = MemoryCheck().plan(TorchIndexerBackend, standard_suite(), CPU)
    running = {case.tag for case in standard_suite() if plan[case.id] is None}
    assert running == {"indexer: decode past top-k", "indexer: MTP verify"}
    for tag in memory.ONE_CASE_TAGS:
        assert [case.tag for case in standard_suite()].count(tag) == 1, tag


@pytest.fixture(autouse=True)
def poison_pass_in_process(monkeypatch):
    """The check runs the pass in a CUDA child; here it runs in this process, on the CPU."""
    monkeypatch.setattr(memory, "run_poison_pass", lambda backend_cls, case: poison_pass(backend_cls, case, CPU))


def fake_run(output: str, where: AllocationMap, returncode: int = 1):
    """``run_child`` as if compute-sanitizer had printed ``output``."""

    def run_child(backend_cls, case, stage, tool):
        reports, errors, unsupported = sanitizer.parse(output)
        return sanitizer.SanitizerRun(tool, returncode, reports, errors, unsupported, output[-300:]), where

    return run_child


def test_a_sanitizer_report_fails_the_case_with_evidence_every_report_shows(monkeypatch):
    output = (OUTPUT / "memcheck-block-table-overread.txt").read_text()
    monkeypatch.setattr(memory, "run_child", fake_run(output, AllocationMap([BLOCK_TABLE])))
    result = judge(MemoryCheck(), TorchNaiveBackend, CASE, CPU)
    assert result.verdict == Verdict.FAIL
    assert result.reason.startswith(
        "memcheck, step, forward: Invalid __global__ read of size 4 bytes in masked_extra_read_kernel"
    )
    assert "just past the end of block_table (48 bytes)" in result.reason
    labels = [item.label for item in MemoryCheck.describe_evidence(result.evidence)]
    assert (
        labels[0] == "memcheck (step, forward): Invalid __global__ read of size 4 bytes ×2"
        and "launched from" in labels
    )


def test_counted_errors_that_cannot_be_read_still_fail(monkeypatch):
    unread = "=========     a detail line of a record this parser does not know\n========= ERROR SUMMARY: 3 errors\n"
    monkeypatch.setattr(memory, "run_child", fake_run(unread, AllocationMap()))
    result = judge(MemoryCheck(), TorchNaiveBackend, CASE, CPU)
    assert result.verdict == Verdict.FAIL and "3 errors" in result.reason


def test_a_clean_run_passes_and_a_refusing_device_skips(monkeypatch):
    monkeypatch.setattr(memory, "run_child", fake_run("========= ERROR SUMMARY: 0 errors\n", AllocationMap(), 0))
    result = judge(MemoryCheck(), TorchNaiveBackend, CASE, CPU)
    assert result.verdict == Verdict.PASS and result.metrics["memcheck step errors"] == 0
    monkeypatch.setattr(memory, "run_child", fake_run("========= Error: Device not supported\n", AllocationMap()))
    result = judge(MemoryCheck(), TorchNaiveBackend, CASE, CPU)
    assert result.verdict == Verdict.SKIP and "cannot check this device: Error: Device not supported" in result.reason
    result = judge(MemoryCheck(), WritesNextSlot, CASE, CPU)  # the poison pass still counts
    assert result.verdict == Verdict.FAIL and result.reason.startswith("nan-poison, step, write_kv")


def test_a_child_that_dies_without_a_report_is_an_error(monkeypatch):
    monkeypatch.setattr(memory, "run_child", fake_run("ImportError: no module\n", AllocationMap()))
    with pytest.raises(RuntimeError, match="exited with status 1 and no report"):
        judge(MemoryCheck(), TorchNaiveBackend, CASE, CPU)


def test_host_api_reports_count_only_when_the_backend_copies_the_harness_s_memory():
    record = (
        "========= Host API memory access error at host access to 0x7f0000000000 of size 65,536 bytes\n"
        "=========     Uninitialized access at 0x7f0000000040 on access by cudaMemcpyAsync source\n"
        "=========     Saved host backtrace up to driver entry point at kernel launch time\n"
        "=========         Host Frame: {frame}\n========= \n"
    )
    harness = sanitizer.parse(record.format(frame="replay in graphs.py:139"))[0]
    backend = sanitizer.parse(record.format(frame="forward in flashmla.py:71"))[0]
    pool = AllocationMap([Allocation("KV pool", 0x7F0000000000, 1 << 20)])
    assert sanitizer.findings(harness, pool, "initcheck", "draft-loop", "flashmla.py") == []
    [finding] = sanitizer.findings(backend, pool, "initcheck", "step", "flashmla.py")
    assert finding["launch"] == ["forward in flashmla.py:71"] and finding["place"].startswith("KV pool, byte 64")
    # A copy out of the backend's own memory (a vendor kernel's output initcheck did not see written).
    assert sanitizer.findings(backend, AllocationMap(), "initcheck", "step", "flashmla.py") == []
    # memcheck: the backend's copy past an allocation's end counts, whoever's memory it began in.
    [out_of_bounds] = sanitizer.findings(backend, AllocationMap(), "memcheck", "step", "flashmla.py")
    assert out_of_bounds["tool"] == "memcheck" and out_of_bounds["launch"] == ["forward in flashmla.py:71"]
    assert sanitizer.findings(harness, AllocationMap(), "memcheck", "step", "flashmla.py") == []


def test_the_decode_case_adds_the_engine_stage_under_memcheck_only(monkeypatch):
    ran = []

    def run_child(backend_cls, case, stage, tool):
        ran.append((stage, tool))
        return sanitizer.SanitizerRun(tool, 0, [], 0, None, ""), AllocationMap()

    monkeypatch.setattr(memory, "run_child", run_child)
    decode = parse_case("gqa-h4/2-d64-bf16-p16:1+1,40+1")
    result = judge(MemoryCheck(), TorchNaiveBackend, decode, CPU)
    assert result.verdict == Verdict.PASS, result.reason
    assert sorted(ran) == [("engine", "memcheck"), ("step", "initcheck"), ("step", "memcheck")]  # no graphs on a CPU
    ran.clear()
    judge(MemoryCheck(), TorchNaiveBackend, CASE, CPU)  # verify rows: the step only
    assert [stage for stage, _ in ran] == ["step", "step"]


def test_the_engine_stage_drafts_through_the_backend_and_generates():
    from conformance.checks.memory.sanitized_case import ENGINE_TOKENS, memory_engine
    from reference_engine.sampling import SamplingParams

    engine, prompts = memory_engine(TorchNaiveBackend, parse_case("gqa-h4/2-d64-fp32-p16:1+1,40+1"), CPU)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=ENGINE_TOKENS, ignore_eos=True))
    assert [len(out.tokens) for out in outputs] == [ENGINE_TOKENS] * len(prompts)
    assert sum(out.drafted for out in outputs) > 0


def test_the_engine_stage_names_every_pool_a_sparse_models_layers_have():
    """A sparse model's layer has its attention's pool and its indexer's (the map names both, so a
    report inside either is placed)."""
    from backends.torch_indexer import TorchIndexerBackend
    from conformance.checks.memory.sanitized_case import engine_pools, memory_engine

    engine, _ = memory_engine(TorchIndexerBackend, parse_case("indexer-h4-d32-bf16-fp8e4m3-p16-topk8:40+1"), CPU)
    names = [name for name, _ in engine_pools(engine)]
    layers = len(engine.kv_caches)
    assert layers and all(
        f"layer {i} KV pool" in names and f"layer {i} indexer's key pool" in names for i in range(layers)
    )


def test_an_uninitialized_copy_inside_a_graph_replay_is_the_harness_s_and_passes(monkeypatch):
    """Recorded on an H100 (triton's draft loop): a 64-byte memcpy node of the captured loop read
    never-written bytes; graph replay leaves no Python frame of the backend, so it is set aside
    and the case passes, where an error count without any report read back would fail it."""
    output = (OUTPUT / "initcheck-graph-replay-copy.txt").read_text()
    [report] = sanitizer.parse(output)[0]
    assert report.address == 0x7F697E600020 and report.frames[-1] == "replay in graphs.py:139"
    monkeypatch.setattr(memory, "run_child", fake_run(output, AllocationMap(), 0))
    result = judge(MemoryCheck(), TorchNaiveBackend, CASE, CPU)
    assert result.verdict == Verdict.PASS, result.reason


def test_errors_past_the_print_limit_behind_set_aside_reports_still_fail(monkeypatch):
    output = (
        (OUTPUT / "initcheck-graph-replay-copy.txt")
        .read_text()
        .replace("ERROR SUMMARY: 1 error", "ERROR SUMMARY: 2045 errors")
    )
    monkeypatch.setattr(memory, "run_child", fake_run(output, AllocationMap(), 0))
    result = judge(MemoryCheck(), TorchNaiveBackend, CASE, CPU)
    assert result.verdict == Verdict.FAIL and "2044 errors not read back" in result.reason
    assert result.metrics["memcheck step set aside"] == 1


def test_the_draft_loop_leaves_api_copies_unchecked_where_the_tool_allows(monkeypatch):
    monkeypatch.setattr(sanitizer, "has_option", lambda tool_path, option: option == sanitizer.API_COPIES_OPTION)
    command = sanitizer.command("cs", "initcheck", ["b", "c", "draft-loop", "o"], api_copies=False)
    assert command[command.index("--check-api-memory-access") + 1] == "no"
    assert "--check-api-memory-access" not in sanitizer.command("cs", "initcheck", ["b", "c", "step", "o"])
    monkeypatch.setattr(sanitizer, "has_option", lambda tool_path, option: False)  # an older tool: all checked
    assert "--check-api-memory-access" not in sanitizer.command("cs", "initcheck", ["b"], api_copies=False)


def test_each_stage_runs_with_the_allocator_and_copy_checks_its_execution_allows(monkeypatch):
    """Eager stages: caching allocator off (each tensor its own allocation), copies checked. The
    draft loop replays graphs: allocator on (capture needs it), copies unchecked."""
    seen = {}

    def run(tool_path, tool, child_args, env, timeout_s, api_copies=True):
        seen[(child_args[2], tool)] = (env.get("PYTORCH_NO_CUDA_MEMORY_CACHING"), api_copies)
        return sanitizer.SanitizerRun(tool, 0, [], 0)

    monkeypatch.setattr(sanitizer, "run", run)
    for stage, tool in (
        ("step", "initcheck"),
        ("engine", "memcheck"),
        ("draft-loop", "initcheck"),
        ("nan-poison", None),
    ):
        memory.run_child(TorchNaiveBackend, CASE, stage, tool)
    assert seen == {
        ("step", "initcheck"): ("1", True),
        ("engine", "memcheck"): ("1", True),
        ("draft-loop", "initcheck"): (None, False),
        ("nan-poison", "nan-poison"): (None, True),
    }


def test_a_report_in_the_engine_stage_fails_the_case_under_its_stage(monkeypatch):
    """The engine stage's findings reach the verdict like the step's (plumbing: on the CPU the
    engine stage's child is not run under the tool; no planted defect has been run through it on
    a GPU yet)."""
    output = (OUTPUT / "memcheck-block-table-overread.txt").read_text()
    clean = "========= ERROR SUMMARY: 0 errors\n"

    def run_child(backend_cls, case, stage, tool):
        text = output if stage == "engine" else clean
        reports, errors, unsupported = sanitizer.parse(text)
        return sanitizer.SanitizerRun(tool, 0, reports, errors, unsupported, text[-300:]), AllocationMap(
            unmapped="outside"
        )

    monkeypatch.setattr(memory, "run_child", run_child)
    result = judge(MemoryCheck(), TorchNaiveBackend, parse_case("gqa-h4/2-d64-bf16-p16:1+1,40+1"), CPU)
    assert result.verdict == Verdict.FAIL and result.reason.startswith(
        "memcheck, engine, forward: Invalid __global__ read"
    )


def test_set_aside_reports_are_counted_by_kind_and_do_not_fail(monkeypatch):
    api_error = (
        '========= Program hit CUDA_ERROR_NOT_FOUND (error 500) due to "named symbol not found" on CUDA API call '
        "to cuGetProcAddress.\n=========     Saved host backtrace up to driver entry point at error\n"
        "=========         Host Frame: forward in torch_naive.py:40\n========= \n"
    )
    monkeypatch.setattr(
        memory, "run_child", fake_run(api_error * 3 + "========= ERROR SUMMARY: 3 errors\n", AllocationMap(), 0)
    )
    result = judge(MemoryCheck(), TorchNaiveBackend, CASE, CPU)
    assert result.verdict == Verdict.PASS, result.reason
    assert result.metrics["memcheck step set aside"] == 3
    [(kind, count)] = result.metrics["memcheck step set aside kinds"].items()
    assert count == 3 and kind.startswith("Program hit CUDA_ERROR_NOT_FOUND (error N)")


def test_a_failing_api_call_counts_unless_it_follows_a_fault_or_probes_an_entry_point(monkeypatch):
    """A library that ignores its own failed CUDA call fails the case; the same report after a
    kernel fault is that fault's consequence, and a cuGetProcAddress miss is a probe."""
    failed_copy = (
        '========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to '
        "cudaMemcpyAsync.\n=========     Saved host backtrace up to driver entry point at error\n"
        "=========         Host Frame: forward in torch_naive.py:40\n========= \n"
    )
    monkeypatch.setattr(
        memory, "run_child", fake_run(failed_copy + "========= ERROR SUMMARY: 1 error\n", AllocationMap(), 0)
    )
    result = judge(MemoryCheck(), TorchNaiveBackend, CASE, CPU)
    assert result.verdict == Verdict.FAIL and "cudaMemcpyAsync" in result.reason, result.reason

    reports, _, _ = sanitizer.parse((OUTPUT / "memcheck-block-table-overread.txt").read_text())
    consequence = reports[-1]
    assert consequence.is_api_error and "cudaDeviceSynchronize" in consequence.what
    kept, set_aside = sanitizer.partition(reports, AllocationMap([BLOCK_TABLE]), "memcheck")
    assert set_aside == [consequence] and len(kept) == 2
    kept, set_aside = sanitizer.partition([consequence], AllocationMap([BLOCK_TABLE]), "memcheck")
    assert kept == [consequence]  # with no fault before it, the same failed call is a finding
