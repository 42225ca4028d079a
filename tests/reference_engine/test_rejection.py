"""Rejection sampling is lossless: emitted tokens follow the target distribution whatever the
drafter proposes. Checked statistically on a small vocabulary with known p and q; planted wrong
samplers must fail the same checks."""

import pytest
import torch

from reference_engine import rejection
from reference_engine.sampling import SamplingParams, filtered_probabilities, sample

VOCAB, DRAFTS, ROWS = 5, 2, 200_000


def distributions(seed=0):
    generator = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(DRAFTS + 1, VOCAB, generator=generator) * 1.5, dim=-1)
    draft = torch.softmax(torch.randn(DRAFTS, VOCAB, generator=generator) * 1.5, dim=-1)
    return target, draft


def run(seed=1):
    target, draft = distributions()
    generator = torch.Generator().manual_seed(seed)
    drafts = torch.stack(
        [torch.multinomial(draft[i], ROWS, replacement=True, generator=generator) for i in range(DRAFTS)], dim=1
    )
    tokens, emitted = rejection.probabilistic_rejection(
        drafts, draft.expand(ROWS, -1, -1), target.expand(ROWS, -1, -1), torch.full((ROWS,), DRAFTS), generator
    )
    return target, draft, tokens, emitted


def within(frequencies, expected, rows):
    sigma = (expected * (1 - expected) / rows).sqrt()
    return bool(((frequencies - expected).abs() <= 5 * sigma + 1e-3).all())


def lossless(target, draft, tokens) -> bool:
    first = torch.bincount(tokens[:, 0], minlength=VOCAB).double() / ROWS
    if not within(first, target[0].double(), ROWS):
        return False
    # Tokens of these context-free distributions are independent: position j follows p_j.
    for position in range(1, DRAFTS + 1):
        present = tokens[:, position] >= 0
        rows = int(present.sum())
        counts = torch.bincount(tokens[present, position], minlength=VOCAB).double() / max(rows, 1)
        all_accepted = torch.minimum(target[:position], draft[:position]).sum(-1).prod().item()
        if not (within(counts, target[position].double(), rows) and abs(rows / ROWS - all_accepted) < 0.01):
            return False
    return True


def test_probabilistic_rejection_preserves_the_target_distribution():
    target, draft, tokens, emitted = run()
    assert lossless(target, draft, tokens)
    assert torch.equal(emitted, (tokens >= 0).sum(dim=1))


def test_planted_resample_from_target_fails(monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda target, draft: target)
    assert not lossless(*run()[:3])


def test_planted_missing_bonus_token_fails(monkeypatch):
    def no_bonus(recovered, bonus, num_drafts):
        final = torch.cat([recovered, torch.full_like(bonus[:, :1], rejection.PLACEHOLDER)], dim=1)
        return final

    monkeypatch.setattr(rejection, "final_tokens", no_bonus)
    assert not lossless(*run()[:3])


def test_planted_deterministic_acceptance_fails(monkeypatch):
    """Accepting when p(d) >= q(d) instead of with probability min(1, p/q)."""
    monkeypatch.setattr(rejection, "acceptance", lambda p, q, uniform: p >= q)
    assert not lossless(*run()[:3])


def test_greedy_rejection_emits_the_target_argmax_sequence():
    target = torch.tensor([[[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]]).repeat(4, 1, 1)
    drafts = torch.tensor([[1, 0], [1, 2], [2, 0], [1, 0]])
    tokens, emitted = rejection.greedy_rejection(drafts, target, torch.tensor([2, 2, 2, 1]))
    assert tokens.tolist() == [[1, 0, 2], [1, 0, -1], [1, -1, -1], [1, 0, -1]]
    assert emitted.tolist() == [3, 2, 1, 2]


def test_padded_drafts_take_their_bonus_from_the_right_position():
    target, draft = distributions()
    drafts = torch.tensor([[int(target[0].argmax()), 0]])
    fixed_draft = torch.zeros(1, DRAFTS, VOCAB)
    fixed_draft[0, 0, drafts[0, 0]] = 1.0  # a certain draft, accepted with probability p(d)
    fixed_draft[0, 1] = 1.0 / VOCAB
    counts = torch.zeros(VOCAB)
    for seed in range(2000):
        generator = torch.Generator().manual_seed(seed)
        tokens, emitted = rejection.probabilistic_rejection(
            drafts, fixed_draft, target[None], torch.tensor([1]), generator
        )
        assert tokens[0, 2] == -1 and emitted[0] <= 2
        if tokens[0, 0] == drafts[0, 0] and emitted[0] == 2:
            counts[tokens[0, 1]] += 1
    assert within(counts.double() / counts.sum(), target[1].double(), int(counts.sum()))


def test_sampling_filters_and_is_seeded():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert filtered_probabilities(logits, 1.0, top_k=2)[0, 2:].sum() == 0
    top_p = filtered_probabilities(logits, 1.0, top_p=0.6)
    assert top_p[0, 0] == 1.0  # the first token alone reaches 0.6
    probabilities = filtered_probabilities(logits, 0.7)
    first = sample(probabilities.expand(1000, -1), torch.Generator().manual_seed(3))
    again = sample(probabilities.expand(1000, -1), torch.Generator().manual_seed(3))
    assert torch.equal(first, again)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
