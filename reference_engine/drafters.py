"""Drafters: what proposes k tokens per decoding request.

A ``Drafter`` is what an engine's configuration names (``parse_drafter``): one type, whichever
loop runs it.

* ``ScriptedDrafter`` (``scripted:PATTERN``) — scripted from a reference (non-speculative greedy)
  run with a chosen acceptance pattern: ``all``, ``none``, ``first:J`` (the first J drafts right),
  ``random:R`` (each right with probability R, seeded). For tests and controlled benchmarks; it
  needs no attention.
* ``EagleDrafter`` (``eagle``) — an EAGLE-style head (see ``model.EagleHead``): k steps, each
  feeding its own predicted feature and draft token back in, through the attention backend over
  its own cache.
* ``NgramDrafter`` (``ngram[:N]``) — prompt lookup: the tokens that followed the most recent
  earlier occurrence of the request's last n tokens (n from N, default 3, down to 1) in its own
  prompt and output. No model, no attention; real text repeats itself, random models loop.
* ``LayerSkipDrafter`` (``layer-skip[:N]``) — the target's first N layers + its final norm and
  head: realistic acceptance with random weights. Its KV for those layers is the target's own (the
  same inputs give the same keys and values), so it drafts through the attention backend into the
  target's cache; the verify pass rewrites those slots with identical values.

The batched engine runs each on the device (``batched_engine``); the per-request reference loop
runs each on the host with the proposers below (``ScriptedProposer``, ``NgramProposer``,
``LayerSkipProposer``, ``EagleProposer``), which return drafts [k] and the distributions they were drawn from [k, V]
(one-hot for the scripted drafter).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

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


class Drafter(Protocol):
    name: ClassVar[str]
    uses_attention: ClassVar[bool]  # drafts through the attention backend (draft steps, update_for_draft_step)


@dataclass(frozen=True)
class ScriptedDrafter:
    pattern: AcceptancePattern
    name: ClassVar[str] = "scripted"
    uses_attention: ClassVar[bool] = False


@dataclass(frozen=True)
class NgramDrafter:
    max_n: int = 3  # the longest suffix looked up; down to 1
    name: ClassVar[str] = "ngram"
    uses_attention: ClassVar[bool] = False


@dataclass(frozen=True)
class LayerSkipDrafter:
    num_layers: int  # of the target's layers, run for each draft token
    name: ClassVar[str] = "layer-skip"
    uses_attention: ClassVar[bool] = True


@dataclass(frozen=True)
class EagleDrafter:
    name: ClassVar[str] = "eagle"
    uses_attention: ClassVar[bool] = True


# "oracle:" is the scripted drafter's former name, still accepted.
SCRIPTED_PREFIXES = ("scripted:", "oracle:")
DRAFTER_NAMES = "none, eagle, scripted:PATTERN, ngram[:N], layer-skip[:N]"


def parse_drafter(text: str, num_target_layers: int) -> Drafter | None:
    """The drafter a configuration names; None for "none"."""
    if text == "none":
        return None
    for prefix in SCRIPTED_PREFIXES:
        if text.startswith(prefix):
            return ScriptedDrafter(AcceptancePattern.parse(text.removeprefix(prefix)))
    if text == "eagle":
        return EagleDrafter()
    if text == "ngram" or text.startswith("ngram:"):
        max_n = text.partition(":")[2] or "3"
        if not max_n.isdigit() or int(max_n) < 1:
            raise ValueError(f"ngram:N needs a whole N >= 1, not {max_n!r}")
        return NgramDrafter(int(max_n))
    if text == "layer-skip" or text.startswith("layer-skip:"):
        layers = int(text.partition(":")[2] or max(1, num_target_layers // 4))
        if not 1 <= layers < num_target_layers:
            raise ValueError(f"layer-skip needs 1 <= layers < {num_target_layers}")
        return LayerSkipDrafter(layers)
    raise ValueError(f"unknown drafter {text!r} ({DRAFTER_NAMES})")


class ScriptedProposer:
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


def ngram_drafts(tokens: list[int], k: int, max_n: int) -> list[int]:
    """The n-gram drafter's rule, written for reading (the batched engine's ``ngram_drafts_on_device``
    must agree): for the longest n <= max_n whose last n tokens occur earlier in ``tokens``, the k
    tokens after the most recent such occurrence; past the end of ``tokens``, and without any
    match, the last token repeated."""
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


class NgramProposer:
    def __init__(self, max_n: int, vocab_size: int) -> None:
        self.max_n, self.vocab_size = max_n, vocab_size

    def propose(self, requests: list[tuple[Request, int]], device: torch.device):
        results = []
        for request, num_drafts in requests:
            tensor = torch.tensor(ngram_drafts(request.tokens, num_drafts, self.max_n), dtype=torch.long, device=device)
            results.append((tensor, torch.nn.functional.one_hot(tensor, self.vocab_size).float()))
        return results


class LayerSkipProposer:
    def __init__(self, num_layers: int, run_layers: Callable, generator_of: Callable, first_token: Callable) -> None:
        """``run_layers(inputs, num_layers) -> logits [num_requests, V]`` runs one decode token per
        request through the first ``num_layers`` layers; ``generator_of(request)`` gives the
        request's seeded generator; ``first_token(request)`` its last sampled token, a [1] device
        tensor (all provided by the engine). Drafts stay on the device from step to step."""
        self.num_layers, self.run_layers, self.generator_of = num_layers, run_layers, generator_of
        self.first_token = first_token

    def propose(self, requests: list[tuple[Request, int]], device: torch.device):
        longest = max((num for _, num in requests), default=0)
        active = [(request, num) for request, num in requests]
        last = {request.request_id: self.first_token(request) for request, _ in requests}
        drafts: dict[int, list[torch.Tensor]] = {request.request_id: [] for request, _ in requests}
        distributions: dict[int, list[torch.Tensor]] = {request.request_id: [] for request, _ in requests}
        for step in range(longest):
            stepping = [(request, step) for request, num in active if step < num]
            inputs = [(request, last[request.request_id], request.num_computed + step) for request, step in stepping]
            logits = self.run_layers(inputs, self.num_layers)
            for (request, _), row in zip(stepping, logits):
                token, probabilities = _choose(request, row, self.generator_of(request))
                drafts[request.request_id].append(token)
                distributions[request.request_id].append(probabilities)
                last[request.request_id] = token.reshape(1)  # the next draft step's input
        return [_stack(drafts[r.request_id], distributions[r.request_id], device) for r, _ in requests]


def _choose(request: Request, logits: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft token and the distribution it was drawn from (one-hot for greedy requests)."""
    if request.params.greedy:
        token = logits.argmax()
        return token, torch.nn.functional.one_hot(token, logits.shape[-1]).float()
    probabilities = torch.softmax(logits / request.params.temperature, dim=-1)
    return sample(probabilities[None], generator)[0], probabilities


