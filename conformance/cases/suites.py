"""The suites: named lists of cases (``suite(name)``), from the few-second ``smoke`` suite to the
``full`` one, and the ``bench`` shapes. Each case is written in the grammar of ``grammar``."""

from __future__ import annotations

import random
from dataclasses import replace

from conformance.cases.grammar import Case, CaseSyntaxError, format_layer, parse_case

LLAMA3_8B = "gqa-h32/8-d128-bf16-p16"


def _boundary_batch(block_size: int, query_len: int) -> str:
    """Sequence lengths at, just below and just above one and two block boundaries."""
    items = []
    for boundary in (block_size, 2 * block_size):
        for seq_len in (boundary - 1, boundary, boundary + 1):
            items.append(f"{max(seq_len - query_len, 0)}+{min(query_len, seq_len)}")
    return ",".join(items)


def _mha_batches(block_size: int, *, rich: bool) -> list[tuple[str, str]]:
    batches = [
        ("decode", "1+1,15+1,16+1,100+1,511+1,1000+1,2047+1,3000+1"),
        ("spec-verify k=1", "200+2,1500+2,33+2,4000+2"),
        ("spec-verify k=3", "300+4,1200+4,63+4,2900+4"),
        ("spec-verify k=7", "100+8,2000+8,47+8,777+8"),
        ("chunked prefill with context", "1024+256,300+100"),
        ("mixed prefill + decode", "0+200,700+64,3000+1x6,50+4x3"),
        ("mixed, decodes first", "3000+1x4,100+1,0+200,700+64,50+4x2"),
        # Few query tokens: the memory check runs its mixed case under compute-sanitizer, whose cost
        # grows with each report (see conformance.checks.memory).
        ("mixed, small", "0+24,70+8,300+1x3,50+4x2"),
        ("block boundaries decode", _boundary_batch(block_size, 1)),
        ("block boundaries verify", _boundary_batch(block_size, 4)),
        ("length 1", "0+1"),
    ]
    if rich:
        batches += [
            ("prefill", "0+512"),
            ("decode batch 1", "4096+1"),
            ("decode batch 128", "64+1x32,500+1x32,1100+1x32,2100+1x32"),
            ("spec-verify batch 128", "180+4x64,1000+4x64"),
            ("long context", "8192+1x2,8190+4"),
        ]
    return batches


def _mla_batches(block_size: int, *, rich: bool) -> list[tuple[str, str]]:
    batches = [
        ("decode", "1+1,63+1,64+1,65+1,700+1,2500+1"),
        ("spec-verify k=1", "100+2,1000+2,2000+2"),
        ("spec-verify k=3", "64+4,900+4,3000+4"),
        ("spec-verify k=7", "50+8,640+8,1800+8"),
        ("block boundaries decode", _boundary_batch(block_size, 1)),
        ("mixed prefill + decode", "0+100,500+40,2000+1x4"),
        ("mixed, small", "0+24,70+8,700+1x3,50+4x2"),
    ]
    if rich:
        batches += [("decode batch 1", "4096+1"), ("decode batch 128", "200+1x64,1500+1x64")]
    return batches


def _cases(layer: str, batches: list[tuple[str, str]]) -> list[Case]:
    return [replace(parse_case(f"{layer}:{batch}"), tag=tag) for tag, batch in batches]


def smoke_suite() -> list[Case]:
    """Seconds on a CPU: one of each kind of batch on small layers (a softmax scale of its own on
    one of them: every backend must honour it). Not a gate: no fp8 cache, learned sinks,
    log-sum-exp or empty requests, no long context or large batch; ``quick`` and ``standard`` are."""
    return (
        _cases(
            "gqa-h4/2-d64-fp32-p16",
            [
                ("decode", "1+1,15+1,16+1,40+1"),
                ("spec-verify k=3", "20+4,33+4"),
                ("mixed prefill + decode", "0+24,30+8,17+1x2"),
            ],
        )
        + _cases("gqa-h4/1-d64-bf16-p16-w24-cap20", [("sliding window, soft cap", "0+40,50+4,3+1")])
        + _cases("gqa-h4/2-d64-fp16-p16-scale0.25-share2", [("prefix sharing, softmax scale 0.25", "40+1,32+4,60+1")])
        + _cases("mla-h4-d64+16-bf16-p16", [("decode", "1+1,40+1"), ("spec-verify k=3", "30+4")])
        + _cases("gqa-h4/2-d64-bf16-p16-strided-outliers", [("strided views, large logits", "40+1,20+4,0+9")])
        + _cases("gqa-h4/1-d64-fp16-p16-w24-pad0-edges", [("window edges, no padding", "50+4,3+1,100+1")])
    )


