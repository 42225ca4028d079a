"""The Gluon MLA kernel compiles for Hopper on any machine: Triton's compiler and ptxas need no GPU,
so API drift between Triton releases (the kernel runs on 3.6 and CI installs the newest) and a
shared-memory budget overrun are caught on the CPU. The GPU test (``test_mla_gluon_gpu.py``) runs it."""

import pytest
import torch

gluon_hopper = pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
triton = pytest.importorskip("triton")

from backends.triton import mla_gluon  # noqa: E402


def compile_for_sm90(one_split: bool, heads_per_program: int, decode_q: int):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    kernel = mla_gluon.mla_gluon_kernel
    cache = torch.empty(8, 64, 576, dtype=torch.bfloat16)
    latent_desc, rope_desc = mla_gluon.descriptors(cache, 512)
    signature = dict.fromkeys(kernel.arg_names, "i32")
    signature.update({name: "*bf16" for name in ("query_ptr", "cache_ptr", "out_ptr")})
    signature.update({name: "*fp32" for name in ("partial_out_ptr", "partial_lse_ptr")})
    signature.update({name: "*i32" for name in ("block_table_ptr", "query_start_loc_ptr", "seq_lens_ptr")})
    signature.update(scale_log2="fp32", latent_desc=mangle_type(latent_desc), rope_desc=mangle_type(rope_desc))
    constants = dict(
        NUM_HEADS=128,
        HEADS_PER_PROGRAM=heads_per_program,
        DECODE_Q=decode_q,
        LATENT=512,
        ROPE=64,
        BLOCK_N=mla_gluon.BLOCK_N,
        PAGE_SIZE=64,
        NUM_STAGES=mla_gluon.NUM_STAGES,
        ONE_SPLIT=one_split,
    )
    signature.update(dict.fromkeys(constants, "constexpr"))
    source = GluonASTSource(kernel, signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": mla_gluon.WARPS})


@pytest.mark.parametrize(("one_split", "heads", "decode_q"), [(True, 64, 1), (False, 16, 4)])
def test_compiles_for_hopper_within_shared_memory(one_split, heads, decode_q):
    compiled = compile_for_sm90(one_split, heads, decode_q)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx
    # The width serves() admits fills the ring to one SM's shared memory; the compiled kernel agrees.
    assert mla_gluon.serves(512, 64)
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared


def test_serves_only_the_widths_run_on_a_gpu():
    assert mla_gluon.serves(512, 64)
    assert not mla_gluon.serves(256, 64) and not mla_gluon.serves(64, 16)  # never run on a GPU
    assert not mla_gluon.serves(1024, 64)  # half the latent is past one wgmma's N of 256
