"""Every launch of triton_mla's sparse kernel fits a Hopper block's shared memory, read from the
kernel compiled for SM90 on the CPU (Triton's ptxas; no GPU). Triton pipelines a loop's copies
through shared memory as it sees fit: at 64 heads and 64-entry tiles, top 64 with a window of 128
asked for 295 KB, an OutOfResources on an H200 that no CPU test had seen. The compile is given
what the JIT sees on a GPU: pointers and integer arguments divisible by 16. Each launch compiles
unsplit and split (a step of few tokens shares a token's index row among programs)."""

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from backends.base import AttentionSpec  # noqa: E402
from backends.triton import sparse_mla, sparse_mla_kernels  # noqa: E402

HOPPER_SHARED_BYTES = 232448  # the most a block may have on an H100 / H200 (227 KB)
POINTERS = {
    "query_ptr": "*bf16",
    "block_table_ptr": "*i32",
    "token_request_ptr": "*i32",
    "token_position_ptr": "*i32",
    "num_tokens_ptr": "*i32",
    "indices_ptr": "*i32",
    "out_ptr": "*bf16",
    "lse_ptr": "*fp32",
    "partial_out_ptr": "*fp32",
    "partial_lse_ptr": "*fp32",
    "k_scale_ptr": "*fp32",
}
CACHES = {"bf16": "*bf16", "fp8": "*fp8e4nv", "fp8_ds_mla": "*u8"}
# (top-k, window): one index tile or many, no window, one window tile or many.
SPARSITY = [(64, None), (2048, None), (64, 128), (2048, 1024), (16, 8)]


def shared_bytes(heads: int, topk: int, window: int | None, cache: str, one_split: bool = True) -> int:
    spec = AttentionSpec(
        kind="mla", num_heads=heads, num_kv_heads=1, head_dim=576, dtype=torch.bfloat16, block_size=64,
        kv_lora_rank=512, rope_dim=64, sparse_topk=topk, sparse_window=window,
    )  # fmt: skip
    block_h, block_n, warps, stages = sparse_mla.launch(spec)
    constants = dict(
        NUM_HEADS=heads, BLOCK_H=block_h, LATENT=512, ROPE=64, BLOCK_L=512, BLOCK_R=64, TOPK=topk,
        WINDOW=window or 0, BLOCK_N=block_n, PAGE_SIZE=64, KV_FP8=cache == "fp8", DS_MLA=cache == "fp8_ds_mla",
        SCALE_BLOCK=128 if cache == "fp8_ds_mla" else 1, UPCAST_DOT=False, RETURN_LSE=False, ONE_SPLIT=one_split,
    )  # fmt: skip
    kernel = sparse_mla_kernels.sparse_mla_kernel
    names = kernel.arg_names
    signature = {
        name: "constexpr"
        if name in constants
        else CACHES[cache]
        if name == "cache_ptr"
        else POINTERS.get(name, "fp32" if name == "scale_log2" else "i32")
        for name in names
    }
    divisible = {  # the split count is a small number, not a multiple of 16
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(names)
        if signature[name] not in ("constexpr", "fp32") and name != "num_splits"
    }
    source = ASTSource(
        kernel,
        signature,
        constexprs={(names.index(name),): value for name, value in constants.items()},
        attrs=divisible,
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    return compiled.metadata.shared


@pytest.mark.slow
@pytest.mark.parametrize("heads", [16, 32, 128])
def test_every_sparse_launch_fits_a_hopper_block(heads):
    too_large = []
    for (topk, window), cache, one_split in itertools.product(SPARSITY, CACHES, (True, False)):
        used = shared_bytes(heads, topk, window, cache, one_split)
        if used > HOPPER_SHARED_BYTES:
            too_large.append(f"top {topk}, window {window}, {cache}, one split {one_split}: {used} bytes")
    assert not too_large, f"{heads} heads: " + "; ".join(too_large)


@pytest.mark.parametrize(
    "tokens, real, head_blocks, tiles, capacity, splits",
    [
        (8, 8, 2, 32, 10_000, 8),  # DeepSeek-V3.2 at batch 8 on 132 SMs: 16 programs, 8 splits each
        (11, 8, 2, 32, 10_000, 8),  # ... with 3 padding rows, which take no SM: still 8 (22 programs gave 6)
        (64, 64, 2, 32, 10_000, 1),  # 128 programs fill the SMs: unsplit
        (1, 1, 2, 32, 10_000, 32),  # at most a tile a split
        (8, 8, 2, 32, 16, 2),  # within the scratch: 16 rows a head for 8 tokens
        (11, 8, 2, 32, 16, 1),  # the scratch holds every launched row's splits: 16 // 11
        (3, 3, 2, 32, 10_000, 16),  # 22 wanted, but 2 tiles a split leave 16 with any: no split without a tile
        (67, 64, 1, 32, 10_000, 2),  # 16 heads, 64 tokens and 3 padding rows: 132 // 64, not 132 // 67
        (35, 35, 1, 32, 10_000, 3),  # 35 real tokens: one wave of 105 programs, not two of 140
        (17, 17, 1, 32, 10_000, 7),  # 17 real tokens: 119 programs in one wave
        (67, 67, 1, 32, 10_000, 1),  # a graph's padding requests count as real: unsplit
        (8, 300, 1, 32, 10_000, 16),  # num_reqs × max_query_len only bounds the tokens from above
        (134, 134, 1, 32, 10_000, 1),  # one program a token fills the SMs: unsplit
    ],
)
def test_a_step_of_few_tokens_splits_their_index_rows_to_fill_the_sms(
    tokens, real, head_blocks, tiles, capacity, splits
):
    assert sparse_mla.num_splits(tokens, real, head_blocks, tiles, 132, capacity) == splits


@pytest.mark.slow
def test_the_merge_fits_its_registers_on_hopper():
    """The split rows' merge at DeepSeek-V3.2's latent, compiled for SM90: no register spills
    (64 heads a program spilled 8 KB; ``sparse_mla.MERGE_HEADS`` heads do not)."""
    import os
    import re
    import subprocess
    import tempfile

    kernel = sparse_mla_kernels.sparse_merge_kernel
    constants = dict(NUM_HEADS=128, BLOCK_H=sparse_mla.MERGE_HEADS, LATENT=512, BLOCK_L=512)
    pointers = {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "num_tokens_ptr": "*i32", "out_ptr": "*bf16"}
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in kernel.arg_names}
    source = ASTSource(
        kernel, signature, constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()}
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        command = [ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull]
        report = subprocess.run(command, capture_output=True, text=True)
    spills = re.search(r"(\d+) bytes spill stores", report.stderr)
    assert spills is not None and spills.group(1) == "0", report.stderr