def _variant_cases() -> list[Case]:
    """The properties a real engine varies and the base suite holds fixed: strided views, padding,
    large logits, boundary-sensitive data and the softmax scale (see docs/checks.md, "What the harness
    varies")."""
    cases = _cases(
        LLAMA3_8B + "-strided",
        [
            ("strided: decode", "1+1,100+1,1000+1,2047+1"),
            ("strided: spec-verify k=3", "300+4,1200+4,63+4"),
            ("strided: mixed prefill + decode", "0+200,700+64,3000+1x4"),
        ],
    )
    cases += _cases(
        LLAMA3_8B + "-pad0",
        [("no padding rows: decode", "500+1,33+1,1000+1"), ("no padding rows: mixed", "0+100,70+4,300+1")],
    )
    cases += _cases(LLAMA3_8B + "-pad64", [("64 padding rows: spec-verify", "300+4,70+4")])
    cases += _cases(
        LLAMA3_8B + "-outliers",
        [
            ("large logits: decode", "1+1,500+1,3000+1"),
            ("large logits: spec-verify k=3", "300+4,1200+4"),
            ("large logits: mixed", "0+200,700+64,3000+1x2"),
        ],
    )
    cases += _cases(
        "gqa-h32/8-d128-fp16-p32-outliers",
        [("large logits, fp16: decode", "1+1,500+1,3000+1"), ("large logits, fp16: spec-verify k=3", "300+4,1200+4")],
    )
    cases += _cases(
        LLAMA3_8B + "-edges",
        [
            ("edges: decode at block ends", "1+1,15+1,16+1,31+1,100+1,1000+1,3000+1"),
            ("edges: spec-verify k=3", "300+4,1200+4,12+4,60+4"),
            ("edges: spec-verify k=7", "100+8,2000+8"),
            ("edges: chunked prefill", "1024+256,300+100"),
            ("edges: mixed", "0+200,700+64,3000+1x2,50+4"),
        ],
    )
    cases += _cases("gqa-h32/8-d128-fp16-p32-edges", [("edges, fp16: spec-verify k=3", "300+4,1200+4,28+4")])
    cases += _cases(
        "gqa-h8/2-d128-bf16-p16-w256-edges",
        [
            ("window edges: decode", "1000+1,200+1,255+1,256+1,257+1"),
            ("window edges: spec-verify k=3", "600+4,2000+4,254+4"),
            ("window edges: mixed", "0+300,700+64,3000+1"),
        ],
    )
    cases += _cases(
        "gqa-h8/2-d128-bf16-p16-scale0.25",
        [
            ("scale 0.25: decode", "100+1,2000+1"),
            ("scale 0.25: spec-verify k=3", "500+4,30+4"),
            ("scale 0.25: mixed prefill + decode", "0+200,700+64,300+1x2"),
            # Second cases on every path (docs/checks.md, "Every parameter at work on every path").
            ("scale 0.25: decode at block ends", "15+1,16+1,17+1"),
            ("scale 0.25: mixed, small", "0+24,70+8,300+1x3,50+4x2"),
        ],
    )
    # A cap matters only on logits past it: large logits (near 256) under a cap of 30, every path.
    cases += _cases(
        "gqa-h8/2-d128-bf16-p16-cap30-outliers",
        [
            ("cap 30, large logits: decode", "1+1,500+1,3000+1"),
            ("cap 30, large logits: spec-verify k=3", "300+4,1200+4"),
            ("cap 30, large logits: mixed", "0+200,700+64,3000+1x2"),
            ("cap 30, large logits: decode at block ends", "15+1,16+1,17+1"),
            ("cap 30, large logits: mixed, small", "0+24,70+8,300+1x3,50+4x2"),
        ],
    )
    # DeepSeek-V3's MLA scale: 1/sqrt(192) times its YaRN mscale squared (0.1 ln 40 + 1)^2, not 1/sqrt(576).
    cases += _cases(
        "mla-h16-d512+64-bf16-p64-scale0.13524",
        [
            ("DeepSeek scale: decode", "1+1,700+1,2500+1"),
            ("DeepSeek scale: spec-verify k=3", "64+4,900+4"),
            ("DeepSeek scale: mixed", "0+100,500+40,2000+1x4"),
        ],
    )
    cases += _cases(
        "mla-h16-d512+64-bf16-p64-strided",
        [("strided: decode", "1+1,700+1,2500+1"), ("strided: spec-verify k=3", "64+4,900+4")],
    )
    cases += _cases(
        "mla-h16-d512+64-bf16-p64-outliers",
        [("large logits: decode", "1+1,700+1,2500+1"), ("large logits: spec-verify k=3", "64+4,900+4")],
    )
    cases += _cases(
        "mla-h16-d512+64-bf16-p64-edges",
        [
            ("edges: decode at block ends", "63+1,64+1,127+1,700+1"),
            ("edges: spec-verify k=3", "60+4,900+4"),
            ("edges: spec-verify k=7", "57+8,640+8"),
        ],
    )
    # Engines' pools are tens of GiB: an offset computed in 32 bits wraps past 2**31 elements.
    cases += _cases(
        LLAMA3_8B + "-bigpool", [("big pool: decode", "1+1,700+1,3000+1"), ("big pool: spec-verify k=3", "63+4,1200+4")]
    )
    cases += _cases(
        "mla-h16-d512+64-bf16-p64-bigpool",
        [("big pool: decode", "1+1,700+1,2500+1"), ("big pool: spec-verify k=3", "64+4,900+4")],
    )
    return cases + _fp8_cases()


