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


def test_a_step_shared_with_a_prompt_after_it_parted_counts_as_apart():
    """Prompt 0 parts at its token 1 (step 1); prompt 1 shares step 2 with it after that, when
    prompt 0's tokens, and so its lengths, may differ between the loops (a backend's plan may split
    the batch's work by them): prompt 1's flip at token 3 is explained. Prompt 0's own steps up to
    its token 1 shared nothing with a parted prompt and were batched alike: not explained."""
    rescore, _ = rescore_as(True)
    steps = [PREFILL, BOTH, StepBatch(((0, 4), (1, 4)), {0: 1, 1: 1})]
    tokens = compare_loops([SYNC], [[[1, 9, 3, 4], [5, 6, 7, 9]]], steps, steps, rescore)
    assert tokens.parted_apart == [False, True] and not tokens.explained
    later = compare_loops([SYNC], [[[1, 2, 3, 9], [5, 6, 9, 8]]], steps, steps, rescore)
    # the other way round: prompt 1 parts at step 1 and shares step 2 with prompt 0, whose token 3
    # comes from step 2; prompt 1's own steps end before prompt 0 parts
    assert later.parted_apart == [True, False]


def test_a_step_handed_another_max_seq_len_counts_as_apart():
    """Async hands an eager step the host's upper bound of the lengths, sync the exact ones: a
    backend that reads max_seq_len may split differently, so the steps differ."""
    rescore, _ = rescore_as(True)
    sync = [StepBatch(step.rows, step.emitted, (40, False)) for step in SYNC_STEPS]
    upper = [StepBatch(step.rows, step.emitted, (43 if i == 1 else 40, False)) for i, step in enumerate(SYNC_STEPS)]
    assert compare_loops([SYNC], [FLIPPED], sync, upper, rescore).explained
    assert not compare_loops([SYNC], [FLIPPED], sync, sync, rescore).explained


def test_a_prompts_steps_are_those_up_to_the_one_that_emitted_the_token():
    assert steps_before(SYNC_STEPS, 1, 0) == [0]
    assert steps_before(SYNC_STEPS, 1, 2) == [0, 1]
    assert steps_before(SYNC_STEPS, 1, 3) == [0, 1, 3]
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