class RecordedLaunch:
    """Stands in for a Triton kernel: keeps each launch's grid (nothing runs)."""

    def __init__(self) -> None:
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


@pytest.mark.parametrize(
    "num_reqs, query_len, padding, splits",
    [(64, 1, 3, 2), (67, 1, 0, 1), (8, 1, 3, 16), (32, 2, 3, 2), (0, 0, 8, 16)],
)
def test_the_forward_splits_by_the_steps_requests_not_its_padding_rows(
    monkeypatch, num_reqs, query_len, padding, splits
):
    """The launch counts the step's ``num_reqs × max_query_len`` tokens: 64 decode tokens and 3
    padding rows at 16 heads split in two, as 64 tokens do; 67 real ones do not split; 32
    requests of 2 tokens are 64 (32 would give 4); a step with no query counts every row."""
    from types import SimpleNamespace

    from backends.base import BackendLimits, LayerParameters

    spec = AttentionSpec(
        kind="mla", num_heads=16, num_kv_heads=1, head_dim=576, dtype=torch.bfloat16, block_size=64,
        kv_lora_rank=512, rope_dim=64, sparse_topk=2048,
    )  # fmt: skip
    rows = num_reqs * query_len + padding
    scratch = (torch.empty(rows * 16 * 32 * 512), torch.empty(rows * 16 * 32), 132)
    read = sparse_mla.SparseMLARead(spec, BackendLimits(128, 128, 4096), torch.device("cpu"), False, scratch)
    kernel, merge = RecordedLaunch(), RecordedLaunch()
    monkeypatch.setattr(sparse_mla_kernels, "sparse_mla_kernel", kernel)
    monkeypatch.setattr(sparse_mla_kernels, "sparse_merge_kernel", merge)
    metadata = SimpleNamespace(
        num_reqs=num_reqs, max_query_len=query_len, block_table=torch.zeros(rows, 64, dtype=torch.int32),
        token_request=read.token_request, token_position=read.token_position, num_tokens=read.num_tokens,
        seq_lens=torch.zeros(rows, dtype=torch.int32),
    )  # fmt: skip
    query = torch.zeros(rows, 16, 576, dtype=torch.bfloat16)
    out = torch.zeros(rows, 16, 512, dtype=torch.bfloat16)
    layer = LayerParameters(topk_indices=torch.zeros(rows, 2048, dtype=torch.int32))
    read.forward(query, torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16), metadata, out, layer, None)
    assert kernel.grids == [(rows, 1, splits)]
    assert len(merge.grids) == (splits > 1)
