"""Adapter logic of the vendor backends that runs without their packages or GPUs: claims and
availability, cache layouts and writes, CSR page layouts, and the exact kernel arguments."""

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from backends.base import BackendLimits, DeviceInfo
from backends.flashinfer.gqa import FlashInferBackend, window_left
from backends.flashinfer.mla import FlashInferMLABackend, plan_arguments
from backends.flashinfer.paged_layout import host_page_counts, paged_layout
from backends.flashinfer.trtllm import TrtllmBackend
from backends.flashinfer.trtllm_mla import QK_NOPE_HEAD_DIM, TrtllmMLABackend, TrtllmMLAMetadata, kernel_arguments
from backends.flashmla import FlashMLABackend
from backends.fp8 import to_cache
from backends.paged_write import write_paged_rows
from conformance.cases.grammar import parse_case
from conformance.harness.batch import materialize

H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0))
B200 = DeviceInfo("cuda", "NVIDIA B200", (10, 0))


def test_trtllm_mla_is_unavailable_on_hopper_before_any_kernel_runs():
    # As on a GPU machine with flashinfer installed: only the compute capability decides.
    claims = dataclasses.replace(TrtllmMLABackend.capabilities, required_modules=())
    assert (
        claims.availability_reason(H200)
        == "needs compute capability SM100, SM103, SM120; this GPU (NVIDIA H200) is SM90"
    )
    assert claims.availability_reason(B200) is None


def test_missing_flashinfer_gives_the_install_command():
    import importlib.util

    if importlib.util.find_spec("flashinfer") is not None:
        return
    for backend in (FlashInferBackend, FlashInferMLABackend, TrtllmBackend):
        assert "pip install 'specdec-conformance[flashinfer]'" in backend.availability_reason(H200)
    # On a GPU it cannot run on, the GPU is the reason (the package would not help); on one it can, the package.
    assert TrtllmMLABackend.availability_reason(H200).startswith("needs compute capability SM100")
    assert "pip install 'specdec-conformance[flashinfer]'" in TrtllmMLABackend.availability_reason(B200)
    assert "pip install 'specdec-conformance[flashmla]'" in FlashMLABackend.availability_reason(H200)


def test_host_page_counts():
    pages, indptr, last = host_page_counts(torch.tensor([1, 16, 17, 40], dtype=torch.int32), 16)
    assert pages.tolist() == [1, 1, 2, 3] and indptr.tolist() == [0, 1, 2, 4, 7] and last.tolist() == [1, 16, 1, 8]


def test_paged_layout_gathers_page_ids_from_the_block_table_without_host_lengths_copy():
    batch = materialize(parse_case("gqa-h4/2-d16-p16:30+2,0+5,40+1"), "cpu")
    common = batch.common_metadata(with_host_lengths=True)
    layout = paged_layout(common, 16)
    assert common.device_to_host_copies == []
    expected = [int(batch.block_table[r, j]) for r, n in enumerate([2, 1, 3]) for j in range(n)]
    assert layout.kv_indices.tolist() == expected and layout.kv_indptr.tolist() == [0, 2, 3, 6]
    assert layout.last_page_len.tolist() == [16, 5, 9]
    without = batch.common_metadata(with_host_lengths=False)
    paged_layout(without, 16)
    assert without.device_to_host_copies == ["seq_lens"]  # what the syncs check sees on a GPU


def test_window_left_excludes_the_token_itself():
    assert window_left(parse_case("gqa-w256:1+1").spec) == 255 and window_left(parse_case("gqa:1+1").spec) == -1


