"""Rejection sampling for speculative decoding, batched on the device with no host sync.

For each request: drafts d_1..d_n (n <= k, padded to k), the drafter's distributions q_i and the
target's p_1..p_{n+1}. Greedy: accept d_i while it equals argmax p_i; the first mismatch emits
argmax p_i instead; if all n are accepted the bonus token argmax p_{n+1} follows. Probabilistic
(Leviathan et al., Chen et al.): accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the
first rejection emit a sample of normalize(max(p_i - q_i, 0)); if all are accepted, emit a bonus
sample of p_{n+1}. Either way the emitted tokens follow the target distribution exactly.

Output: tokens [B, k + 1], -1 past each request's emitted length, and the emitted count [B]
(accepted drafts + 1).
"""

from __future__ import annotations

import torch

from reference_engine.sampling import gumbel_argmax

PLACEHOLDER = -1


def _emit(drafts: torch.Tensor, accepted: torch.Tensor, final_tokens: torch.Tensor, num_drafts: torch.Tensor):
    """Accepted drafts, then the token at the first rejection (or the bonus), then -1."""
    batch, k = drafts.shape
    positions = torch.arange(k + 1, device=drafts.device)
    accepted = accepted & (positions[:k] < num_drafts[:, None])
    # The number accepted is the length of the all-accepted prefix.
    num_accepted = torch.cumprod(accepted.int(), dim=1).sum(dim=1)
    tokens = torch.full((batch, k + 1), PLACEHOLDER, dtype=torch.long, device=drafts.device)
    tokens[:, :k] = torch.where(positions[None, :k] < num_accepted[:, None], drafts, PLACEHOLDER)
    final = final_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    tokens.scatter_(1, num_accepted[:, None], final[:, None])
    return tokens, num_accepted + 1


def greedy_rejection(drafts: torch.Tensor, target_probabilities: torch.Tensor, num_drafts: torch.Tensor):
    """drafts [B, k]; target_probabilities [B, k + 1, V] (row i scores the token after i drafts)."""
    target_argmax = target_probabilities.argmax(dim=-1)  # [B, k + 1]
    accepted = drafts == target_argmax[:, :-1]
    return _emit(drafts, accepted, target_argmax, num_drafts)


def probabilistic_rejection(
    drafts: torch.Tensor,
    draft_probabilities: torch.Tensor,
    target_probabilities: torch.Tensor,
    num_drafts: torch.Tensor,
    generator: torch.Generator | None = None,
):
    """drafts [B, k]; draft_probabilities [B, k, V]; target_probabilities [B, k + 1, V]."""
    batch, k = drafts.shape
    vocab = target_probabilities.shape[-1]

    def uniform(*shape):
        return torch.rand(shape, generator=generator, device=drafts.device)

    return rejection_with_noise(
        drafts,
        draft_probabilities,
        target_probabilities,
        num_drafts,
        uniform(batch, k),
        uniform(batch, k, vocab),
        uniform(batch, k + 1, vocab),
    )


def rejection_with_noise(
    drafts,
    draft_probabilities,
    target_probabilities,
    num_drafts,
    accept_uniform: torch.Tensor,
    recover_uniform: torch.Tensor,
    bonus_uniform: torch.Tensor,
):
    """``probabilistic_rejection`` with its uniforms given ([B, k], [B, k, V], [B, k + 1, V]): the
    batched engine draws them from counters so a request's randomness ignores batching."""
    k = drafts.shape[1]
    p_of_draft = target_probabilities[:, :k].gather(2, drafts[:, :, None]).squeeze(2)
    q_of_draft = draft_probabilities.gather(2, drafts[:, :, None]).squeeze(2)
    accepted = acceptance(p_of_draft, q_of_draft, accept_uniform)
    recovered = gumbel_argmax(residual_distribution(target_probabilities[:, :k], draft_probabilities), recover_uniform)
    bonus = gumbel_argmax(target_probabilities, bonus_uniform)  # [B, k + 1]: bonus[n] follows n accepted drafts
    return _emit(drafts, accepted, final_tokens(recovered, bonus, num_drafts), num_drafts)


def acceptance(p_of_draft: torch.Tensor, q_of_draft: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Accept each draft with probability min(1, p(d) / q(d))."""
    return uniform * q_of_draft < p_of_draft  # u < p/q without dividing by a zero q


def residual_distribution(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)): what a rejected position is resampled from."""
    residual = (target - draft).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # Where p <= q everywhere the residual is empty; rejection is then impossible, any row works.
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), target)


def final_tokens(recovered: torch.Tensor, bonus: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """[B, k + 1]: the token emitted after i accepted drafts — recovered at a rejection, the bonus
    sample of p_{n+1} after all n drafts (a request with n < k drafts takes it at index n)."""
    k = recovered.shape[1]
    final = torch.cat([recovered, bonus[:, k:]], dim=1)
    positions = torch.arange(k + 1, device=recovered.device)
    return torch.where(positions[None, :] == num_drafts[:, None], bonus, final)
