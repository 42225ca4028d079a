"""triton_mla over DeepSeek's fp8_ds_mla cache: claimed for sparse layers only (a dense layer SKIPs
with its reason), entries packed as torch_naive packs them (``backends.fp8_ds_mla``: the same
bytes) and read back as torch_naive reads them; the sparse kernel dequantizing each entry block by
block runs under Triton's interpreter (numerics, the NaN-poisoned pool). The numerics of more
cases: ``test_triton_interpreter.CASES``."""

import os
import subprocess
import sys

import pytest
import torch

from backends.base import BackendLimits, DeviceInfo
from backends.fp8_ds_mla import E4M3
from backends.torch_naive import TorchNaiveBackend
from backends.triton.mla_backend import DS_MLA_DENSE, TritonMLABackend
from conformance.cases.grammar import parse_case
from conformance.cases.kv_quantization import block_quantize

CPU = torch.device("cpu")
H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0))
A100 = DeviceInfo("cuda", "NVIDIA A100", (8, 0))
SPARSE = "mla-h16-d512+64-bf16-fp8dsmla-p64-topk2048:4000+1,3000+4"
DENSE = "mla-h16-d512+64-bf16-fp8dsmla-p64:4000+1,3000+4"
DENSE_SKIP = (
    "DeepSeek's fp8_ds_mla KV cache (e4m3 latent, a float32 scale per 128 values a token, the rope part "
    "unquantized) not supported without sparse_topk: triton_mla reads fp8_ds_mla's packed entries in its "
    "sparse kernel only; its dense split-KV kernel reads a latent of one dtype"
)


def test_claimed_for_sparse_layers_only_a_dense_layer_skips_saying_why():
    claims = TritonMLABackend.capabilities
    assert claims.skip_reason(parse_case(SPARSE).needs, H200) is None
    assert claims.skip_reason(parse_case(DENSE).needs, H200) == DENSE_SKIP
    assert claims.skip_reason(parse_case(SPARSE).needs, A100) == (
        "DeepSeek's fp8_ds_mla KV cache (e4m3 latent, a float32 scale per 128 values a token, the rope part "
        "unquantized) needs compute capability SM89, SM90, SM100, SM103, SM120 (Triton's fp8 conversions); "
        "this GPU (NVIDIA A100) is SM80"
    )
    assert claims.to_dict()["feature_only_with"] == {
        "fp8_ds_mla_kv_cache": {"features": ["sparse_topk"], "why": DS_MLA_DENSE}
    }
    with pytest.raises(ValueError, match="fp8_ds_mla on a dense layer"):
        TritonMLABackend(parse_case(DENSE).spec, BackendLimits(4, 64, 128), CPU)