def _fp8_cases() -> list[Case]:
    """An fp8 KV cache (scales k 0.1, v 4 unless given) on every kind of batch and layer option
    where scales have broken backends: decode and prefill paths, block boundaries, long context,
    MLA's latent cache, strided inputs, padding, large logits and boundary data, other scales."""
    fp8 = LLAMA3_8B.replace("-p16", "-fp8e4m3-p16")
    cases = _cases(
        fp8,
        [
            (f"fp8: {tag}", batch)
            for tag, batch in _mha_batches(16, rich=False)
            if tag
            in (
                "decode",
                "spec-verify k=3",
                "chunked prefill with context",
                "mixed prefill + decode",
                "block boundaries decode",
                "block boundaries verify",
            )
        ]
        + [("fp8: long context", "8192+1x2,8190+4")],
    )
    cases += _cases(
        "gqa-h32/8-d128-fp16-fp8e5m2-p32",
        [
            ("fp8 e5m2: decode", "1+1,500+1,3000+1"),
            ("fp8 e5m2: spec-verify k=3", "300+4,1200+4"),
            ("fp8 e5m2: mixed", "0+200,700+64,3000+1x2"),
        ],
    )
    cases += _cases(fp8 + "-strided-pad64", [("fp8, strided, 64 padding rows: spec-verify k=3", "300+4,1200+4,63+4")])
    cases += _cases(fp8 + "-pad0-outliers", [("fp8, large logits, no padding: decode", "1+1,500+1,3000+1")])
    cases += _cases(fp8 + "-edges", [("fp8, edges: spec-verify k=3", "300+4,1200+4,12+4,60+4")])
    cases += _cases("gqa-h8/2-d128-bf16-fp8e4m3-p16-w256-edges", [("fp8, window edges: mixed", "0+300,700+64,255+1")])
    cases += _cases(
        "gqa-h8/2-d128-bf16-fp8e4m3-kscale0.03-vscale7-p16",
        [("fp8, scales 0.03 and 7: decode", "100+1,2000+1"), ("fp8, scales 0.03 and 7: spec-verify k=3", "500+4,30+4")],
    )
    # A key scale of 0.0001 takes the queries past fp16's range (the data keep every score): a
    # backend that multiplies in fp16 over its fp8 cache must scale a bf16 query first.
    cases += _cases(
        "gqa-h8/2-d128-bf16-fp8e4m3-kscale0.0001-p16",
        [("fp8, queries past fp16: decode", "100+1,2000+1"), ("fp8, queries past fp16: spec-verify k=3", "500+4,30+4")],
    )
    cases += _cases(
        "mla-h16-d512+64-bf16-fp8e4m3-kscale0.0001-p64", [("fp8 latent, queries past fp16: decode", "1+1,700+1,2500+1")]
    )
    cases += _cases(
        "mla-h16-d512+64-bf16-fp8e4m3-p64",
        [
            ("fp8 latent: decode", "1+1,63+1,64+1,700+1,2500+1"),
            ("fp8 latent: spec-verify k=3", "64+4,900+4"),
            ("fp8 latent: mixed", "0+100,500+40,2000+1x4"),
        ],
    )
    return cases


QUICK_KV_ELEMENTS = 2_000_000  # 8 MB of float32 keys and values a case


def quick_suite() -> list[Case]:
    """The default on a CPU: the standard suite's cases of at most QUICK_KV_ELEMENTS key/value
    numbers, and each layer's smallest case where it has none that small (every layer, and so
    every kind, dtype and layer option, stays; the large batches, long contexts and chunked
    prefills, which a CPU spends most of a standard run on, are left to ``--suite standard``)."""
    cases = standard_suite()
    small = [case for case in cases if case.kv_elements <= QUICK_KV_ELEMENTS]
    layers = {format_layer(case.spec, case.layer_options) for case in small}
    for case in sorted(cases, key=lambda case: case.kv_elements):
        layer = format_layer(case.spec, case.layer_options)
        if layer not in layers:
            layers.add(layer)
            small.append(case)
    return [case for case in cases if case in small]


