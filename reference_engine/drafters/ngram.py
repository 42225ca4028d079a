"""The n-gram drafter (``ngram[:N]``), prompt lookup: the tokens that followed the most recent
earlier occurrence of the request's last n tokens (n from N, default 3, down to 1) in its own
prompt and output. No model, no attention; real text repeats itself, random models loop.

The per-request loop applies the rule as written (``ngram_drafts``) to the request's tokens on the
host; the batched loop keeps each slot's tokens on the device, appends what every step commits,
and looks up all rows at once (``ngram_drafts_on_device``).
"""

from __future__ import annotations

import torch

from reference_engine.drafters.base import Drafter, DraftStep, Proposal, Verified, certain, request_rows
from reference_engine.request import Request
from reference_engine.sampling import SamplingParams


def ngram_drafts(tokens: list[int], k: int, max_n: int) -> list[int]:
    """The n-gram drafter's rule, written for reading (``ngram_drafts_on_device`` must agree): for
    the longest n <= max_n whose last n tokens occur earlier in ``tokens``, the k tokens after the
    most recent such occurrence; past the end of ``tokens``, and without any match, the last token
    repeated."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), 0, -1):
        suffix = tokens[length - n :]
        starts = [s for s in range(length - n) if tokens[s : s + n] == suffix]
        if starts:
            follow = starts[-1] + n
            return [tokens[follow + j] if follow + j < length else tokens[-1] for j in range(k)]
    return [tokens[-1]] * k


def ngram_drafts_on_device(history: torch.Tensor, lengths: torch.Tensor, k: int, max_n: int) -> torch.Tensor:
    """``ngram_drafts`` for a batch, on the device, without a sync or a data-dependent shape (it
    runs inside CUDA graphs): ``history`` [rows, W] holds each row's tokens, ``lengths`` [rows]
    how many are valid. Returns drafts [rows, k]."""
    rows, width = history.shape
    lengths = lengths.long()[:, None]
    starts = torch.arange(width, device=history.device)[None, :]
    best_start = torch.full((rows, 1), -1, dtype=torch.long, device=history.device)
    best_n = torch.zeros((rows, 1), dtype=torch.long, device=history.device)
    for n in range(1, max_n + 1):  # a longer match found later wins
        match = starts < lengths - n  # an occurrence strictly before the suffix itself
        for i in range(n):
            suffix = history.gather(1, (lengths - n + i).clamp(min=0))
            shifted = torch.cat([history[:, i:], history[:, :i]], dim=1)  # shifted[:, s] = history[:, s + i]
            match &= shifted == suffix
        found = torch.where(match, starts, -1).amax(dim=1, keepdim=True)
        best_start = torch.where(found >= 0, found, best_start)
        best_n = torch.where(found >= 0, n, best_n)
    last = history.gather(1, (lengths - 1).clamp(min=0))
    follow = best_start + best_n + torch.arange(k, device=history.device)[None, :]
    drafts = history.gather(1, follow.clamp(0, width - 1))
    return torch.where((best_start >= 0) & (follow < lengths), drafts, last)


class NgramDrafter(Drafter):
    name = "ngram"
    usage = "ngram[:N]"

    def __init__(self, max_n: int = 3) -> None:
        self.max_n = max_n  # the longest suffix looked up; down to 1

    @classmethod
    def parse(cls, argument: str | None, num_target_layers: int) -> NgramDrafter:
        max_n = argument or "3"
        if not max_n.isdigit() or int(max_n) < 1:
            raise ValueError(f"ngram:N needs a whole N >= 1, not {max_n!r}")
        return cls(int(max_n))

    # --- the per-request loop: the rule over the request's tokens ----------------------------------

    def propose(self, requests: list[tuple[Request, int]]) -> list[Proposal]:
        results = []
        for request, num_drafts in requests:
            tensor = torch.tensor(
                ngram_drafts(request.tokens, num_drafts, self.max_n), dtype=torch.long, device=self.engine.device
            )
            results.append((tensor, certain(tensor, self.engine.config.model.vocab_size)))
        return results

    # --- the batched loop: each slot's tokens on the device ------------------------------------------

    def allocate_slots(self, num_slots: int) -> None:
        # Each slot's tokens: prompt and committed outputs; the last column takes the writes a row
        # masks out.
        config = self.engine.config
        width = config.model.max_model_len + config.num_spec_tokens + 2
        self.history = torch.zeros(num_slots, width, dtype=torch.int64, device=self.engine.device)

    def begin_slots(self, prompts: list[list[int]], params_list: list[SamplingParams]) -> None:
        # Per request of the call: where a preempted request's tokens wait for its next slot.
        self.history_by_request = request_rows(prompts, self.history.shape[1], self.engine.device)

    def enter_slot(self, request: Request, slot: int) -> None:
        self.history[slot] = self.history_by_request[request.request_id]

    def leave_slot(self, request: Request, slot: int) -> None:
        self.history_by_request[request.request_id] = self.history[slot]

    def draft(self, step: DraftStep) -> None:
        step.segment(self.name, None, lambda _: self._draft(step.slots, step.sampling))

    def _draft(self, slots: torch.Tensor, sampling: bool) -> None:
        engine = self.engine
        k = engine.config.num_spec_tokens
        lengths = engine.state.num_computed[slots] + 1  # the committed tokens and the next input
        drafts = ngram_drafts_on_device(self.history[slots, :-1], lengths, k, self.max_n)
        engine.state.drafts[slots, :k] = drafts
        if sampling:  # a drafted token had probability 1
            engine.slot_sampling.draft_probabilities[slots] = certain(drafts, engine.config.model.vocab_size)

    def after_commit(self, verified: Verified) -> None:
        # The emitted tokens stand at the positions after the previous last token: they end at the
        # new committed length, where the next input token (last_token) sits.
        slots, tokens, emitted = verified.layout.slots, verified.tokens, verified.emitted
        offsets = torch.arange(tokens.shape[1], device=tokens.device)
        positions = self.engine.state.num_computed[slots].long()[:, None] - emitted[:, None] + 1 + offsets
        trash = self.history.shape[1] - 1
        keep = (offsets[None, :] < emitted[:, None]) & (positions < trash)
        self.history[slots[:, None].expand_as(positions), torch.where(keep, positions, trash)] = tokens