def _stack(tokens: list[torch.Tensor], distributions: list[torch.Tensor], device: torch.device):
    if not tokens:
        return torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, 1, device=device)
    return torch.stack(tokens), torch.stack(distributions)


class EagleProposer:
    def __init__(self, run_head: Callable, generator_of: Callable, first_token: Callable) -> None:
        """``run_head(inputs) -> (logits [n, V], features [n, hidden])`` runs the head one position per
        request; inputs are (request, token [1] device tensor, feature, position)."""
        self.run_head, self.generator_of, self.first_token = run_head, generator_of, first_token
        self.last_features: dict[int, torch.Tensor] = {}  # the target feature before each request's last token

    def propose(self, requests: list[tuple[Request, int]], device: torch.device):
        state = {request.request_id: (self.first_token(request), self.last_features[request.request_id]) for request, _ in requests}
        drafts = {request.request_id: [] for request, _ in requests}
        distributions = {request.request_id: [] for request, _ in requests}
        for step in range(max((num for _, num in requests), default=0)):
            stepping = [request for request, num in requests if step < num]
            inputs = [(r, state[r.request_id][0], state[r.request_id][1], r.num_computed + step) for r in stepping]
            logits, features = self.run_head(inputs)
            for request, row, feature in zip(stepping, logits, features):
                token, probabilities = _choose(request, row, self.generator_of(request))
                drafts[request.request_id].append(token)
                distributions[request.request_id].append(probabilities)
                state[request.request_id] = (token.reshape(1), feature)
        return [_stack(drafts[r.request_id], distributions[r.request_id], device) for r, _ in requests]