def check_paged_writes(write, fp8: bool = True) -> None:
    """``write`` (write_paged_rows or its CUDA kernel) into NHD, HND and MLA layouts, slot -1 skipped;
    with ``fp8``, into an e4m3 plane too."""
    slots = torch.tensor([17, -1, 3, 40])
    rows = torch.randn(4, 2, 8)
    nhd = torch.zeros(4, 2, 16, 2, 8)  # [blocks, K/V, page, heads, dim]
    write(nhd[:, 0], rows, slots, 16)
    hnd = torch.zeros(4, 2, 2, 16, 8)  # [blocks, K/V, heads, page, dim]
    write(hnd[:, 0].transpose(1, 2), rows, slots, 16)
    for layout in (nhd[:, 0], hnd[:, 0].transpose(1, 2)):
        assert (
            torch.equal(layout[1, 1], rows[0])
            and torch.equal(layout[0, 3], rows[2])
            and torch.equal(layout[2, 8], rows[3])
        )
        changed = (layout != 0).flatten(2).any(-1).nonzero().tolist()
        assert changed == [[0, 3], [1, 1], [2, 8]]  # the slot -1 row landed nowhere
    assert nhd[:, 1].abs().sum() == 0 and hnd[:, 1].abs().sum() == 0  # V planes untouched
    mla = torch.zeros(4, 16, 24)  # [blocks, page, latent + rope]
    latent_rows = torch.randn(4, 24)
    write(mla, latent_rows, slots, 16)
    assert torch.equal(mla[1, 1], latent_rows[0]) and torch.equal(mla[2, 8], latent_rows[3])
    assert (mla != 0).any(-1).nonzero().tolist() == [[0, 3], [1, 1], [2, 8]]
    if not fp8:
        return
    # An fp8 plane: the rows stored as the contract's fp8 numbers of row / scale (magnitudes kept
    # clear of subnormals, which the CPU interpreter's conversion flushes), the scale a device tensor.
    scale = torch.tensor([0.05])
    rows = torch.randn(4, 2, 8).sign() * (torch.rand(4, 2, 8) * 20 + 0.01)
    rows[0, 0, 0] = -30.0
    fp8 = torch.zeros(4, 16, 2, 8, dtype=torch.float8_e4m3fn)
    write(fp8, rows, slots, 16, scale)
    assert torch.equal(fp8[1, 1].float(), to_cache(rows[0], 0.05, fp8.dtype).float())
    assert fp8[1, 1, 0, 0].float() == -448  # -30 / 0.05 saturates


def test_paged_writes_into_nhd_hnd_and_mla_layouts_skip_slot_minus_one():
    check_paged_writes(write_paged_rows)


@pytest.mark.slow
def test_paged_write_kernel_touches_no_memory_for_slot_minus_one():
    """The CUDA path (our Triton write kernel, run here by Triton's CPU interpreter) writes the same
    rows, and parks nothing on block 0: the pool's reserved block stays unread and unwritten. No
    fp8 plane here: the interpreter's fp32 -> e4m3 conversion is wrong where rounding carries into
    the next power of two (125.9 became 64, 31.4 became 16), and flushes subnormals; the kernel's
    fp8 stores are checked on a GPU (test_fp8_gpu.py)."""
    script = (
        "from tests.backends.test_vendor_adapters import check_paged_writes; "
        "from backends.paged_write import _write_with_kernel; check_paged_writes(_write_with_kernel, fp8=False)"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]


def test_trtllm_mla_kernel_arguments():
    spec = parse_case("mla-h16-d512+64-bf16-p64:100+2").spec
    limits = BackendLimits(4, 8, 4096)
    query = torch.zeros(8 + 3, 16, 576)
    cache = torch.zeros(10, 64, 576)
    out = torch.zeros(8 + 3, 16, 512)
    metadata = TrtllmMLAMetadata(torch.zeros(4, 64, dtype=torch.int32), torch.ones(4, dtype=torch.int32), 4, 2)
    arguments = kernel_arguments(spec, limits, query, cache, torch.zeros(1), metadata, out)
    assert arguments["query"].shape == (4, 2, 16, 576) and arguments["kv_cache"].shape == (10, 1, 64, 576)
    assert arguments["out"].shape == (4, 2, 16, 512) and arguments["out"].data_ptr() == out.data_ptr()
    assert (arguments["kv_lora_rank"], arguments["qk_rope_head_dim"], arguments["qk_nope_head_dim"]) == (
        512,
        64,
        QK_NOPE_HEAD_DIM,
    )
    assert arguments["max_seq_len"] == 4096  # the static bound, never the batch's host value
    assert arguments["bmm1_scale"] == spec.softmax_scale and arguments["bmm2_scale"] == 1.0


