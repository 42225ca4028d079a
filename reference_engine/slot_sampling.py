"""The batched engine's sampling parameters by device-state slot: each running request's seed,
temperature, top-k and top-p as device tensors, and the distributions its drafts were drawn from,
so that rejection and the drafters read them by slot without the host.

Randomness comes from counters: a request's seed and output position hashed
(``sampling.counter_uniform``), never a generator, so sync and async runs draw the same numbers
and graphs replay them. Each use draws on a lane of its own.
"""

from __future__ import annotations

import torch

from reference_engine.sampling import SamplingParams

# Lanes of the counter-based noise: one per use, so no two uses share numbers.
SCRIPT_LANE, DRAFT_LANE, ACCEPT_LANE, RECOVER_LANE, BONUS_LANE = range(5)


class SlotSampling:
    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.seed = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.draft_probabilities: torch.Tensor | None = None  # [slots, k, V], from the first generate() that samples

    def prepare(self, params_list: list[SamplingParams], num_spec_tokens: int, vocab_size: int) -> bool:
        """A generate() call starts: whether some request of it samples (its drafts' distributions
        then matter, and are allocated once)."""
        sampling = not all(p.greedy for p in params_list)
        if sampling and self.draft_probabilities is None and num_spec_tokens:
            self.draft_probabilities = torch.zeros(
                self.seed.shape[0], num_spec_tokens, vocab_size, device=self.seed.device
            )
        return sampling

    def enter(self, slot: int, params: SamplingParams, seed: int) -> None:
        self.seed[slot] = seed
        self.temperature[slot] = params.temperature
        self.top_k[slot] = params.top_k
        self.top_p[slot] = params.top_p