def standard_suite() -> list[Case]:
    """The default on a GPU: every kind of batch on the layers engines ship."""
    cases = _cases(LLAMA3_8B, _mha_batches(16, rich=True))
    cases += _cases(LLAMA3_8B + "-share4", [("prefix sharing", "64+1,100+4,200+1x2,70+8")])
    cases += _cases(LLAMA3_8B + "-linear", [("blocks in order", "1000+1,300+4")])
    cases += _cases("gqa-h32/8-d128-fp16-p32", _mha_batches(32, rich=False))
    cases += _cases("gqa-h16/4-d128-bf16-p64", _mha_batches(64, rich=False)[:4])
    cases += _cases("mha-h16/16-d64-fp16-p16", _mha_batches(16, rich=False)[:6])
    cases += _cases("gqa-h8/2-d256-bf16-p16", _mha_batches(16, rich=False)[:6])
    cases += _cases("gqa-h8/2-d128-fp32-p16", _mha_batches(16, rich=False)[:6])
    # Groups that are not a power of two (Qwen2.5-7B: 28 query heads over 4 KV heads) and wider
    # than a small tile (Qwen3-235B-A22B: 64 over 4): a padded or fixed-width group reads the wrong heads.
    cases += _cases(
        "gqa-h28/4-d128-bf16-p16",
        [
            ("group of 7: decode", "1+1,100+1,1000+1,3000+1"),
            ("group of 7: spec-verify k=3", "300+4,1200+4,63+4"),
            ("group of 7: mixed prefill + decode", "0+200,700+64,3000+1x2,50+4"),
        ],
    )
    cases += _cases(
        "gqa-h64/4-d128-bf16-p16",
        [("group of 16: decode", "1+1,1000+1,3000+1"), ("group of 16: spec-verify k=3", "300+4,1200+4")],
    )
    cases += _cases(
        "gqa-h8/2-d128-bf16-p16-w256",
        [
            ("decode", "1000+1,200+1,255+1,256+1"),
            ("spec-verify k=3", "600+4,2000+4"),
            ("mixed prefill + decode", "0+300,700+64,3000+1"),
        ],
    )
    cases += _cases(
        "gqa-h8/2-d128-bf16-p16-cap30",
        [("decode", "1000+1,20+1"), ("spec-verify k=3", "600+4"), ("mixed prefill + decode", "0+200,500+1")],
    )
    # Long contexts over activation-like values (a channel's mean, not 1/√n, is the output): an
    # accumulator kept in half precision across KV tiles is 19x the tolerance at 16k in bf16, 7x at
    # 32k in fp16 (tiles of 16; at 4k 1.7x: tests/conformance/checks/test_activations.py).
    cases += _cases(LLAMA3_8B, [("long context: decode and spec-verify", "16k+1,12k+4")])
    cases += _cases("gqa-h32/8-d128-fp16-p32", [("long context decode", "32k+1")])
    cases += _cases("mla-h16-d512+64-bf16-p64", _mla_batches(64, rich=True))
    cases += _cases("mla-h128-d512+64-bf16-p64", _mla_batches(64, rich=False))
    cases += _cases("mla-h16-d512+64-fp16-p16", _mla_batches(16, rich=False)[:3])
    # Fewer heads than a 16-head tile (Kimi-K2's 64 heads at tensor parallel 8; DeepSeek-V3's 128
    # at 16): a tile's rows past the head count must be masked.
    cases += _cases(
        "mla-h8-d512+64-bf16-p64", [("8 heads: decode", "1+1,700+1,2500+1"), ("8 heads: spec-verify k=3", "64+4,900+4")]
    )
    # DeepSeek-V3's MLA prefill as vLLM and SGLang run it: ordinary attention over decompressed
    # keys, q/k 192 (128 + 64 rope), v 128, 128 heads over tensor parallel 8, its YaRN scale.
    cases += _cases(
        "mha-h16-d192/128-bf16-p64-scale0.13524-lse",
        [
            ("DeepSeek-V3 prefill: with context", "200+64,0+100"),
            ("DeepSeek-V3 prefill: chunked, long context", "1024+256,0+300,4096+512"),
        ],
    )
    return cases + _variant_cases() + _sink_cases() + _empty_request_cases() + _tensor_parallel_cases()


_TP_BATCHES = (  # small: every split of every layer runs them on every backend
    ("decode", "1+1,15+1,16+1,17+1,1000+1"),
    ("spec-verify k=3", "60+4,900+4"),
    ("mixed, small", "0+24,70+8,300+1x3,50+4x2"),
)


def _tensor_parallel_cases() -> list[Case]:
    """Each model layer's heads divided by the tensor-parallel size, as vLLM's attention tests
    sweep them: TP 1, 2 and 8, small batches on each split the suite does not already hold.
    (Qwen3-235B-A22B's 64/4 at TP 2 is the log-sum-exp's group of 16, in ``_sink_cases``; at TP 8,
    its 4 KV heads replicated, Llama-3-70B's 8/1.)"""
    cases = []
    for tp, layer in ((1, "gqa-h64/8-d128-bf16-p16"), (2, "gqa-h32/4-d128-bf16-p16"), (8, "gqa-h8/1-d128-bf16-p16")):
        cases += _cases(layer, [(f"TP {tp}, Llama-3-70B's layer: {tag}", batch) for tag, batch in _TP_BATCHES])
    # gpt-oss's 64/8 × 64 with its learned sinks (TP 1: ``_sink_cases``).
    for tp, layer in ((2, "gqa-h32/4-d64-bf16-p16-attnsinks"), (8, "gqa-h8/1-d64-bf16-p16-attnsinks")):
        cases += _cases(layer, [(f"TP {tp}, gpt-oss's layer: {tag}", batch) for tag, batch in _TP_BATCHES])
    # DeepSeek-V3's 128 MLA heads (TP 1: mla-h128; TP 8: mla-h16), with its YaRN scale.
    cases += _cases(
        "mla-h64-d512+64-bf16-p64-scale0.13524",
        [
            ("TP 2, DeepSeek-V3's layer: decode", "1+1,63+1,64+1,65+1,700+1"),
            ("TP 2, DeepSeek-V3's layer: spec-verify k=3", "60+4,900+4"),
            ("TP 2, DeepSeek-V3's layer: mixed, small", "0+24,70+8,700+1x3,50+4x2"),
        ],
    )
    return cases