def test_flashinfer_mla_plan_arguments():
    class FakeMetadata:
        @staticmethod
        def csr(*tensors):
            return tensors

    batch = materialize(parse_case("mla-h16-d512+64-bf16-p64:100+2,10+2"), "cpu")
    arguments = plan_arguments(batch.spec, batch.common_metadata(), FakeMetadata)
    qo_indptr, kv_indptr, kv_indices, kv_lens = arguments["metadata"]
    assert qo_indptr.tolist() == [0, 2, 4] and kv_indptr.tolist() == [0, 2, 3] and kv_lens.tolist() == [102, 12]
    assert (arguments["head_dim_ckv"], arguments["head_dim_kpe"], arguments["page_size"]) == (512, 64, 64)
    assert arguments["causal"] and arguments["query_layout"] == arguments["kv_cache_layout"] == "packed"


def test_decodes_first_split_for_flashinfer():
    from backends.utils import DecodePrefillSplit, split_decodes_and_prefills, sub_batch

    def split(case: str, threshold: int = 1) -> DecodePrefillSplit:
        return split_decodes_and_prefills(
            materialize(parse_case(f"gqa-h4/2-d16-p16:{case}"), "cpu").common_metadata(), threshold
        )

    assert split("5+1x3,0+200,9+64") == DecodePrefillSplit(3, 2, 3, 264)
    assert split("0+200,5+1") == DecodePrefillSplit(0, 2, 0, 201) and split("5+1,6+1") == DecodePrefillSplit(2, 0, 2, 0)
    assert split("5+4x2,0+20", threshold=4) == DecodePrefillSplit(2, 1, 8, 20)  # spec-verify rows decode
    batch = materialize(parse_case("gqa-h4/2-d16-p16:3000+1x2,0+200,700+64"), "cpu")
    common = batch.common_metadata()
    decodes, rest = sub_batch(common, 0, 2), sub_batch(common, 2, 4)
    assert (
        decodes.query_start_loc_cpu.tolist() == [0, 1, 2]
        and decodes.max_query_len == 1
        and decodes.num_actual_tokens == 2
    )
    assert rest.query_start_loc_cpu.tolist() == [0, 200, 264] and rest.query_start_loc.tolist() == [0, 200, 264]
    assert rest.seq_lens_cpu.tolist() == [200, 764] and rest.block_table.shape[0] == 2 and rest.max_query_len == 200


def test_flashinfer_keeps_one_graph_decode_wrapper_per_captured_batch_size(monkeypatch):
    """FlashInfer fixes a graph wrapper's batch size: a capture at a size below max_num_reqs (as an
    engine's padded sizes 1, 2, 4, … are) must get a graph wrapper of its own, never the eager one."""
    import sys
    import types

    import backends.flashinfer as flashinfer_adapters

    class FakeWrapper:
        def __init__(
            self,
            workspace,
            layout,
            use_cuda_graph=False,
            use_tensor_cores=False,
            backend=None,
            paged_kv_indptr_buffer=None,
            paged_kv_indices_buffer=None,
            paged_kv_last_page_len_buffer=None,
        ):
            self.workspace, self.graph, self.indptr = workspace, use_cuda_graph, paged_kv_indptr_buffer
            self._pin_memory_int_workspace_buffer = torch.zeros(8, dtype=torch.uint8)  # what plan_staging swaps

        def plan(self, indptr, *args, **kwargs):
            if self.graph:  # FlashInfer: "the batch size should be fixed in cudagraph mode"
                assert len(indptr) == len(self.indptr), (len(indptr), len(self.indptr))

    fake = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=FakeWrapper, BatchPrefillWithPagedKVCacheWrapper=FakeWrapper
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_adapters, "WORKSPACE_BYTES", 64)
    case = parse_case("gqa-h4/2-d128-bf16-p16:30+1,50+1")
    backend = FlashInferBackend(case.spec, BackendLimits(8, 64, 256), torch.device("cpu"))
    common = materialize(case, "cpu").common_metadata()
    captured = backend.build_for_capture(common)
    wrapper = captured.calls[0].wrapper
    assert wrapper.graph and len(wrapper.indptr) == 3 and wrapper.workspace is backend.graph_workspace
    assert backend.build(common).calls[0].wrapper is wrapper  # the replay re-plans the captured wrapper
    three = materialize(parse_case("gqa-h4/2-d128-bf16-p16:30+1,50+1,9+1"), "cpu").common_metadata()
    assert backend.build(three).calls[0].wrapper is backend.decode  # never captured: eager
    assert sorted(backend.graph_decode) == [2, 8]


