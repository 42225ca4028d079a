"""The bench's rule for the two loops' tokens (``loop_tokens``): a parting is explained only by
greedy near ties between loops that repeat themselves and batched their steps apart."""

import pytest

from reference_engine.equality import Divergence
from reference_engine.loop_tokens import compare_loops

SYNC = [[1, 2, 3, 4], [5, 6, 7, 8]]
FLIPPED = [[1, 2, 3, 4], [5, 6, 9, 8]]  # prompt 1 parts at position 2
APART, ALIKE = ([(2, 8), (2, 6)], [(2, 8), (1, 3)]), ([(2, 8)], [(2, 8)])


def rescore_as(near_tie: bool, behind: float = 0.05):
    calls = []

    def rescore(index, a, b):
        calls.append((index, a, b))
        return Divergence(index, 2, a[2], b[2], behind, 1, 0, behind, near_tie)

    return rescore, calls


def test_the_same_tokens_need_no_rescore():
    rescore, calls = rescore_as(True)
    tokens = compare_loops([SYNC, SYNC], [SYNC], *APART, rescore)
    assert tokens.same and tokens.explained and tokens.note() == "" and not calls


def test_a_near_tie_between_loops_that_batched_apart_is_explained():
    rescore, calls = rescore_as(True)
    tokens = compare_loops([SYNC, SYNC], [FLIPPED, FLIPPED], *APART, rescore)
    assert tokens.explained and tokens.steps_batched_apart == 1 and calls == [(1, SYNC[1], FLIPPED[1])]
    assert tokens.note() == " (tokens part at 1 near tie, within 0.05 of fp32's top)"
    assert tokens.to_json()["tokens_part"][1]["index"] == 2


@pytest.mark.parametrize(
    "sync_runs, async_runs, batches, near_tie",
    [
        ([SYNC], [FLIPPED], ALIKE, True),  # the same steps in both loops: nothing to flip a tie
        ([SYNC], [FLIPPED], (None, None), True),  # steps unknown
        ([SYNC, FLIPPED], [FLIPPED], APART, True),  # a loop that does not repeat itself
        ([SYNC], [FLIPPED, SYNC], APART, True),
        ([SYNC], [FLIPPED], APART, False),  # not a near tie
    ],
)
def test_anything_else_is_a_difference(sync_runs, async_runs, batches, near_tie):
    rescore, _ = rescore_as(near_tie)
    tokens = compare_loops(sync_runs, async_runs, *batches, rescore)
    assert not tokens.same and not tokens.explained and tokens.note() == " (TOKENS DIFFER)"


@pytest.mark.parametrize("async_tokens", [[[1, 2, 3, 4], [5, 6, 7]], FLIPPED])
def test_a_parting_without_a_rescore_is_unexplained(async_tokens):
    """A length difference has no token to score; a re-score that could not be made returns None."""
    tokens = compare_loops([SYNC], [async_tokens], *APART, lambda index, a, b: None)
    assert tokens.unscored == [1] and not tokens.explained and tokens.to_json()["tokens_part"] == [None, None]
