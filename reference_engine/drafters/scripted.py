"""The scripted drafter (``scripted:PATTERN``): drafts scripted from a reference run — the same
engine without speculation — with a chosen acceptance pattern: ``all``, ``none``, ``first:J``
(the first J drafts right), ``random:R`` (each right with probability R, seeded). A wrong draft is
the right token + 1. For tests and controlled benchmarks; it needs no attention, and it scripts
greedy runs only.
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass

import torch

from reference_engine.drafters.base import Drafter, DraftStep, Proposal, certain, request_rows
from reference_engine.request import Request
from reference_engine.sampling import SamplingParams, counter_uniform
from reference_engine.slot_sampling import SCRIPT_LANE


@dataclass(frozen=True)
class AcceptancePattern:
    kind: str  # all | none | first | random
    value: float = 0.0

    @staticmethod
    def parse(text: str) -> "AcceptancePattern":
        if text in ("all", "none"):
            return AcceptancePattern(text)
        match = re.fullmatch(r"(first|random):([0-9.]+)", text)
        if not match:
            raise ValueError(f"acceptance pattern {text!r}: expected all, none, first:J or random:R")
        kind, value = match.group(1), float(match.group(2))
        if kind == "random" and not 0 <= value <= 1:
            raise ValueError("random:R needs 0 <= R <= 1")
        return AcceptancePattern(kind, value)

    def correct(self, index: int, rng: random.Random) -> bool:
        if self.kind == "all":
            return True
        if self.kind == "none":
            return False
        if self.kind == "first":
            return index < self.value
        return rng.random() < self.value


def reference_outputs(engine, prompts: list[list[int]], params_list: list[SamplingParams]) -> dict[int, list[int]]:
    """The reference run the scripted drafter follows: the same engine, no speculation."""
    # Eager: graphs captured for a throwaway engine are freed by the garbage collector at an
    # unpredictable moment, possibly while another graph is being captured (a CUDA error).
    config = dataclasses.replace(engine.config, num_spec_tokens=0, drafter="none", cuda_graphs=False)
    plain = type(engine)(config, engine.model)
    # k tokens past max_tokens: the last step drafts past the stop too (the scheduler does not
    # cap drafts by max_tokens), and "all" must stay all.
    extended = [dataclasses.replace(p, max_tokens=p.max_tokens + engine.config.num_spec_tokens) for p in params_list]
    return {index: out.tokens for index, out in enumerate(plain.generate(prompts, extended))}


class ScriptedDrafter(Drafter):
    name = "scripted"
    usage = "scripted:PATTERN"

    def __init__(self, pattern: AcceptancePattern) -> None:
        self.pattern = pattern

    @classmethod
    def parse(cls, argument: str | None, num_target_layers: int) -> ScriptedDrafter:
        if argument is None:
            raise ValueError("the scripted drafter needs a pattern: scripted:all, none, first:J or random:R")
        return cls(AcceptancePattern.parse(argument))

    def check(self, params_list: list[SamplingParams]) -> None:
        if not all(p.greedy for p in params_list):
            raise ValueError("the scripted drafter scripts greedy runs only")

    # --- the per-request loop: the pattern drawn from a seeded generator ---------------------------

    def begin(self, prompts: list[list[int]], params_list: list[SamplingParams]) -> None:
        self.script = reference_outputs(self.engine, prompts, params_list)
        self.rng = random.Random(self.engine.config.seed)

    def propose(self, requests: list[tuple[Request, int]]) -> list[Proposal]:
        vocab_size, results = self.engine.config.model.vocab_size, []
        for request, num_drafts in requests:
            script = self.script[request.request_id]
            start = len(request.output)
            drafts = []
            for index in range(num_drafts):
                right = script[start + index] if start + index < len(script) else 0
                drafts.append(right if self.pattern.correct(index, self.rng) else (right + 1) % vocab_size)
            tensor = torch.tensor(drafts, dtype=torch.long, device=self.engine.device)
            results.append((tensor, certain(tensor, vocab_size)))
        return results

    # --- the batched loop: each slot's script on the device, the pattern from counters -------------

    def allocate_slots(self, num_slots: int) -> None:
        config = self.engine.config
        width = config.model.max_model_len + config.num_spec_tokens + 1
        self.script_by_slot = torch.zeros(num_slots, width, dtype=torch.int64, device=self.engine.device)

    def begin_slots(self, prompts: list[list[int]], params_list: list[SamplingParams]) -> None:
        script = reference_outputs(self.engine, prompts, params_list)
        self.script_by_request = request_rows(
            [tokens for _, tokens in sorted(script.items())], self.script_by_slot.shape[1], self.engine.device
        )

    def enter_slot(self, request: Request, slot: int) -> None:
        self.script_by_slot[slot] = self.script_by_request[request.request_id]

    def draft(self, step: DraftStep) -> None:
        step.segment(self.name, None, lambda _: self._draft(step.slots))

    def _draft(self, slots: torch.Tensor) -> None:
        """The reference continuation where the pattern says right, +1 elsewhere."""
        engine = self.engine
        state, k = engine.state, engine.config.num_spec_tokens
        offsets = torch.arange(k, device=engine.device)
        index = (state.num_output[slots].long()[:, None] + offsets).clamp(max=self.script_by_slot.shape[1] - 1)
        right = self.script_by_slot[slots].gather(1, index)
        pattern = self.pattern
        if pattern.kind == "random":
            correct = counter_uniform(engine.slot_sampling.seed[slots][:, None], index, SCRIPT_LANE) < pattern.value
        else:
            limit = {"all": k, "none": 0}.get(pattern.kind, pattern.value)
            correct = (offsets < limit)[None, :].expand_as(right)
        state.drafts[slots, :k] = torch.where(correct, right, (right + 1) % engine.config.model.vocab_size)
