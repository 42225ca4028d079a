"""The drafter interface: what proposes up to k draft tokens for each decoding request, whichever
engine loop runs it.

A ``Drafter`` is one object per engine, made from the configuration's spec (``registry``) and
bound to the engine (``bind``) once its model, attention and caches exist. It holds all there is
to its drafting: its rule or model, its state per request on the host, its state per device-state
slot on the device. The loops call only the methods below and never ask which drafter they run:

* the per-request loop (``engine.Engine``), on the host: ``begin`` a generate() call, ``propose``
  each step's drafts, and ``after_target`` with what the target forward computed;
* the batched loop (``batched_engine.BatchedEngine``), on the device: ``allocate_slots`` once,
  ``begin_slots`` a generate() call, ``enter_slot`` / ``leave_slot`` as requests take a slot and
  are preempted from it, ``draft`` into the device state's drafts, and ``after_commit`` with what
  the verify step committed.

Drafts never change a greedy run's tokens, only how many of them are accepted; with a
temperature, rejection sampling reads the distributions they were drawn from.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

import torch

from reference_engine.request import Request
from reference_engine.sampling import SamplingParams
from reference_engine.step_inputs import RowLayout, StepTensors

if TYPE_CHECKING:
    from backends.base import CommonAttentionMetadata
    from reference_engine.core import EngineCore

# A request's drafts [n] and the distributions they were drawn from [n, V] (one-hot where certain).
Proposal = tuple[torch.Tensor, torch.Tensor]
# Positions the target just computed, per request: (request, token ids, first position, its
# final features [n, hidden]).
Computed = tuple[Request, list[int], int, torch.Tensor]


@dataclass
class DraftStep:
    """A batched step's decoding rows (its first rows, graph padding included), as ``Drafter.draft``
    gets them; the buffers are persistent per shape where a CUDA graph reads them."""

    layout: RowLayout  # one token per row, inputs from the device state; num_valid: the row's drafts
    starts: torch.Tensor  # [rows] buffer for the rows' committed lengths
    tensors: StepTensors  # buffer for each draft step's input ids, positions, KV slots, lengths
    num_steps: int  # the draft loop's length: the most drafts of any row
    sampling: bool  # some request of this generate() call has a temperature
    common: Callable[[int], CommonAttentionMetadata]  # draft step i's batch as the backend sees it
    # A piece of the step, ``segment(name, common, run)``: ``run(metadata)`` from a CUDA graph on a
    # padded step, else eagerly (``common`` None: no attention).
    segment: Callable[[str, CommonAttentionMetadata | None, Callable], object]

    @property
    def slots(self) -> torch.Tensor:
        """[rows]: each row's device-state slot (padding rows: the spare slot)."""
        return self.layout.slots


@dataclass
class TreeDraftStep:
    """A batched step's rows that draft a token tree (``Drafter.draft_tree``); eager, as the
    engine runs tree steps."""

    slots: torch.Tensor  # [rows] each row's device-state slot
    block_table: torch.Tensor  # [rows, width] int32
    host_starts: list[int]  # the rows' committed lengths as the host knows them (async: an upper bound)
    lengths_known: bool  # host_starts exact (the sync loop)


@dataclass
class Verified:
    """What a batched step's verify forward computed and committed, as ``Drafter.after_commit``
    gets it (the device state already holds the commit)."""

    metadata: object  # the forward's attention metadata
    tensors: StepTensors  # its input ids, positions and KV slots
    layout: RowLayout
    decode: torch.Tensor  # [rows] 1: a decode row (its valid positions: what it emitted); 0: a prefill chunk
    hidden: torch.Tensor  # [tokens, hidden]: the target's final features
    tokens: torch.Tensor  # [rows, k + 1]: each row's emitted tokens, the first ``emitted`` of them
    emitted: torch.Tensor  # [rows]
    # A token-tree step's (else None): each token's parent among its row's tokens, each row's
    # accepted path (``tree_rejection``), and the slot each accepted node's KV moved to (-1: none).
    tree_parents: torch.Tensor | None = None  # [tokens] int64
    path: torch.Tensor | None = None  # [rows, k + 1]
    moved_slots: torch.Tensor | None = None  # [tokens] int64

    # Computed where a drafter asks (inside the step's graph segment), never for one that does not.

    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        """[tokens]: each token's index in its row."""
        rows = self.layout.token_row
        return torch.arange(rows.numel(), device=rows.device) - self.layout.query_start_loc.long()[rows]

    @property
    def parents(self) -> torch.Tensor:
        """[tokens]: each token's parent among its row's tokens (-1: the row's first); a chain's
        is the token before it."""
        return self.offsets - 1 if self.tree_parents is None else self.tree_parents

    @property
    def last_kept(self) -> torch.Tensor:
        """[rows]: the token whose KV is each row's last kept position (a decode row's last emitted
        position, a tree's: its path's last node; a prefill chunk's last token)."""
        starts = self.layout.query_start_loc.long()
        decode = self.decode.bool()
        last = (torch.where(decode, self.emitted, starts[1:] - starts[:-1]) - 1).clamp(min=0)
        if self.path is not None:
            node = self.path.gather(1, last.clamp(max=self.path.shape[1] - 1)[:, None]).squeeze(1)
            last = torch.where(decode, node.clamp(min=0), last)
        return starts[:-1] + last