def _empty_request_cases() -> list[Case]:
    """vLLM's graph padding, empty requests (0+0), run by the backends that claim that style: at
    the end of a batch as vLLM pads, and between real requests (``query_start_loc`` repeating
    mid-batch)."""
    cases = _cases(
        LLAMA3_8B,
        [
            ("empty requests after decodes", "1+1,500+1,3000+1,0+0x5"),
            ("empty requests between spec-verify and prefill", "0+0,300+4,0+0,0+200,1000+1"),
        ],
    )
    cases += _cases("gqa-h64/8-d64-bf16-p16-attnsinks", [("learned sinks, empty requests", "100+1,1000+1,0+0x2")])
    cases += _cases(
        "mla-h16-d512+64-bf16-p64",
        [("empty requests after decodes", "700+1,2500+1,0+0x3"), ("empty request first", "0+0,64+4,900+4")],
    )
    return cases


GPT_OSS = "gqa-h64/8-d64-bf16-p16"  # gpt-oss-20b/120b attention: 64 query heads over 8, head dim 64


def _sink_cases() -> list[Case]:
    """Learned attention sinks on gpt-oss's layer: every path, its alternate layers' window of 128
    (edges: the keys just outside the window dominate), and an fp8 cache; and the log-sum-exp."""
    cases = _cases(
        GPT_OSS + "-attnsinks",
        [
            ("learned sinks: decode", "1+1,100+1,1000+1,3000+1"),
            ("learned sinks: spec-verify k=3", "11+4,300+4,1200+4"),
            ("learned sinks: mixed prefill + decode", "0+200,700+64,3000+1x2,50+4"),
        ],
    )
    cases += _cases(
        GPT_OSS + "-w128-attnsinks-edges",
        [
            ("learned sinks, window 128: decode", "1000+1,127+1,128+1,129+1"),
            ("learned sinks, window 128: mixed", "0+300,700+64,255+1"),
        ],
    )
    cases += _cases("gqa-h64/8-d64-bf16-fp8e4m3-p16-attnsinks", [("fp8, learned sinks: mixed", "0+100,500+4,2000+1")])
    # The log-sum-exp with a sink in it (its term belongs to the denominator a merge weighs by),
    # and MLA decode's (what decode-context parallelism merges).
    cases += _cases(GPT_OSS + "-attnsinks-lse", [("learned sinks, log-sum-exp: mixed", "0+64,300+4,1000+1")])
    cases += _cases("mla-h16-d512+64-bf16-p64-lse", [("log-sum-exp: decode and verify", "700+1,64+4,2500+1")])
    # The log-sum-exp of each query head, not of its KV head's first (or of the query head
    # numbered as its KV head): groups of 8 (Llama-3-70B) and 16 (Qwen3-235B-A22B at TP 2).
    for group, layer in ((8, "gqa-h64/8-d128-bf16-p16-lse"), (16, "gqa-h32/2-d128-bf16-p16-lse")):
        cases += _cases(
            layer,
            [
                (f"log-sum-exp, group of {group}: decode", "1+1,100+1,1000+1"),
                (f"log-sum-exp, group of {group}: spec-verify k=3", "30+4,300+4"),
                (f"log-sum-exp, group of {group}: mixed", "0+24,70+8,300+1x2"),
            ],
        )
    cases += _sparse_cases()
    cases += _tree_cases()
    cases += _fp8_query_cases()
    cases += _dcp_cases()
    return cases


def _dcp_cases() -> list[Case]:
    """Decode context parallelism over 2, 4 and 8 simulated ranks: long and short requests (one
    shorter than the group: ranks holding none of its keys), MLA (DeepSeek's DCP), an fp8 cache,
    an fp8 query, a group of 16 (Qwen3's 64/4), fp16."""
    cases = _cases(
        LLAMA3_8B + "-dcp2",
        [("DCP 2: decode", "1000+1,100+1,3000+1"), ("DCP 2: a one-token request", "0+1,700+1")],
    )
    cases += _cases(LLAMA3_8B + "-dcp4", [("DCP 4: short requests", "1+1,2+1,4+1,500+1")])
    cases += _cases("mla-h16-d512+64-bf16-p64-dcp8", [("DCP 8, MLA: decode", "2500+1,5+1,64+1")])
    cases += _cases("mla-h16-d512+64-bf16-fp8e4m3-p64-dcp2", [("DCP 2, MLA, fp8 cache: decode", "1500+1,1+1")])
    cases += _cases(LLAMA3_8B.replace("-p16", "-qfp8-p16") + "-dcp4", [("DCP 4, fp8 query: decode", "900+1,3+1")])
    cases += _cases("gqa-h64/4-d128-fp16-p32-dcp4", [("DCP 4, group of 16, fp16: decode", "2000+1,6+1")])
    return cases