def test_flash_attn_kernel_arguments_and_availability():
    from backends import flash_attn
    from backends.base import AttentionSpec
    from backends.flash_attn import FlashAttnBackend, FlashAttnMetadata

    claims = dataclasses.replace(FlashAttnBackend.capabilities, required_modules=())
    assert claims.availability_reason(H200) is None
    assert claims.availability_reason(B200) == "needs compute capability SM90; this GPU (NVIDIA B200) is SM100"
    if importlib.util.find_spec("flash_attn") is None:  # the machine first: on a CPU that is the reason
        assert FlashAttnBackend.availability_reason("cpu") == "runs on cuda, not cpu"
        assert FlashAttnBackend.availability_reason(H200).startswith(
            "missing Python package flash_attn.cute: pip install"
        )
    spec = AttentionSpec(
        "mha",
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        block_size=16,
        sliding_window=256,
        logits_soft_cap=30.0,
    )
    cache = torch.zeros(2, 10, 16, 2, 64)
    query = torch.zeros(12, 8, 64)
    metadata = FlashAttnMetadata(
        torch.tensor([0, 1, 5]), torch.tensor([40, 20]), torch.zeros(2, 3, dtype=torch.int32), 4, 5
    )
    out = torch.zeros(12, 8, 64)
    arguments = flash_attn.kernel_arguments(spec, query, cache, metadata, out)
    assert arguments["q"].shape == (5, 8, 64) and arguments["k"].shape == arguments["v"].shape == (10, 16, 2, 64)
    assert arguments["k"].data_ptr() == cache[0].data_ptr() and arguments["v"].data_ptr() == cache[1].data_ptr()
    assert (arguments["window_size_left"], arguments["window_size_right"]) == (255, 0)
    assert arguments["softcap"] == 30.0 and arguments["causal"] is True
    assert arguments["seqused_k"] is metadata.seq_lens and arguments["page_table"] is metadata.block_table
    assert arguments["max_seqlen_q"] == 4 and arguments["softmax_scale"] == spec.softmax_scale
    # The kernel writes the caller's rows (no copy) where they are contiguous; a strided view is not
    # handed over (the adapter copies the kernel's own output into it).
    assert arguments["out"].shape == (5, 8, 64) and arguments["out"].data_ptr() == out.data_ptr()
    strided = torch.zeros(12, 8 * 64 + 64)[:, : 8 * 64].view(12, 8, 64)
    assert flash_attn.kernel_arguments(spec, query, cache, metadata, strided)["out"] is None
    plain = flash_attn.kernel_arguments(
        dataclasses.replace(spec, sliding_window=None, logits_soft_cap=None), query, cache, metadata, out
    )
    assert (plain["window_size_left"], plain["window_size_right"]) == (None, None) and plain["softcap"] == 0.0


