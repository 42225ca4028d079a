"""No drafter (``none``): plain decoding, k = 0. Every decoding request gets no drafts."""

from __future__ import annotations

from reference_engine.drafters.base import Drafter, DraftStep, Proposal, no_drafts
from reference_engine.request import Request


class NoDrafter(Drafter):
    name = "none"
    usage = "none"
    drafts = False

    @classmethod
    def parse(cls, argument: str | None, num_target_layers: int) -> NoDrafter:
        if argument is not None:
            raise ValueError(f"none takes no argument, not {argument!r}")
        return cls()

    def propose(self, requests: list[tuple[Request, int]]) -> list[Proposal]:
        return [no_drafts(self.engine.device) for _ in requests]

    def draft(self, step: DraftStep) -> None:
        pass
