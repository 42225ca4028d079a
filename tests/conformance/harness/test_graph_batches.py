"""Graph batch planning per CGSupport level and the replay sequence (CPU)."""

import pytest

from backends.base import CGSupport
from conformance.cases.grammar import parse_case
from conformance.harness.batch import materialize
from conformance.harness.graph_batches import (
    NO_PADDING,
    fits,
    graph_class_reason,
    graph_shape,
    padding_rows,
    replay_batches,
)

DECODE = parse_case("gqa-h4/2-d32-fp16-p16:100+1,30+1,7+1")
VERIFY = parse_case("gqa-h4/2-d32-fp16-p16:100+4,30+4")
MIXED = parse_case("gqa-h4/2-d32-fp16-p16:0+40,100+4,30+1")


@pytest.mark.parametrize(
    "support,allowed",
    [
        (CGSupport.NEVER, []),
        (CGSupport.UNIFORM_SINGLE_TOKEN_DECODE, [DECODE]),
        (CGSupport.UNIFORM_BATCH, [DECODE, VERIFY]),
        (CGSupport.ALWAYS, [DECODE, VERIFY, MIXED]),
    ],
)
def test_batches_covered_by_each_level(support, allowed):
    for case in (DECODE, VERIFY, MIXED):
        assert (graph_class_reason(support, case) is None) == (case in allowed)


@pytest.mark.parametrize("case", [DECODE, VERIFY, MIXED])
def test_each_replay_changes_what_it_claims_and_stays_in_class(case):
    support = CGSupport.ALWAYS if case is MIXED else CGSupport.UNIFORM_BATCH
    replays = replay_batches(case, support)
    by_kind = {replay.description.split(" (")[0]: replay.case for replay in replays}
    longer, shorter = by_kind["longer contexts"], by_kind["shorter contexts"]
    assert longer.max_seq_len > case.max_seq_len and shorter.max_seq_len < case.max_seq_len
    assert materialize(longer, "cpu").block_table.shape[1] > materialize(case, "cpu").block_table.shape[1]
    reblocked = by_kind["new block-table contents"]
    assert reblocked.batch == case.batch
    assert not materialize(reblocked, "cpu").block_table.equal(materialize(case, "cpu").block_table)
    assert by_kind["fewer real requests, more padding rows"].num_reqs < case.num_reqs
    if case is MIXED:
        moved = by_kind["query lengths moved between requests"]
        assert [q for _, q in moved.batch] != [q for _, q in case.batch]
    for replay in replays:
        assert graph_class_reason(support, replay.case) is None, replay.description


@pytest.mark.parametrize("case", [DECODE, VERIFY, MIXED])
def test_every_replay_fits_the_padded_shape(case):
    support = CGSupport.ALWAYS if case is MIXED else CGSupport.UNIFORM_BATCH
    replays = replay_batches(case, support)
    shape = graph_shape(case, replays)
    assert shape.num_reqs == case.num_reqs + 1  # A has one padding row
    full = [r.case for r in replays if r.description == NO_PADDING]
    assert len(full) == 1 and full[0].num_reqs == shape.num_reqs and fits(shape, full[0])  # one replay has none
    for candidate in [case] + [r.case for r in replays]:
        padding = padding_rows(shape, candidate)
        assert len(padding) + candidate.num_reqs == shape.num_reqs and all(q >= 1 for q in padding)
        assert candidate.num_tokens + sum(padding) == shape.num_tokens
        assert candidate.max_seq_len <= shape.max_model_len
        if shape.uniform and padding:
            assert set(padding) == {q for _, q in case.batch}


def test_replays_put_another_request_last():
    replays = {r.description: r.case for r in replay_batches(DECODE, CGSupport.UNIFORM_BATCH)}
    reversed_case = next(c for d, c in replays.items() if d.startswith("requests in reverse order"))
    assert reversed_case.batch[-1] == DECODE.batch[0]
