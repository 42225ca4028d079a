"""What the drafters that run a model through the attention backend (``layer_skip``, ``eagle``)
share: k draft steps of one token per request, each feeding the token it chose back in, and that
choice (the argmax for a greedy request, else a draw from the softmax at its temperature). A
subclass gives its model's one draft position per row, on the host (``host_forward``) and on the
device (``device_forward``).

On the device the k steps read their inputs from the device state (``step_inputs``): a backend
that claims ``draft_step_update`` advances its metadata between them with
``update_for_draft_step``, all k in one CUDA graph on a padded step; otherwise its ``build`` runs
on the host before each step, one step's graph replayed k times, the step index in a device
scalar.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Sequence

import torch

from reference_engine.drafters.base import Drafter, DraftStep, Proposal, certain, no_drafts
from reference_engine.request import Request
from reference_engine.sampling import counter_uniform, gumbel_argmax, sample
from reference_engine.slot_sampling import DRAFT_LANE
from reference_engine.step_inputs import StepTensors, prepare_step_inputs

# A row of a host draft step: (request, its input token, a [1] device tensor, what the previous
# step carried for it, its position).
HostRow = tuple[Request, torch.Tensor, object, int]


class AttentionDrafter(Drafter):
    uses_attention = True

    # --- what a subclass gives -------------------------------------------------------------------------

    def carried(self, request: Request) -> object:
        """What the first draft step of ``request`` carries in beside its last token (EAGLE: the
        target's feature)."""
        return None

    @abstractmethod
    def host_forward(self, rows: list[HostRow]) -> tuple[torch.Tensor, Sequence]:
        """One draft position per row: (logits [rows, V], what each row carries to its next step)."""

    @abstractmethod
    def device_forward(self, metadata, tensors: StepTensors, slots: torch.Tensor) -> torch.Tensor:
        """One draft position per row of the batched step: the final features [rows, hidden]."""

    # --- the per-request loop ----------------------------------------------------------------------------

    def propose(self, requests: list[tuple[Request, int]]) -> list[Proposal]:
        """Drafts stay on the device from step to step."""
        engine = self.engine
        state = {r.request_id: (engine.last_token(r), self.carried(r)) for r, _ in requests}
        drafts: dict[int, list[torch.Tensor]] = {r.request_id: [] for r, _ in requests}
        distributions: dict[int, list[torch.Tensor]] = {r.request_id: [] for r, _ in requests}
        for index in range(max((num for _, num in requests), default=0)):
            stepping = [request for request, num in requests if index < num]
            rows = [(r, *state[r.request_id], r.num_computed + index) for r in stepping]
            logits, carries = self.host_forward(rows)
            for request, row, carry in zip(stepping, logits, carries):
                token, probabilities = _choose(request, row, engine.generator(request))
                drafts[request.request_id].append(token)
                distributions[request.request_id].append(probabilities)
                state[request.request_id] = (token.reshape(1), carry)  # the next draft step's input
        return [_stack(drafts[r.request_id], distributions[r.request_id], engine.device) for r, _ in requests]

    # --- the batched loop ----------------------------------------------------------------------------------

    def allocate_slots(self, num_slots: int) -> None:
        self.draft_step = torch.zeros((), dtype=torch.int64, device=self.engine.device)  # the draft loop's index

    def draft(self, step: DraftStep) -> None:
        engine = self.engine
        state, block_size = engine.state, engine.config.kv_block_size
        torch.index_select(state.num_computed, 0, step.slots, out=step.starts)  # one launch, into the graphs' buffer
        self.draft_step.zero_()

        def prepare(index: int) -> StepTensors:
            return prepare_step_inputs(
                step.starts, state.last_token, state.drafts, step.layout, index, block_size, step.tensors
            )

        prepare(0)
        if engine.draft_steps_update_metadata:

            def loop(metadata) -> None:
                for index in range(step.num_steps):
                    if index:
                        prepare(index)
                        metadata = engine.backend.update_for_draft_step(metadata, step.common(index))
                    self._draft_one(metadata, step)

            step.segment("draft loop", step.common(0), loop)
            return
        for index in range(step.num_steps):  # one step's graph, replayed; metadata rebuilt between
            if index:
                prepare(index)
            step.segment("draft step", step.common(index), lambda metadata: self._draft_one(metadata, step))

    def _draft_one(self, metadata, step: DraftStep) -> None:
        """One draft token per row, into column ``draft_step`` of ``state.drafts``."""
        engine, slots = self.engine, step.slots
        logits = engine.model.logits(self.device_forward(metadata, step.tensors, slots))
        column = self.draft_step.expand(slots.shape)
        tokens = logits.argmax(dim=-1)
        if step.sampling:
            sampling = engine.slot_sampling
            temperature = sampling.temperature[slots]
            greedy = temperature == 0
            probabilities = torch.softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
            counter = engine.state.num_output[slots].long() + self.draft_step
            sampled = gumbel_argmax(
                probabilities, counter_uniform(sampling.seed[slots], counter, DRAFT_LANE, (logits.shape[-1],))
            )
            tokens = torch.where(greedy, tokens, sampled)
            one_hot = certain(tokens, logits.shape[-1])
            sampling.draft_probabilities.index_put_(
                (slots, column), torch.where(greedy[:, None], one_hot, probabilities)
            )
        engine.state.drafts.index_put_((slots, column), tokens)
        self.draft_step.add_(1)


def _choose(request: Request, logits: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft token and the distribution it was drawn from (one-hot for greedy requests)."""
    if request.params.greedy:
        token = logits.argmax()
        return token, certain(token, logits.shape[-1])
    probabilities = torch.softmax(logits / request.params.temperature, dim=-1)
    return sample(probabilities[None], generator)[0], probabilities


def _stack(tokens: list[torch.Tensor], distributions: list[torch.Tensor], device: torch.device) -> Proposal:
    if not tokens:
        return no_drafts(device)
    return torch.stack(tokens), torch.stack(distributions)
