"""The MTP drafter (``mtp``): DeepSeek's multi-token prediction module (``model.MtpHead``) drafting k
tokens, each step feeding its own predicted hidden state and draft token back into the one module,
through the attention backend over a KV cache of its own. It is the EAGLE drafter's loop with
DeepSeek's head: the same catch-up after each target forward, the same carried features."""

from __future__ import annotations

from reference_engine.drafters.eagle import EagleDrafter
from reference_engine.model import MtpHead


class MtpDrafter(EagleDrafter):
    name = "mtp"
    usage = "mtp"

    @classmethod
    def parse(cls, argument: str | None, num_target_layers: int) -> MtpDrafter:
        if argument is not None:
            raise ValueError(f"mtp takes no argument, not {argument!r}")
        return cls()

    def bind(self, engine) -> None:
        super().bind(engine)
        config = engine.config
        self.head = MtpHead.random(config.model, config.seed, config.dtype, engine.device)  # a seeded random module
