"""The layer-skip drafter (``layer-skip[:N]``): the target's first N layers (default a quarter of
them) and its final norm and head, one draft token at a time — realistic acceptance with random
weights. Its KV for those layers is the target's own (the same inputs give the same keys and
values), so it drafts through the attention backend into the target's cache; the verify pass
rewrites those slots with identical values.
"""

from __future__ import annotations

import torch

from reference_engine.drafters.attention import AttentionDrafter, HostRow
from reference_engine.step_inputs import StepInputs, StepTensors


class LayerSkipDrafter(AttentionDrafter):
    name = "layer-skip"
    usage = "layer-skip[:N]"

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers  # of the target's layers, run for each draft token

    @classmethod
    def parse(cls, argument: str | None, num_target_layers: int) -> LayerSkipDrafter:
        layers = int(argument or max(1, num_target_layers // 4))
        if not 1 <= layers < num_target_layers:
            raise ValueError(f"layer-skip needs 1 <= layers < {num_target_layers}")
        return cls(layers)

    def host_forward(self, rows: list[HostRow]) -> tuple[torch.Tensor, list[None]]:
        engine = self.engine
        hidden, _ = engine.forward_rows(
            [(request, token, position) for request, token, _, position in rows],
            engine.kv_caches,
            engine.kv_scales,
            self._first_layers,
        )
        return engine.model.logits(hidden), [None] * len(rows)

    def device_forward(self, metadata, tensors: StepTensors, slots: torch.Tensor) -> torch.Tensor:
        engine = self.engine
        inputs = StepInputs(engine.backend, metadata, engine.kv_caches, tensors.slot_mapping, engine.kv_scales)
        return self._first_layers(tensors.input_ids, tensors.positions, inputs)

    def _first_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        return self.engine.model(input_ids, positions, inputs, self.num_layers)
