"""Drafters: propose k tokens per decoding request.

* ``OracleDrafter`` — scripted from a reference (non-speculative greedy) run with a chosen
  acceptance pattern: ``all``, ``none``, ``first:J`` (the first J drafts right), ``random:R``
  (each right with probability R, seeded). For tests and controlled benchmarks.
* ``LayerSkipDrafter`` — the target's first n layers + its final norm and head: realistic
  acceptance with random weights. Its KV for those layers is the target's own (the same inputs
  give the same keys and values), so it drafts through the attention backend into the target's
  cache; the verify pass rewrites those slots with identical values.

Each returns drafts [k] and the drafter's distributions [k, V] (one-hot for the oracle).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

import torch

from reference_engine.request import Request
from reference_engine.sampling import sample


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


class OracleDrafter:
    def __init__(self, reference: dict[int, list[int]], pattern: AcceptancePattern, vocab_size: int, seed: int = 0) -> None:
        self.reference, self.pattern, self.vocab_size = reference, pattern, vocab_size
        self.rng = random.Random(seed)

    def propose(self, requests: list[tuple[Request, int]], device: torch.device):
        results = []
        for request, num_drafts in requests:
            script = self.reference[request.request_id]
            start = len(request.output)
            drafts = []
            for index in range(num_drafts):
                right = script[start + index] if start + index < len(script) else 0
                drafts.append(right if self.pattern.correct(index, self.rng) else (right + 1) % self.vocab_size)
            tensor = torch.tensor(drafts, dtype=torch.long, device=device)
            results.append((tensor, torch.nn.functional.one_hot(tensor, self.vocab_size).float()))
        return results


class LayerSkipDrafter:
    def __init__(self, num_layers: int, run_layers: Callable, generator_of: Callable) -> None:
        """``run_layers(requests_with_tokens, num_layers) -> logits [num_requests, V]`` runs one
        decode token per request through the first ``num_layers`` layers; ``generator_of(request)``
        gives the request's seeded generator (both provided by the engine)."""
        self.num_layers, self.run_layers, self.generator_of = num_layers, run_layers, generator_of

    def propose(self, requests: list[tuple[Request, int]], device: torch.device):
        longest = max((num for _, num in requests), default=0)
        active = [(request, num) for request, num in requests]
        last = {request.request_id: request.tokens[-1] for request, _ in requests}
        drafts: dict[int, list[torch.Tensor]] = {request.request_id: [] for request, _ in requests}
        distributions: dict[int, list[torch.Tensor]] = {request.request_id: [] for request, _ in requests}
        for step in range(longest):
            stepping = [(request, step) for request, num in active if step < num]
            inputs = [(request, last[request.request_id], request.num_computed + step) for request, step in stepping]
            logits = self.run_layers(inputs, self.num_layers)
            for (request, _), row in zip(stepping, logits):
                probabilities = torch.softmax(row / max(request.params.temperature, 1e-6), dim=-1) if not request.params.greedy \
                    else torch.nn.functional.one_hot(row.argmax(), row.shape[-1]).float()
                token = row.argmax() if request.params.greedy else sample(probabilities[None], self.generator_of(request))[0]
                drafts[request.request_id].append(token)
                distributions[request.request_id].append(probabilities)
                last[request.request_id] = int(token)  # the next draft step's input (host: the drafter's own loop)
        results = []
        for request, num in requests:
            if num == 0:
                results.append((torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, 1, device=device)))
                continue
            results.append((torch.stack(drafts[request.request_id]), torch.stack(distributions[request.request_id])))
        return results
