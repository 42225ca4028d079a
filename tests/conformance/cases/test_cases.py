from dataclasses import replace

import pytest
import torch

from conformance.cases.grammar import DEFAULT_PADDING_TOKENS as NUM_PADDING_TOKENS
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.cases.grammar import __doc__ as GRAMMAR
from conformance.cases.suites import suite
from conformance.harness.batch import materialize


@pytest.mark.parametrize("name", ["smoke", "standard", "full"])
def test_every_suite_case_round_trips_through_its_id(name):
    cases = suite(name)
    assert len({case.id for case in cases}) == len(cases), "duplicate case ids"
    for case in cases:
        assert parse_case(case.id) == case


def test_grammar_examples_in_the_docstring_parse():
    examples = [line.split()[0] for line in GRAMMAR.split("Examples:")[1].strip().splitlines()]
    assert len(examples) == 8
    for example in examples:
        parse_case(example)


def test_grammar_details():
    case = parse_case("4k+1x3,0+7")
    assert case.batch == ((4096, 1),) * 3 + ((0, 7),)
    assert (case.spec.num_heads, case.spec.num_kv_heads, case.spec.head_dim, case.spec.block_size) == (32, 8, 128, 16)
    assert case.spec.dtype == torch.bfloat16 and case.seed == 0 and case.permute_blocks

    case = parse_case("mha-h16-d64-fp16-p32-w100-cap30-scale0.5-linear:10+2@9")
    spec = case.spec
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.block_size) == (16, 16, 64, 32)
    assert (spec.sliding_window, spec.logits_soft_cap, spec.scale, case.seed) == (100, 30.0, 0.5, 9)
    assert not case.permute_blocks

    mla = parse_case("mla-h128:4096+1").spec
    assert (mla.kind, mla.num_heads, mla.kv_lora_rank, mla.rope_dim, mla.head_dim, mla.block_size) == (
        "mla",
        128,
        512,
        64,
        576,
        64,
    )
    assert parse_case("100+1", default_seed=5).seed == 5


@pytest.mark.parametrize(
    "text,message",
    [
        ("gqa:4096", r"CTX\+Q"),
        ("gqa:4096+0", "query >= 1"),
        ("gqa:", r"CTX\+Q"),
        ("xyz:1+1", "layer kind"),
        ("gqa-h32/5:1+1", "multiple"),
        ("gqa-q9:1+1", "not understood"),
        ("mla-h16/2:1+1", "one latent KV head"),
        ("gqa-share2:10+1", "share2 needs every context"),
        ("gqa:1+1@x", "seed"),
        ("gqa:1+1x", r"CTX\+Q"),
        # Contradictions, repeats and values that cannot mean anything: refused, never guessed.
        ("mha-h32/8:10+1", "mha has one KV head per query head"),
        ("gqa-fp16-bf16:10+1", "fp16 and bf16 both set the dtype"),
        ("gqa-h32/8-h16:10+1", "both set the heads"),
        ("gqa-strided-strided:10+1", "strided is given twice"),
        ("gqa-w0:10+1", "w0: a sliding window holds at least 1 token"),
        ("gqa-scalenan:10+1", "scale nan: must be a finite number from 0.000001 to 1000000"),
        ("gqa-scale0:10+1", "scale 0: must be"),
        ("gqa-capinf:10+1", "soft cap inf: must be"),
        ("gqa-cap-5:10+1", "not understood"),
        ("99999999999999999999+1", "at most 4194304 tokens per request"),
        ("1+1x100000", "at most 65536 in one batch"),
    ],
)
def test_bad_syntax_says_what_is_wrong(text, message):
    with pytest.raises(CaseSyntaxError, match=message):
        parse_case(text)


def test_mha_means_one_kv_head_per_query_head_and_seeds_are_checked():
    assert parse_case("mha:10+1").spec.num_kv_heads == parse_case("mha:10+1").spec.num_heads == 32
    assert parse_case("mha-h16/16:10+1").id == parse_case("mha-h16:10+1").id
    with pytest.raises(CaseSyntaxError, match="seed -1"):
        parse_case("gqa:10+1", default_seed=-1)


def test_unknown_suite():
    with pytest.raises(CaseSyntaxError, match="unknown suite"):
        suite("huge")


def test_standard_and_full_cover_what_the_contract_promises():
    standard, full = suite("standard"), suite("full")
    specs = {case.spec for case in standard}
    query_lens = {q for case in standard for _, q in case.batch}
    assert {2, 4, 8} <= query_lens  # spec-verify k = 1, 3, 7
    assert any(all(q == 1 for _, q in case.batch) for case in standard)  # pure decode
    assert any(c > 0 and q > 100 for case in standard for c, q in case.batch)  # chunked prefill with context
    assert any({q for _, q in case.batch} >= {1} and max(q for _, q in case.batch) > 50 for case in standard)  # mixed
    assert any(case.batch == ((0, 1),) for case in standard)  # length 1
    assert any(case.num_reqs == 1 for case in standard) and any(case.num_reqs >= 128 for case in standard)
    assert any(case.shared_prefix_blocks for case in standard)
    assert any(not case.permute_blocks for case in standard) and any(case.permute_blocks for case in standard)
    assert max(case.max_seq_len for case in full) >= 32 * 1024
    assert {s.head_dim for s in specs if s.kind == "mha"} >= {64, 128, 256}
    assert {s.num_heads for s in specs if s.kind == "mla"} >= {16, 128}
    assert {s.dtype for s in specs} == {torch.float16, torch.bfloat16, torch.float32}
    assert {s.block_size for s in specs} >= {16, 32, 64}
    assert any(s.sliding_window for s in specs) and any(s.logits_soft_cap for s in specs)
    assert any(s.num_heads == s.num_kv_heads for s in specs if s.kind == "mha")  # MHA
    assert any((s.num_heads, s.num_kv_heads, s.head_dim) == (32, 8, 128) for s in specs)  # Llama-3-8B
    # Lengths at, below and above block boundaries.
    for block in (16, 32, 64):
        seq_lens = {c + q for case in standard if case.spec.block_size == block for c, q in case.batch}
        assert {block - 1, block, block + 1} <= seq_lens


