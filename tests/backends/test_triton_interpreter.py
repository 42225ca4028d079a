"""Our Triton backends under Triton's CPU interpreter (TRITON_INTERPRET=1): small cases of every
kind of batch, through the same CLI a user runs. The interpreter decides at import time, so each
run is a fresh process."""

import json
import os
import subprocess
import sys

import pytest

CASES = {
    "triton": [
        "gqa-h4/2-d64-fp16-p16:1+1,15+1,16+1,40+1",  # decode at block boundaries
        "gqa-h8/2-d128-bf16-p32:20+4,33+2,60+8",  # spec-verify, 3 query lengths
        "gqa-h4/2-d64-fp16-p16:0+24,30+8,17+1x2,50+12",  # mixed prefill + decode
        "gqa-h4/1-d64-bf16-p16-w24-cap20:0+40,50+4,3+1",  # sliding window, soft cap
        "gqa-h12/4-d64-fp16-p64-share2:130+1,128+3,200+9",  # group of 3, prefix sharing, page 64
        "gqa-h8/2-d256-bf16-p16:70+2,5+1",  # head dim 256
        "gqa-h4/2-d64-bf16-p16-strided-pad0:30+1,20+4,0+9",  # fused-QKV views, strided output, no padding
        "gqa-h4/2-d64-fp16-p16-outliers:30+1,20+4,0+9",  # logits shifted by ~256, a sink at position 0
        "gqa-h4/2-d64-bf16-p16-edges:15+1,16+1,20+4,0+20",  # dominant keys at every causal edge
        "gqa-h4/1-d64-bf16-p16-w24-edges:50+4,3+1,100+1",  # dominant keys at every window edge
        "gqa-h8/4-d64-fp16-p16:30+1x8,50+2",  # enough requests for one split: no merge, output written directly
        "gqa-h4/2-d64-bf16-fp8e4m3-p16:40+1,20+4,0+9",  # fp8 cache: decode, verify and prefill paths
        "gqa-h4/2-d64-fp16-fp8e5m2-p16-w24-cap20:40+1,20+4",  # fp8 e5m2, window, soft cap
        "gqa-h8/2-d64-bf16-p16-attnsinks:200+1,20+4,0+20",  # learned sinks: split decode (merged), verify, prefill
        "gqa-h8/4-d64-fp16-p16-w24-attnsinks:30+1x8,50+2",  # learned sinks, one split (no merge), window
        "gqa-h4/2-d64-fp16-p16:0+0,30+4,0+0,0+20,50+1",  # empty requests (vLLM's padding) first and mid-batch
        "mha-h4-d192/128-bf16-p16:30+1,20+4,0+40",  # value head dim 128 under query/key 192 (DeepSeek-V3 prefill)
        "gqa-h4/2-d64/32-bf16-fp8e4m3-p16-attnsinks:200+1,0+20",  # a narrower value, fp8, sinks: one kernel path
        "gqa-h4/2-d64-bf16-fp8e4m3-kscale0.0001-p16:40+1,20+4,0+9",  # queries past fp16's range, scaled into it
    ],
    "triton_mla": [
        "mla-h4-d64+16-bf16-p16:1+1,40+1,17+1",
        "mla-h20-d64+16-fp16-p32:70+8,5+1,100+3",
        "mla-h4-d64+16-bf16-p16-strided-outliers:40+1,17+4",
        "mla-h4-d64+16-fp16-p16-edges:15+1,16+1,30+4",
        # Pages of one tile: 64-row tiles by TMA with a masked last tile, 16-row tiles by masked loads.
        "mla-h20-d64+16-fp16-p64:70+8,5+1,100+3",
        "mla-h16-d64+16-bf16-p64-edges:64+4,63+1,200+2",
        "mla-h4-d64+16-bf16-p64:1+1,40+1,130+1",
        "mla-h4-d64+16-bf16-fp8e4m3-p16:40+1,20+4,1+1",  # an fp8 latent cache, its one scale
        "mla-h4-d64+16-bf16-fp8e4m3-kscale0.0001-p16:40+1,20+4",  # its queries past fp16's range
        "mla-h4-d64+16-bf16-p16:40+1,20+4,0+0x2",  # empty requests (vLLM's padding) at the end
        # Sparse (DeepSeek's DSA): messy index rows and a window part; 20 heads (one block of 32)
        # and dominant edge keys; an fp8 latent cache.
        "mla-h4-d64+16-bf16-p16-topk16-win8-messyidx:60+2,9+4,0+0",
        "mla-h20-d64+16-fp16-p32-topk40-edges:70+1,3+1,50+8",
        "mla-h64-d64+16-bf16-p16-topk16-win8-messyidx:60+2,9+4,30+1",  # 64 heads a program: the widest launch
        "mla-h4-d64+16-bf16-fp8e4m3-p16-topk16:40+1,20+4",
        # Few tokens, no padding rows: each token's tiles split over the interpreter's 4 "SMs" and
        # merged. One token with a window part, messy rows, edge keys; two tokens (two splits
        # each); splits that see no key (entries past a short context); 5 tiles over 4 SMs with a
        # window; 80 heads (two head blocks); a padding row; a window of 4 tiles spread over splits.
        "mla-h4-d64+16-bf16-p16-topk128-win8-messyidx-pad0:300+1,0+0",
        "mla-h4-d64+16-bf16-p16-topk128-edges-pad0:300+1",
        "mla-h4-d64+16-bf16-p16-topk128-win8-messyidx-pad0:300+1,200+1",
        "mla-h4-d64+16-bf16-p16-topk128-pad0:40+1",
        "mla-h4-d64+16-bf16-p16-topk160-win8-messyidx-pad0:300+1",
        "mla-h80-d64+16-bf16-p16-topk128-pad0:300+1",
        "mla-h4-d64+16-bf16-p16-topk128-pad1:300+1",
        "mla-h4-d64+16-bf16-p16-topk32-win100-edges-pad0:300+1",
        # Sparse over DeepSeek's fp8_ds_mla (a scale per 128 latent values inside each entry):
        # two blocks, a window part, messy rows, an empty request; four blocks, fp16 rope, two
        # head blocks, edge keys.
        "mla-h4-d256+16-bf16-fp8dsmla-p16-topk16-win8-messyidx:60+2,9+4,0+0",
        "mla-h20-d512+16-fp16-fp8dsmla-p32-topk24-edges:70+1,3+1,50+8",
        "mla-h4-d256+16-bf16-fp8dsmla-p16-topk128-win8-pad0:300+1",  # split, over fp8_ds_mla
    ],
}