def _fp8_query_cases() -> list[Case]:
    """An fp8 query (vLLM's quantized query input: e4m3, a per-tensor q scale): every path (a
    decode kernel may be handed the scale where a prefill one is not), with and without an fp8
    cache, MLA, learned sinks with the LSE, a token tree, fp16 and a group of one."""
    query = LLAMA3_8B.replace("-p16", "-qfp8-p16")
    cases = _cases(
        query,
        [
            ("fp8 query: decode", "1+1,100+1,1000+1,3000+1"),
            ("fp8 query: spec-verify k=3", "30+4,300+4,1200+4"),
            ("fp8 query: mixed prefill + decode", "0+200,700+64,3000+1x2,50+4"),
            ("fp8 query: a token tree", "700+tree(3x2),40+1"),
        ],
    )
    cases += _cases(
        LLAMA3_8B.replace("-p16", "-fp8e4m3-qfp8-p16"),
        [("fp8 query, fp8 cache: decode", "1+1,500+1,2000+1"), ("fp8 query, fp8 cache: mixed", "0+100,500+4,2000+1")],
    )
    cases += _cases("mla-h16-d512+64-bf16-qfp8-p64", [("fp8 query, MLA: decode and verify", "700+1,64+4,2500+1")])
    cases += _cases(
        GPT_OSS.replace("-p16", "-qfp8-p16") + "-attnsinks-lse",
        [("fp8 query, learned sinks, log-sum-exp: mixed", "0+64,300+4,1000+1")],
    )
    cases += _cases("gqa-h16/16-d64-fp16-qfp8-p16", [("fp8 query, fp16, group of 1: mixed", "0+40,300+1,90+4")])
    return cases


# Token trees beyond full ones: SGLang's EAGLE (5 steps, top-k 4, 8 drafts) keeps 8 of a top-4
# expansion (a shape like this one), and trees drawn at random (``_random_tree``).
EAGLE_8_OF_TOP4 = "tree[-1.0.0.0.1.1.2.4.5]"


def _random_tree(seed: int, tokens: int) -> str:
    """A tree of ``tokens`` drafts drawn from ``seed``: each token's parent any earlier token (the
    root's the context), as a dynamic tree keeps the likeliest branches."""
    draw = random.Random(seed)
    parents = [-1] + [draw.randrange(index) for index in range(1, tokens)]
    return "tree[" + ".".join(map(str, parents)) + "]"


def _tree_cases() -> list[Case]:
    """EAGLE's token trees verified in one step (top-k > 1): wide, deep, full and partial trees,
    random ones, several different trees in one batch beside decodes, a prefill and an empty
    request, a sliding window whose edge falls inside the tree (edges data: the key just outside
    dominates), sinks, fp8, the LSE, MLA, and groups of 1 to 16 query heads a KV head."""
    mixed = f"3000+tree(4x2),700+{EAGLE_8_OF_TOP4},2000+1x2,0+40,500+{_random_tree(1, 12)}"
    cases = _cases(
        LLAMA3_8B,
        [
            ("tree: top-k 4, depth 2", "3000+tree(4x2)x2,1000+tree(4x2)"),
            ("tree: deep (top-k 2, depth 4)", "2000+tree(2x4),90+tree(2x4)"),
            ("tree: wide (top-k 8, depth 1)", "1500+tree(8x1)x3"),
            ("tree: random trees", f"800+{_random_tree(2, 20)},2500+{_random_tree(3, 9)},60+{_random_tree(4, 30)}"),
            ("tree: with decodes, a prefill and a chain", f"{mixed},300+4"),
            ("tree: beside an empty request", "900+tree(2x2),0+0,50+1"),
            # 63 tokens: past a 32-bit ancestor mask (a tree kernel's word), within triton's 64.
            ("tree: 63 tokens", "700+tree(2x5),40+1"),
        ],
    )
    cases += _cases(
        "gqa-h32/8-d128-bf16-p16-w256-edges", [("tree: a window's edge in the context", "1000+tree(2x4),250+tree(3x2)")]
    )
    # A window shorter than a branch: a deep token's window leaves out its own early ancestors.
    cases += _cases(
        "gqa-h32/8-d128-bf16-p16-w4-edges",
        [("tree: a window shorter than the tree", "10+tree(1x12),5+tree[-1.0.1.2.3.4.5.2.7.8.9]")],
    )
    cases += _cases("gqa-h8/8-d128-bf16-p16-attnsinks-lse", [("tree: sinks and the LSE", "700+tree(3x2),40+1")])
    cases += _cases("gqa-h32/8-d128-bf16-fp8e4m3-p16", [("tree: fp8 cache", f"2000+tree(4x2),900+{EAGLE_8_OF_TOP4}")])
    cases += _cases("gqa-h64/4-d128-bf16-p16", [("tree: group of 16", "1200+tree(4x2),300+1")])
    cases += _cases("mla-h16-d512+64-bf16-p64", [("tree: MLA", f"2000+tree(4x2),700+{EAGLE_8_OF_TOP4}")])
    return cases


