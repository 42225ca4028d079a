"""Every launch of triton_mla's sparse kernel fits a Hopper block's shared memory, read from the
kernel compiled for SM90 on the CPU (Triton's ptxas; no GPU). Triton pipelines a loop's copies
through shared memory as it sees fit: at 64 heads and 64-entry tiles, top 64 with a window of 128
asked for 295 KB, an OutOfResources on an H200 that no CPU test had seen. The compile is given
what the JIT sees on a GPU: pointers and integer arguments divisible by 16."""

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
    "k_scale_ptr": "*fp32",
}
CACHES = {"bf16": "*bf16", "fp8": "*fp8e4nv", "fp8_ds_mla": "*u8"}
# (top-k, window): one index tile or many, no window, one window tile or many.
SPARSITY = [(64, None), (2048, None), (64, 128), (2048, 1024), (16, 8)]


def shared_bytes(heads: int, topk: int, window: int | None, cache: str) -> int:
    spec = AttentionSpec(
        kind="mla", num_heads=heads, num_kv_heads=1, head_dim=576, dtype=torch.bfloat16, block_size=64,
        kv_lora_rank=512, rope_dim=64, sparse_topk=topk, sparse_window=window,
    )  # fmt: skip
    block_h, block_n, warps, stages = sparse_mla.launch(spec)
    constants = dict(
        NUM_HEADS=heads, BLOCK_H=block_h, LATENT=512, ROPE=64, BLOCK_L=512, BLOCK_R=64, TOPK=topk,
        WINDOW=window or 0, BLOCK_N=block_n, PAGE_SIZE=64, KV_FP8=cache == "fp8", DS_MLA=cache == "fp8_ds_mla",
        SCALE_BLOCK=128 if cache == "fp8_ds_mla" else 1, UPCAST_DOT=False, RETURN_LSE=False,
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
    divisible = {
        (i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if signature[name] not in ("constexpr", "fp32")
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
    for (topk, window), cache in itertools.product(SPARSITY, CACHES):
        used = shared_bytes(heads, topk, window, cache)
        if used > HOPPER_SHARED_BYTES:
            too_large.append(f"top {topk}, window {window}, {cache}: {used} bytes")
    assert not too_large, f"{heads} heads: " + "; ".join(too_large)