def test_flash_attn_forward_has_the_kernel_write_the_callers_rows():
    """A contiguous output is handed to the kernel (no copy after it); a strided one gets the
    kernel's own buffer copied in, and the rows past the step's tokens are never touched."""
    from backends.base import AttentionSpec
    from backends.flash_attn import FlashAttnBackend, FlashAttnMetadata

    calls = []

    def kernel(**arguments):
        calls.append(arguments["out"])
        result = torch.full(arguments["q"].shape, 3.0) if arguments["out"] is None else arguments["out"].fill_(2.0)
        return result, None

    backend = object.__new__(FlashAttnBackend)  # no flash-attn-4 here: only forward's own logic runs
    backend.spec = AttentionSpec("mha", num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32, block_size=16)
    backend.kernel = kernel
    metadata = FlashAttnMetadata(
        torch.tensor([0, 1, 5]), torch.tensor([40, 20]), torch.zeros(2, 3, dtype=torch.int32), 4, 5
    )
    query, cache = torch.zeros(12, 8, 64), torch.zeros(2, 10, 16, 2, 64)
    out = torch.full((12, 8, 64), float("nan"))
    backend.forward(query, cache, metadata, out)
    assert calls[-1].data_ptr() == out.data_ptr() and bool((out[:5] == 2.0).all()) and bool(out[5:].isnan().all())
    wide = torch.full((12, 8 * 64 + 64), float("nan"))
    strided = wide[:, : 8 * 64].view(12, 8, 64)
    backend.forward(query, cache, metadata, strided)
    assert calls[-1] is None and bool((strided[:5] == 3.0).all()) and bool(strided[5:].isnan().all())
    assert bool(wide[:, 8 * 64 :].isnan().all())


def test_trtllm_backends_import_their_entry_point_and_re_point_draft_steps(monkeypatch):
    """trtllm and trtllm_mla (``DeviceLengthsEntryPoint``): the named FlashInfer function, a zeroed
    workspace, and a draft-step update that takes the step's device tensors (no host planning)."""
    import types

    import backends.flashinfer as flashinfer_adapters

    handed = {}

    def decode(**kwargs):
        handed.update(kwargs)
        return "decode"

    def mla(**kwargs):
        handed.update(kwargs)
        return "mla"

    monkeypatch.setitem(
        sys.modules,
        "flashinfer.decode",
        types.SimpleNamespace(trtllm_batch_decode_with_kv_cache=decode, xqa_batch_decode_with_kv_cache=decode),
    )
    monkeypatch.setitem(sys.modules, "flashinfer.mla", types.SimpleNamespace(trtllm_batch_decode_with_kv_cache_mla=mla))
    monkeypatch.setattr(flashinfer_adapters, "WORKSPACE_BYTES", 64)
    for backend_cls, case, kernel in [
        (TrtllmBackend, "gqa-h4/2-d128-bf16-p16:30+1,50+1", decode),
        (TrtllmMLABackend, "mla-h16-d512+64-bf16-p64:30+1,50+1", mla),
    ]:
        parsed = parse_case(case)
        backend = backend_cls(parsed.spec, BackendLimits(8, 64, 256), torch.device("cpu"))
        assert backend.kernel is kernel and backend.workspace.shape == (64,) and not backend.workspace.any()
        common = materialize(parsed, "cpu").common_metadata()
        metadata = backend.build(common)
        advanced = dataclasses.replace(common, seq_lens=common.seq_lens + 1, block_table=common.block_table.clone())
        assert backend.update_for_draft_step(metadata, advanced) is metadata
        assert metadata.seq_lens is advanced.seq_lens and metadata.block_table is advanced.block_table
        # A column slice of a wider table (strided cases) reaches the kernel with its rows packed,
        # copied in forward (captured with a graph), never in build.
        strided_case = parse_case(case.replace(":", "-strided:"))
        strided = materialize(strided_case, "cpu").common_metadata()
        sliced = backend.build(strided)
        assert not strided.block_table.is_contiguous() and sliced.block_table is strided.block_table
        spec = strided_case.spec
        tokens = strided.num_actual_tokens
        query, out = (
            torch.zeros(tokens, spec.num_heads, spec.head_dim),
            torch.zeros(tokens, spec.num_heads, spec.v_head_dim),
        )
        backend.forward(query, backend.allocate_kv_cache(8), sliced, out)
        assert handed["block_tables"].is_contiguous() and torch.equal(handed["block_tables"], strided.block_table)