def _sparse_cases() -> list[Case]:
    """DeepSeek's sparse attention (DSA): V3.2's top 2048 positions of a lightning indexer over
    128 heads (TP 1) and 16 (TP 8), contexts on both sides of 2048; V4's window part; index rows
    with -1 between entries and entries past each token's position; the LSE; an fp8 cache."""
    cases = _cases(
        "mla-h16-d512+64-bf16-p64-topk2048",
        [
            ("sparse: decode past top-k", "4000+1,2048+1,2049+1,3000+1"),
            ("sparse: decode within top-k", "1+1,100+1,2047+1"),
            ("sparse: spec-verify k=3 (MTP)", "3000+4,500+4"),
            ("sparse: mixed prefill + decode", "0+300,2500+64,4000+1"),
        ],
    )
    cases += _cases(
        "mla-h128-d512+64-bf16-p64-topk2048",
        [("sparse, 128 heads: decode", "5000+1x4,700+1"), ("sparse, 128 heads: spec-verify k=1", "3000+2x4")],
    )
    cases += _cases(
        "mla-h16-d512+64-bf16-p64-topk64-win128-edges",
        [
            ("sparse window part: decode", "1000+1,100+1,127+1,128+1,192+1"),
            ("sparse window part: spec-verify k=3", "1000+4,190+4"),
            ("sparse window part: mixed prefill + decode", "0+300,800+64,3+1"),
        ],
    )
    cases += _cases(
        "mla-h16-d512+64-bf16-p64-topk256-messyidx-edges",
        [("messy index rows: decode and verify", "2000+1,600+4,70+1"), ("messy index rows: mixed", "0+100,900+16")],
    )
    cases += _cases(
        "mla-h16-d512+64-bf16-p64-topk256-win64-lse-edges",
        [("sparse log-sum-exp: mixed", "0+100,700+4,1500+1"), ("sparse log-sum-exp: decode", "300+1,64+1,1000+1")],
    )
    cases += _cases("mla-h16-d512+64-bf16-fp8e4m3-p64-topk256", [("sparse, fp8 cache: mixed", "0+100,900+4,2000+1")])
    # DeepSeek-V3.2 as vLLM serves it: the fp8_ds_mla cache (a scale per 128 latent values a token).
    cases += _cases(
        "mla-h16-d512+64-bf16-fp8dsmla-p64-topk2048",
        [
            ("sparse, fp8_ds_mla: decode and MTP verify", "4000+1,2049+1,3000+4"),
            ("sparse, fp8_ds_mla: mixed", "0+200,2500+16"),
        ],
    )
    # The lightning indexer that chooses those positions: DeepSeek-V3.2's 64 heads of 128 over
    # e4m3 keys with a power-of-two scale a token; bf16 keys; a top-k past and within the context.
    cases += _cases(
        "indexer-h64-d128-bf16-fp8e4m3-p64-topk2048",
        [
            ("indexer: decode past top-k", "4000+1,2048+1,2049+1"),
            ("indexer: MTP verify", "3000+4,700+4"),
            ("indexer: prefill with context, empty request", "0+300,2500+32,0+0"),
        ],
    )
    cases += _cases("indexer-h64-d128-bf16-p64-topk512", [("indexer, bf16 keys: mixed", "0+64,900+4,1500+1")])
    return cases


def full_suite() -> list[Case]:
    """Standard plus long contexts (32k), batch 256 and more layer variants."""
    cases = standard_suite()
    cases += _cases(
        LLAMA3_8B,
        [
            ("long context decode", "32k+1x4,31k+1x4"),
            ("long context spec-verify", "32k+4x2,32760+8"),
            ("decode batch 256", "1000+1x128,3000+1x128"),
            ("long prefill with context", "16k+2048"),
        ],
    )
    cases += _cases(
        "mla-h128-d512+64-bf16-p64", [("long context decode", "32k+1x4"), ("decode batch 256", "1000+1x256")]
    )
    for layer in (
        "gqa-h32/8-d64-bf16-p16",
        "gqa-h32/8-d256-fp16-p64",
        "mha-h32/32-d128-bf16-p32",
        "gqa-h32/4-d128-fp16-p16-w1024-cap50",
    ):
        cases += _cases(layer, _mha_batches(16, rich=False))
    cases += _cases(LLAMA3_8B + "-edges", [("edges: long context", "32k+1x2,32760+4")])
    cases += _cases(LLAMA3_8B + "-outliers-strided", [("large logits, strided: long context", "32k+4x2,16k+1")])
    cases += _cases("gqa-h32/4-d128-fp16-p16-w1024-edges", [("window edges: long context", "8k+1,5000+4,1023+1")])
    cases += _cases(
        "mla-h128-d512+64-bf16-p64-edges",
        [("edges: decode", "63+1,64+1,2000+1x4"), ("edges: spec-verify k=3", "900+4x4")],
    )
    return cases