def entries(spec, count: int) -> torch.Tensor:
    """[count, latent + rope] in the compute dtype, each block of 128 latent values of its own size:
    zero (the scale's FLT_MIN floor), tiny (zero again in fp16), ordinary, large."""
    rows = torch.randn(count, spec.head_dim, generator=torch.Generator().manual_seed(11))
    sizes = torch.tensor([0.0, 1e-30, 1.0, 1e3])[torch.arange(spec.kv_lora_rank // 128) % 4]
    rows[:, : spec.kv_lora_rank] *= sizes.repeat_interleave(128)
    rows[1, :128] = torch.linspace(-2.0, 2.0, 128)  # values on e4m3's rounding boundaries
    return rows.to(spec.dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_write_kv_stores_torch_naives_bytes_and_read_kv_returns_its_entries(dtype):
    spec = parse_case(f"mla-h4-d512+64-{dtype}-fp8dsmla-p16-topk16:40+1").spec
    limits = BackendLimits(4, 64, 128)
    ours, naive = TritonMLABackend(spec, limits, CPU), TorchNaiveBackend(spec, limits, CPU)
    pool, naive_pool = ours.allocate_kv_cache(6), naive.allocate_kv_cache(6)
    assert (pool.shape, pool.dtype) == ((6, 16, 656), torch.uint8)
    wide = torch.full((24, spec.head_dim + 32), float("nan"), dtype=spec.dtype)
    key = wide[:, : spec.head_dim]  # a view into a wider buffer, as a fused projection's output
    key.copy_(entries(spec, 24))
    slots = torch.arange(16, 40)
    slots[[3, 17]] = -1  # graph padding rows: nothing written
    ours.write_kv(pool, key, None, slots)
    naive.write_kv(naive_pool, key, None, slots)
    assert torch.equal(pool, naive_pool)  # vLLM's bytes, as torch_naive packs them
    written = slots[slots >= 0]
    assert not pool.view(-1, 656)[torch.tensor([19, 33])].any()  # the -1 rows' slots stay as they were
    read, none = ours.read_kv(pool, written)
    assert none is None and read.dtype == torch.float32
    assert torch.equal(read, naive.read_kv(naive_pool, written)[0])
    # The bytes are the contract's: each block over max(max|x| / 448, FLT_MIN), the rope part as given.
    given = key[slots >= 0]
    stored, scales = block_quantize(given[:, :512], 128, E4M3)
    rows = pool.view(-1, 656)[written]
    assert torch.equal(rows[:, :512], stored.view(torch.uint8))
    assert torch.equal(rows[:, 512:528].contiguous().view(torch.float32), scales)
    assert torch.equal(rows[:, 528:].contiguous().view(spec.dtype), given[:, 512:])


# Under the interpreter, a process of its own (the interpreter is chosen at import time): a dense
# layer planned as a SKIP by the check API, the numerics of a tiny sparse case over fp8_ds_mla
# (two blocks of 128 a token, a window part, messy index rows, an empty request), and the same case
# over a pool of NaN bytes (0xFF: NaN latent, scales and rope) in every slot no request owns; and
# the planted ScalesPerTokenInDsMla's packer (one scale a token in each block's place) in triton_mla,
# which the stored-cache check fails.
INTERPRETED = """
import torch
from backends.triton.mla_backend import TritonMLABackend
from conformance.cases.grammar import parse_case
from conformance.checks.memory import poison_pass
from conformance.checks.numerics import NumericsCheck
from conformance.run.execution import judge

cpu = torch.device("cpu")
sparse = parse_case("mla-h4-d256+16-bf16-fp8dsmla-p16-topk16-win8-messyidx:60+2,9+4,0+0")
dense = parse_case("mla-h4-d256+16-bf16-fp8dsmla-p16:60+2,9+4")
print(NumericsCheck().plan(TritonMLABackend, [sparse, dense], cpu)[dense.id])
result = judge(NumericsCheck(), TritonMLABackend, sparse, cpu)
print(result.verdict.name, result.reason)
print(poison_pass(TritonMLABackend, sparse, cpu))

from tests.planted.sparse_defects import _OneScaleAToken


class OneScaleAToken(TritonMLABackend):  # ScalesPerTokenInDsMla's packer, in triton_mla
    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.packed = _OneScaleAToken(spec)


result = judge(NumericsCheck(), OneScaleAToken, parse_case("mla-h4-d512+16-bf16-fp8dsmla-p16-topk16:40+1,20+4"), cpu)
print(result.verdict.name, result.reason)
"""


@pytest.mark.slow
def test_the_sparse_kernel_reads_fp8_ds_mla_under_the_interpreter():
    completed = subprocess.run(
        [sys.executable, "-c", INTERPRETED],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert completed.returncode == 0, completed.stderr
    skip, numerics, poison, planted = completed.stdout.splitlines()[:4]
    assert skip == DENSE_SKIP
    assert numerics.startswith("PASS"), numerics
    assert poison.startswith("([], {'nan-poison non-finite outputs': 0, 'nan-poison mismatched': 0"), poison
    assert planted.startswith("FAIL") and "e4m3 step" in planted, planted  # the stored cache, judged first


@pytest.mark.slow
@pytest.mark.parametrize("window", [0, 128])
def test_the_sparse_kernel_compiles_for_hopper_over_fp8_ds_mla(window):
    """Triton's compiler needs no GPU: the kernel over fp8_ds_mla's bytes (512 + 64, DeepSeek's
    shape) compiles for SM90, converting e4m3 in hardware (``cvt`` from e4m3 pairs)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backends.triton import sparse_mla_kernels

    kernel = sparse_mla_kernels.sparse_mla_kernel
    signature = dict.fromkeys(kernel.arg_names, "i32")
    signature.update({name: "*bf16" for name in ("query_ptr", "out_ptr")}, cache_ptr="*u8", scale_log2="fp32")
    signature.update({name: "*fp32" for name in ("lse_ptr", "k_scale_ptr", "partial_out_ptr", "partial_lse_ptr")})
    pointers = ("block_table_ptr", "token_request_ptr", "token_position_ptr", "num_tokens_ptr", "indices_ptr")
    signature.update(dict.fromkeys(pointers, "*i32"))
    constants = dict(
        NUM_HEADS=128, BLOCK_H=16, LATENT=512, ROPE=64, BLOCK_L=512, BLOCK_R=64, TOPK=2048, WINDOW=window,
        BLOCK_N=32, PAGE_SIZE=64, KV_FP8=False, DS_MLA=True, SCALE_BLOCK=128, UPCAST_DOT=False, RETURN_LSE=True,
        ONE_SPLIT=True,
    )  # fmt: skip
    signature.update(dict.fromkeys(constants, "constexpr"))
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}
    )
    assert "e4m3x2" in compiled.asm["ptx"]


# On a GPU: the suite's DeepSeek-V3.2 shape (512 + 64, 16 heads, top-2048, page 64), its bytes
# written by the Triton byte-copy writer, the kernel compiled for the device's fp8 conversions.
GPU_CASES = [
    "mla-h16-d512+64-bf16-fp8dsmla-p64-topk2048:4000+1,2049+1,3000+4",
    "mla-h128-d512+64-bf16-fp8dsmla-p64-topk256-win64-messyidx-edges:0+8,900+4,2000+1",
]


@pytest.mark.gpu
@pytest.mark.parametrize("case_text", GPU_CASES)
def test_triton_mla_stores_and_attends_fp8_ds_mla_on_a_gpu(case_text):
    from conformance.checks.numerics import NumericsCheck
    from conformance.results import Verdict
    from conformance.run.execution import judge

    result = judge(NumericsCheck(), TritonMLABackend, parse_case(case_text), torch.device("cuda"))
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.gpu
@pytest.mark.parametrize("check", ["graphs", "draft-loop", "syncs"])
def test_triton_mla_over_fp8_ds_mla_under_graphs_in_the_draft_loop_and_without_syncs(check):
    from conformance.checks import CHECKS
    from conformance.results import Verdict
    from conformance.run.execution import judge

    case = parse_case("mla-h16-d512+64-bf16-fp8dsmla-p64-topk256-win64:1000+1,190+1,60+1")
    result = judge(CHECKS[check](), TritonMLABackend, case, torch.device("cuda"))
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.gpu
def test_the_packed_bytes_on_a_gpu_are_torch_naives_on_the_cpu():
    """The packer on the GPU, its rows copied by the Triton writer: the bytes torch_naive writes on
    the CPU (the same torch ops on two devices; a division or a cast rounding otherwise shows)."""
    spec = parse_case("mla-h16-d512+64-bf16-fp8dsmla-p64-topk64:40+1").spec
    limits = BackendLimits(4, 256, 256)
    ours = TritonMLABackend(spec, limits, torch.device("cuda"))
    naive = TorchNaiveBackend(spec, limits, CPU)
    pool, naive_pool = ours.allocate_kv_cache(4), naive.allocate_kv_cache(4)
    key = entries(spec, 128)
    slots = torch.arange(64, 192)
    slots[[0, 77]] = -1
    ours.write_kv(pool, key.cuda(), None, slots.cuda())
    naive.write_kv(naive_pool, key, None, slots)
    assert torch.equal(pool.cpu(), naive_pool)
