"""The bench's rule for the two loops' tokens (``loop_tokens``): a parting is explained only by
greedy near ties between loops that repeat themselves, where the parting prompt's own steps were
batched apart."""

import pytest

from reference_engine.equality import Divergence
from reference_engine.loop_tokens import StepBatch, compare_loops, steps_before

SYNC = [[1, 2, 3, 4], [5, 6, 7, 8]]
FLIPPED = [[1, 2, 3, 4], [5, 6, 9, 8]]  # prompt 1 parts at position 2 (emitted by the second step)
PREFILL = StepBatch(((0, 8), (1, 8)), {0: 1, 1: 1})
BOTH = StepBatch(((0, 4), (1, 4)), {0: 2, 1: 2})
LAST_0, LAST_1 = StepBatch(((0, 4),), {0: 1}), StepBatch(((1, 4),), {1: 1})
SYNC_STEPS = [PREFILL, BOTH, LAST_0, LAST_1]
# prompt 1's second step shared with nobody in async: its token 2 scored in another batch
APART = (SYNC_STEPS, [PREFILL, StepBatch(((1, 4),), {1: 2}), StepBatch(((0, 4),), {0: 2}), LAST_0, LAST_1])
ALIKE = (SYNC_STEPS, SYNC_STEPS)
# steps differ only after prompt 1's token 2 was emitted: nothing that scored it was batched apart
APART_ELSEWHERE = (SYNC_STEPS, [PREFILL, BOTH, StepBatch(((0, 4), (1, 4)), {0: 1, 1: 1})])


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
    assert tokens.explained and tokens.steps_batched_apart == 3 and calls == [(1, SYNC[1], FLIPPED[1])]
    assert tokens.note() == " (tokens part at 1 near tie, within 0.05 of fp32's top)"
    assert tokens.to_json()["tokens_part"][1]["index"] == 2
    assert tokens.to_json()["tokens_part_batched_apart"] == [None, True]


def test_a_step_shared_with_another_parting_prompt_counts_as_apart():
    """Prompt 0 parts too (its tokens may change the batch's lengths, which a backend's plan can
    split the work by), and shares prompt 1's steps: prompt 1's flip is explained."""
    rescore, _ = rescore_as(True)
    both_flipped = [[1, 2, 3, 7], FLIPPED[1]]
    tokens = compare_loops([SYNC], [both_flipped], *ALIKE, rescore)
    assert tokens.parted_apart == [True, True] and tokens.explained
    alone = compare_loops([SYNC], [FLIPPED], *ALIKE, rescore)
    assert alone.parted_apart == [None, False] and not alone.explained


def test_a_prompts_steps_are_those_up_to_the_one_that_emitted_the_token():
    assert steps_before(SYNC_STEPS, 1, 0) == (PREFILL.rows,)
    assert steps_before(SYNC_STEPS, 1, 2) == (PREFILL.rows, BOTH.rows)
    assert steps_before(SYNC_STEPS, 1, 3) == (PREFILL.rows, BOTH.rows, LAST_1.rows)
    assert steps_before(SYNC_STEPS, 1, 4) is None  # never emitted


@pytest.mark.parametrize(
    "sync_runs, async_runs, batches, near_tie, why",
    [
        ([SYNC], [FLIPPED], ALIKE, True, "prompt 1's steps batched alike"),  # nothing to flip a tie
        ([SYNC], [FLIPPED], APART_ELSEWHERE, True, "prompt 1's steps batched alike"),  # others differ
        ([SYNC], [FLIPPED], (None, None), True, "prompt 1's steps not recorded"),
        ([SYNC, FLIPPED], [FLIPPED], APART, True, "a loop does not repeat itself"),
        ([SYNC], [FLIPPED, SYNC], APART, True, "a loop does not repeat itself"),
        ([SYNC], [FLIPPED], APART, False, "prompt 1 is not a near tie"),
    ],
)
def test_anything_else_is_a_difference(sync_runs, async_runs, batches, near_tie, why):
    rescore, _ = rescore_as(near_tie)
    tokens = compare_loops(sync_runs, async_runs, *batches, rescore)
    assert not tokens.same and not tokens.explained and tokens.note() == f" (TOKENS DIFFER: {why})"


@pytest.mark.parametrize("async_tokens", [[[1, 2, 3, 4], [5, 6, 7]], FLIPPED])
def test_a_parting_without_a_rescore_is_unexplained(async_tokens):
    """A length difference has no token to score; a re-score that could not be made returns None."""
    tokens = compare_loops([SYNC], [async_tokens], *APART, lambda index, a, b: None)
    assert tokens.unscored == [1] and not tokens.explained and tokens.to_json()["tokens_part"] == [None, None]
    assert tokens.note() == " (TOKENS DIFFER: prompt 1 not re-scored)"