class Drafter(ABC):
    name: ClassVar[str]  # the spec's name, the registry's key
    usage: ClassVar[str]  # how a spec names it, for messages: "ngram[:N]"
    drafts: ClassVar[bool] = True  # False for "none": no speculation
    uses_attention: ClassVar[bool] = False  # drafts through the attention backend (draft steps, update_for_draft_step)
    drafts_trees: ClassVar[bool] = False  # drafts a token tree (``draft_tree``) where the engine asks for one

    @classmethod
    @abstractmethod
    def parse(cls, argument: str | None, num_target_layers: int) -> Drafter:
        """The drafter a spec names; ``argument``: what follows "name:" (None without a colon).
        A ValueError says what is wrong with it."""

    def bind(self, engine: EngineCore) -> None:
        """The engine drafted for, once its model, attention and caches exist."""
        self.engine = engine

    def check(self, params_list: list[SamplingParams]) -> None:
        """Refuse (ValueError) a generate() call this drafter cannot draft for."""

    # --- the per-request loop (engine.Engine), on the host ----------------------------------------

    def begin(self, prompts: list[list[int]], params_list: list[SamplingParams]) -> None:
        """A generate() call starts; request i has prompt i."""

    @abstractmethod
    def propose(self, requests: list[tuple[Request, int]]) -> list[Proposal]:
        """Each (request, number of drafts)'s drafts, on the engine's device."""

    def after_target(self, computed: list[Computed]) -> None:
        """The target forward just computed these positions (of requests still running)."""

    # --- the batched loop (batched_engine.BatchedEngine), on the device ---------------------------

    def allocate_slots(self, num_slots: int) -> None:
        """Per-slot device state, once (the batched engine's slots, its spare one included)."""

    def begin_slots(self, prompts: list[list[int]], params_list: list[SamplingParams]) -> None:
        """A generate() call starts; request i has prompt i."""

    def enter_slot(self, request: Request, slot: int) -> None:
        """``request`` takes ``slot`` (first, or again after a preemption)."""

    def leave_slot(self, request: Request, slot: int) -> None:
        """``request`` is preempted from ``slot`` (its results have landed); a finished request
        leaves without a call."""

    @abstractmethod
    def draft(self, step: DraftStep) -> None:
        """Fill ``state.drafts[slot, :num_drafts]`` of every row, on the device, without a host sync
        (and, when ``step.sampling``, the slot sampling's draft probabilities)."""

    def draft_tree(self, step: TreeDraftStep) -> None:
        """Fill every row's verify tree into the device state (``drafts``, ``tree_parents``,
        ``tree_depths`` of its slot), on the device, without a host sync."""
        raise NotImplementedError(f"{self.name} drafts no token tree")

    def after_commit(self, verified: Verified) -> None:
        """Catch up with the tokens the verify step committed."""


def certain(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The distribution of drafts proposed with certainty: one-hot [..., V]."""
    return torch.nn.functional.one_hot(drafts, vocab_size).float()


def no_drafts(device: torch.device) -> Proposal:
    return torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, 1, device=device)


def request_rows(rows: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """One row of tokens per request of a generate() call, zero-padded (or cut) to ``width``, on the
    device, whence ``enter_slot`` copies a request's row into its slot (one upload per call)."""
    return torch.tensor([(row + [0] * width)[:width] for row in rows], dtype=torch.int64, device=device)