def test_trtllm_verify_steps_hand_xqa_ragged_requests_and_each_rows_draft_mask(monkeypatch):
    """A step with a request longer than one token goes to XQA's speculative-decoding path: each
    request its own length (``q_cu_seq_lens``: the step's query_start_loc), the longest draft
    ``VERIFY_TOKENS`` (one compiled module), and row i's mask the bits of the request's new
    tokens it sees (little-endian uint16 words: bit j, token j), the tree's or a chain's; a
    decode step goes to the trtllm entry point with no mask."""
    import types

    import backends.flashinfer as flashinfer_adapters
    from backends import token_tree
    from backends.flashinfer.trtllm import VERIFY_TOKENS

    calls = []
    fake = types.SimpleNamespace(
        trtllm_batch_decode_with_kv_cache=lambda **kwargs: calls.append(("decode", kwargs)),
        xqa_batch_decode_with_kv_cache=lambda **kwargs: calls.append(("verify", kwargs)),
    )
    monkeypatch.setitem(sys.modules, "flashinfer.decode", fake)
    monkeypatch.setattr(flashinfer_adapters, "WORKSPACE_BYTES", 64)

    def handed(text):
        parsed = parse_case(text)
        backend = TrtllmBackend(parsed.spec, BackendLimits(8, 128, 4096), torch.device("cpu"))
        batch = materialize(parsed, "cpu")
        common = batch.common_metadata()
        spec, tokens = parsed.spec, common.num_actual_tokens
        calls.clear()
        backend.forward(
            torch.zeros(tokens, spec.num_heads, spec.head_dim),
            backend.allocate_kv_cache(8),
            backend.build(common),
            torch.zeros(tokens, spec.num_heads, spec.head_dim),
        )
        ((path, kwargs),) = calls
        return path, kwargs, common

    def rows_seen(mask):  # [tokens, 4] uint16 words -> each row's visible new tokens
        words = mask.view(torch.int64).flatten().tolist()
        return [[j for j in range(VERIFY_TOKENS) if (word >> j) & 1] for word in words]

    path, kwargs, common = handed("gqa-h8/2-d128-bf16-p16:30+1,50+1")
    assert path == "decode" and "mask" not in kwargs
    tree = "tree[-1.0.0.1.1.2.2]"  # EAGLE's static -1.0.0.1.1.2.2 (parent of each node)
    path, kwargs, common = handed(f"gqa-h8/2-d128-bf16-p16:100+{tree},20+1,40+3,300+tree(2x5)")
    assert path == "verify" and kwargs["q_len_per_req"] == VERIFY_TOKENS
    assert kwargs["q_cu_seq_lens"] is common.query_start_loc and kwargs["mask"].dtype == torch.uint16
    assert kwargs["mask"].shape == (common.num_actual_tokens, VERIFY_TOKENS // 16)
    expected = []
    starts = common.query_start_loc_cpu.tolist()
    parents = common.host_tree_parents.tolist()
    for start, end in zip(starts, starts[1:]):
        seen = token_tree.ancestors(parents[start:end])
        expected += [torch.nonzero(row).flatten().tolist() for row in seen]
    assert rows_seen(kwargs["mask"]) == expected
    assert rows_seen(kwargs["mask"])[:3] == [[0], [0, 1], [0, 2]]  # siblings unseen
    assert expected[-1] == [0, 2, 6, 14, 30, 62]  # 63 tokens: the high word counts too
    # Chains (no tree in the step): each row its request's earlier rows, a short prefill too.
    path, kwargs, _ = handed("gqa-h8/2-d128-bf16-p16:100+4,0+40,7+1")
    assert path == "verify"
    assert rows_seen(kwargs["mask"]) == [list(range(i + 1)) for i in range(4)] + [
        list(range(i + 1)) for i in range(40)
    ] + [[0]]