BENCH_MAX_KV_TOKENS = 2 * 1024 * 1024  # batch x context beyond this is left out (host and GPU memory)


def bench_suite() -> list[Case]:
    """Shapes that matter for speed: decode and spec-verify (query 1, 2, 4, 8) at batch 1 / 8 / 64 /
    256 and context 512 / 4k / 32k (up to 2M cached tokens), GQA 32/8x128 and MLA 128 heads,
    plus a mixed prefill + decode batch, an fp8 cache, DeepSeek's sparse attention with its
    indexer, and a token tree's verify beside a chain's of as many tokens."""
    cases = []
    for layer in (LLAMA3_8B, "mla-h128-d512+64-bf16-p64"):
        batches = []
        for query in (1, 2, 4, 8):
            for batch in (1, 8, 64, 256):
                for context in (512, 4096, 32768):
                    if batch * context <= BENCH_MAX_KV_TOKENS:
                        kind = "decode" if query == 1 else f"verify q={query}"
                        batches.append((f"{kind} b{batch} ctx{context}", f"{context}+{query}x{batch}"))
        cases += _cases(layer, batches)
    cases += _cases(LLAMA3_8B, [("mixed prefill + decode", "0+512,2000+1x32,4000+4x16")])
    # An fp8 cache beside bf16, for the backends that claim it: decode and spec-verify at batch 64.
    cases += _cases(
        LLAMA3_8B + "-fp8e4m3",
        [
            (f"fp8 cache: {kind} b64 ctx{context}", f"{context}+{query}x64")
            for kind, query in (("decode", 1), ("verify q=4", 4))
            for context in (4096, 32768)
            if 64 * context <= BENCH_MAX_KV_TOKENS
        ],
    )
    cases += _sparse_bench_cases()
    # EAGLE's tree verify (top-k 4, depth 2: 21 tokens) beside a chain verify of as many tokens.
    cases += _cases(
        LLAMA3_8B,
        [
            (f"{kind} b{batch} ctx4096", f"4096+{query}x{batch}")
            for batch in (8, 64)
            for kind, query in (("tree verify (4x2)", "tree(4x2)"), ("chain verify q=21", "21"))
        ],
    )
    return cases


def _sparse_bench_cases() -> list[Case]:
    """DeepSeek-V3.2's sparse attention at its top 2048: 128 heads (TP 1) and 16 (TP 8) over bf16
    and fp8_ds_mla, and the lightning indexer that chooses the positions (64 heads of 128, e4m3
    keys), decode at batch 1 to 128 and MTP verify beyond the top-k."""
    wide = [
        (f"sparse {kind} b{batch} ctx{context}", f"{context}+{query}x{batch}")
        for kind, query in (("decode", 1), ("verify q=2", 2))
        for batch in (1, 8, 64, 128)
        for context in (4096, 32768)
        if batch * context <= BENCH_MAX_KV_TOKENS and (query == 1 or batch == 64)
    ]
    tp8 = [(f"sparse TP8: decode b{batch} ctx32768", f"32768+1x{batch}") for batch in (1, 64)]
    cases = _cases("mla-h128-d512+64-bf16-p64-topk2048", wide)
    cases += _cases("mla-h128-d512+64-bf16-fp8dsmla-p64-topk2048", [(f"fp8_ds_mla: {tag}", text) for tag, text in wide])
    cases += _cases("mla-h16-d512+64-bf16-p64-topk2048", tp8)
    cases += _cases("mla-h16-d512+64-bf16-fp8dsmla-p64-topk2048", [(f"fp8_ds_mla: {tag}", text) for tag, text in tp8])
    cases += _cases(
        "indexer-h64-d128-bf16-fp8e4m3-p64-topk2048",
        [
            (f"indexer {kind} b64 ctx{context}", f"{context}+{query}x64")
            for kind, query in (("decode", 1), ("verify q=2", 2))
            for context in (4096, 32768)
        ],
    )
    return cases


SUITES = {
    "smoke": smoke_suite,
    "quick": quick_suite,
    "standard": standard_suite,
    "full": full_suite,
    "bench": bench_suite,
}


def suite(name: str) -> list[Case]:
    if name not in SUITES:
        raise CaseSyntaxError(f"unknown suite {name!r} (choose from {', '.join(SUITES)})")
    return SUITES[name]()


def chosen_cases(case_texts: list[str] | None, suite_name: str, seed: int | None) -> list[Case]:
    """A run's cases, as every entry point reads its options: the ``--case`` texts (a text without
    ``@SEED`` takes ``seed``, else 0), or else the suite, re-seeded when ``seed`` is given (the
    same shapes with new data; the ids say which seed)."""
    if case_texts:
        return [parse_case(text, default_seed=0 if seed is None else seed) for text in case_texts]
    cases = suite(suite_name)
    return cases if seed is None else [replace(case, seed=seed) for case in cases]