@pytest.mark.parametrize("backend", sorted(CASES))
@pytest.mark.slow
def test_numerics_under_the_interpreter(backend, tmp_path):
    arguments = [arg for case in CASES[backend] for arg in ("--case", case)]
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance.cli",
            "run",
            "--backend",
            backend,
            "--check",
            "numerics",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "r.json"),
            "--quiet",
            *arguments,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    cases = json.loads((tmp_path / "r.json").read_text())["backends"][0]["checks"][0]["cases"]
    assert [case["verdict"] for case in cases] == ["PASS"] * len(CASES[backend])


@pytest.mark.slow
def test_without_the_interpreter_the_cpu_is_not_claimed():
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            "from backends.triton.backend import TritonAttentionBackend as B; print(B.availability_reason('cpu'))",
        ],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    assert "runs on cuda, not cpu" in completed.stdout


def test_decode_variants_and_split_counts():
    import torch

    from backends.base import AttentionSpec, BackendLimits
    from backends.triton.backend import TritonAttentionBackend, decode_variant, num_kv_splits
    from backends.triton.mla_backend import tiling

    assert [decode_variant(q) for q in (1, 2, 3, 4, 5, 8, 100)] == [1, 2, 4, 4, 8, 8, 8]
    assert num_kv_splits(BackendLimits(64, 256, 4096), 1, 256) == 16
    assert num_kv_splits(BackendLimits(64, 256, 4096), 1, 128) == 32
    assert num_kv_splits(BackendLimits(64, 256, 300), 1, 256) == 2
    assert num_kv_splits(BackendLimits(64, 256, 4096), 200 * 2**20, 256) == 1  # memory cap wins
    assert (tiling(128, 1).heads_per_program, tiling(128, 1).block_m) == (64, 64)
    assert (tiling(128, 8).heads_per_program, tiling(128, 8).block_m) == (8, 64)
    assert (tiling(4, 1).heads_per_program, tiling(4, 1).block_m) == (4, 16)

    # A step's split count: as many programs as fill the GPU, within the scratch and the longest
    # context (2048 keys: 16 splits of triton's floor of 128); 8 KV heads per request.
    spec = AttentionSpec(kind="mha", num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    backend = TritonAttentionBackend(spec, BackendLimits(64, 512, 2048), torch.device("cpu"))
    backend.multiprocessors = 128
    assert backend.max_splits == 16
    assert [backend.splits_for(n, 1, 8, 4) for n in (1, 4, 16, 64)] == [16, 16, 4, 1]  # 512 programs wanted
    assert [backend.splits_for(n, 1, 8, 8) for n in (16, 64, 128, 256)] == [8, 2, 1, 1]  # rounded down, never 0
    # The scratch holds 16 splits of the longest variant (q=8) at 64 requests, so a bigger batch
    # limit leaves q=8 fewer splits and q=1 eight times as many as q=8.
    assert backend.partial_row_capacity == 64 * 8 * 32 * 16
    backend.limits = BackendLimits(512, 4096, 4096)
    assert backend.splits_for(1, 8, 8, 4) == 2 and backend.splits_for(1, 1, 8, 4) == 16


def test_mla_tile_reads():
    """How triton_mla reads a KV tile, from the layer and the tile's rows (the cases above take each)."""
    import torch

    from backends.triton.mla_backend import GATHER, GLUON, PAGE, TMA, has_tma, has_wgmma, mla_gluon, tile_read
    from conformance.cases.grammar import parse_case

    def read(layer: str, block_m: int, cache: torch.Tensor | None = None, tma: bool = True, wgmma: bool = False) -> int:
        spec = parse_case(layer + ":10+1").spec
        if cache is None:
            cache = torch.zeros(4, spec.block_size, spec.head_dim, dtype=spec.dtype)
        return tile_read(spec, block_m, cache, tma, wgmma)

    assert has_tma(torch.device("cpu"))  # the interpreter
    assert read("mla-h4-d64+16-fp16-p16", 64) == GATHER  # a tile spans pages
    assert read("mla-h20-d64+16-fp16-p64", 64) == TMA
    assert read("mla-h20-d64+16-fp16-p64", 64, tma=False) == PAGE  # a GPU older than Hopper
    assert read("mla-h4-d64+16-bf16-p64", 16) == PAGE  # too few rows for TMA to pay
    assert read("mla-h16-d64+8-bf16-p64", 64) == PAGE  # rope narrower than the kernel's 16 columns
    assert read("mla-h16-d48+16-bf16-p64", 64) == PAGE  # latent not a power of two
    strided = torch.zeros(4, 64, 2 * 80, dtype=torch.bfloat16)[..., :80]
    assert read("mla-h16-d64+16-bf16-p64", 64, strided) == PAGE  # rows of the pool not contiguous
    assert not has_wgmma(torch.device("cpu"))  # the Gluon kernel is Hopper's only
    if mla_gluon is not None:  # on Hopper, the Gluon kernel takes the 64-row tiles TMA can copy
        assert read("mla-h128-d512+64-bf16-p64", 64, wgmma=True) == GLUON
        assert read("mla-h20-d64+16-fp16-p64", 64, wgmma=True) == TMA  # widths never run through it on a GPU
        assert read("mla-h4-d64+16-bf16-p64", 16, wgmma=True) == PAGE  # 16-row tiles: the Triton kernel
        assert read("mla-h128-d512+64-bf16-fp8e4m3-p64", 64, wgmma=True) == PAGE  # no fp8 tiles by TMA
        assert read("mla-h16-d1024+64-bf16-p64", 64, wgmma=True) == TMA  # too wide for the ring
        assert read("mla-h16-d512+64-fp16-p64", 64, wgmma=True) == GLUON


def assert_exact_over_poison(script: str) -> None:
    """Run ``script`` (which prints ``poison_pass``'s result) under the interpreter, in a fresh
    process: no finding, no non-finite output, none beyond tolerance."""
    completed = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("([], {'nan-poison non-finite outputs': 0, 'nan-poison mismatched': 0"), (
        completed.stdout
    )


@pytest.mark.slow
def test_mla_tma_reads_no_slot_past_the_sequence():
    """TMA copies whole tiles without a mask, so the last, partial tile of a split must be read
    with masked loads: with NaN in every slot no request owns, the output stays exact (reading
    the whole last tile by TMA turns it NaN, since 0 x NaN = NaN)."""
    script = (
        "import torch; from conformance.cases.grammar import parse_case; "
        "from conformance.checks.memory import poison_pass; from backends.triton.mla_backend import TritonMLABackend; "
        "print(poison_pass(TritonMLABackend, "
        "parse_case('mla-h16-d64+16-bf16-p64:64+4,63+1,200+2'), torch.device('cpu')))"
    )
    assert_exact_over_poison(script)


@pytest.mark.slow
def test_merge_folds_more_splits_than_its_tile():
    """The merge kernel takes BLOCK_SPLITS splits at a time, so a request with more (one long
    context alone on a big GPU takes up to MAX_SPLITS) goes through its loop: with 37 splits
    (three tiles, the last partial; a context long enough that more than one tile of splits holds
    keys, 2400 keys in 19 splits of 128, beside a shorter one whose keys fit the first tile; the
    history is written by the interpreted cache-write kernel, a program a token, so no longer than
    that), learned sinks and the log-sum-exp asked for, the output and LSE equal the oracle's,
    with NaN in every slot no request owns; a value head dim of 128 is two programs' columns
    (the backend's merge_columns), the log-sum-exp written by the first. Merging only the first tile of splits
    fails it, and so does a merge that writes only its first columns."""
    script = (
        "import torch; from conformance.cases.grammar import parse_case; "
        "from conformance.checks.memory import poison_pass; from conformance.harness.lse_pass import lse_findings; "
        "from conformance.harness.step import prepare_case, run_step; from backends.triton import backend; "
        "assert backend.BLOCK_SPLITS < 37 <= backend.MAX_SPLITS; "
        "backend.TritonAttentionBackend.splits_for = lambda self, *args: 37; "
        "assert backend.TritonAttentionBackend.merge_columns < 128; "
        "case = parse_case('gqa-h8/2-d128-bf16-p16-attnsinks-lse:2400+1,600+1'); cpu = torch.device('cpu'); "
        "prepared = prepare_case(backend.TritonAttentionBackend, case, cpu); run_step(prepared); "
        "assert lse_findings(prepared)[0] is None, lse_findings(prepared); "
        "print(poison_pass(backend.TritonAttentionBackend, case, cpu))"
    )
    assert_exact_over_poison(script)