def test_materialize_is_reproducible_and_never_hands_out_block_zero():
    case = parse_case("gqa-h4/2-d16-p16-share2:40+1,32+4,60+1@3")
    first, second = materialize(case, "cpu"), materialize(case, "cpu")
    assert torch.equal(first.query, second.query) and torch.equal(first.block_table, second.block_table)
    assert all(torch.equal(a, b) for a, b in zip(first.keys, second.keys))
    table = first.block_table
    used = [table[r, : -(-(c + q) // 16)] for r, (c, q) in enumerate(case.batch)]
    assert all((row > 0).all() for row in used), "block 0 is reserved"
    # Shared prefix: same physical blocks and the same data.
    assert torch.equal(table[1, :2], table[0, :2]) and torch.equal(table[2, :2], table[0, :2])
    assert torch.equal(first.keys[2][:32], first.keys[0][:32])
    # Every other block is owned by exactly one request.
    owned = torch.cat([used[0]] + [row[2:] for row in used[1:]])
    assert len(set(owned.tolist())) == owned.numel() == first.num_blocks - 1
    # The pool's last block holds cached tokens (so a write to slot -1 corrupts something).
    last = first.num_blocks - 1
    request, index = next((r, i) for r, row in enumerate(used) for i, b in enumerate(row.tolist()) if b == last)
    assert (index + 1) * 16 <= case.batch[request][0]


def test_different_seeds_give_different_data():
    a = materialize(parse_case("gqa-h4/2-d16:20+2@1"), "cpu")
    b = materialize(parse_case("gqa-h4/2-d16:20+2@2"), "cpu")
    assert not torch.equal(a.query, b.query)


def test_step_rows_end_with_padding_that_writes_nothing():
    batch = materialize(parse_case("gqa-h4/2-d16:20+2,5+1"), "cpu")
    key, value, slots = batch.step_rows()
    assert key.shape[0] == value.shape[0] == slots.shape[0] == 3 + NUM_PADDING_TOKENS
    assert slots[-NUM_PADDING_TOKENS:].tolist() == [-1] * NUM_PADDING_TOKENS
    common = batch.common_metadata(with_host_lengths=False)
    assert common.max_seq_len == 22 and common.max_query_len == 2 and not common.has_host_seq_lens


def test_layout_and_data_attributes_round_trip_and_reject_nonsense():
    case = parse_case("gqa-h4/2-d16-strided-pad0-edges:20+2")
    assert case.strided and case.padding == 0 and case.data == "edges"
    assert parse_case(case.id) == case and "strided-pad0-edges" in case.id
    assert parse_case("gqa-h4/2-d16:20+2").id == "gqa-h4/2-d16-bf16-p16:20+2@0"  # defaults stay out of the id
    for bad, message in (
        ("gqa-outliers-edges:1+1", "both set the data profile"),
        ("gqa-pad5000:1+1", "padding rows must be"),
    ):
        with pytest.raises(CaseSyntaxError, match=message):
            parse_case(bad)


def test_a_big_pool_puts_every_owned_block_past_two_to_the_31_elements_of_its_plane_and_id_two_to_the_16():
    from conformance.harness.batch import (
        BIG_POOL_BLOCK_IDS,
        BIG_POOL_ELEMENTS,
        assign_blocks,
        big_pool_skip_reason,
        case_generator,
        pool_size,
    )

    big = [case for case in suite("standard") if case.big_pool]
    assert {case.spec.kind for case in big} == {"mha", "mla"} and parse_case(big[0].id) == big[0]
    for case in big:
        spec = case.spec
        plane_block = spec.block_size * (spec.head_dim if spec.kind == "mla" else spec.num_kv_heads * spec.head_dim)
        table, num_blocks = assign_blocks(case, case_generator(case))
        owned = table[table > 0]
        assert int(owned.min()) >= BIG_POOL_BLOCK_IDS == 2**16
        assert (
            int(owned.min()) * plane_block >= BIG_POOL_ELEMENTS
            and num_blocks == pool_size(case) == int(owned.max()) + 1
        )
        small = replace(case, big_pool=False)
        assert pool_size(small) * plane_block < BIG_POOL_ELEMENTS // 16  # the other cases' pools stay far below
        assert big_pool_skip_reason(case, torch.device("cpu")).startswith("bigpool runs on a GPU")
        assert big_pool_skip_reason(small, torch.device("cpu")) is None


def test_the_quick_suite_keeps_every_layer_of_the_standard_suite_and_only_its_smaller_cases():
    from conformance.cases.suites import QUICK_KV_ELEMENTS

    quick, standard = suite("quick"), suite("standard")
    small = [case for case in standard if case.kv_elements <= QUICK_KV_ELEMENTS]
    assert set(small) <= set(quick) < set(standard)

    def layers(cases):
        return {(case.spec, case.layer_options) for case in cases}

    assert layers(quick) == layers(standard)
    # A larger case only where its layer has no small one, and then its layer's smallest.
    for case in set(quick) - set(small):
        same_layer = [other for other in standard if layers([other]) == layers([case])]
        assert not set(same_layer) & set(small) and case.kv_elements == min(other.kv_elements for other in same_layer)
