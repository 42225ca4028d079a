"""The EAGLE drafter (``eagle``): an EAGLE-style head (``model.EagleHead``) — k steps, each feeding
its own predicted feature and draft token back in — through the attention backend over a KV cache
of its own (one layer).

The head's cache must hold every position the target computed: position p reads token p and the
target's feature at p - 1 (zeros before the first). So after each target forward the drafter
catches up over the positions it made valid (a prefill chunk; a decode row's input and accepted
drafts), and carries the target's feature at the last of them into the next draft: per request on
the host, per slot on the device.
"""

from __future__ import annotations

import torch

from reference_engine.drafters.attention import AttentionDrafter, HostRow
from reference_engine.drafters.base import Computed, TreeDraftStep, Verified
from reference_engine.drafters.eagle_tree import TreeDrafting
from reference_engine.model import EagleHead
from reference_engine.step_inputs import KVWrites, StepInputs, StepTensors


class EagleDrafter(AttentionDrafter):
    name = "eagle"
    usage = "eagle"
    drafts_trees = True

    @classmethod
    def parse(cls, argument: str | None, num_target_layers: int) -> EagleDrafter:
        if argument is not None:
            raise ValueError(f"eagle takes no argument, not {argument!r} (a checkpoint: --eagle DIR)")
        return cls()

    def bind(self, engine) -> None:
        super().bind(engine)
        config = engine.config
        # A loaded head (--eagle), else a seeded random one.
        self.head = engine.eagle_head or EagleHead.random(config.model, config.seed, config.dtype, engine.device)
        self.cache = engine.backend.allocate_kv_cache(config.num_blocks, 0)  # the head's own KV (one layer)
        self.scales = engine.layer_scales(1)
        self.last_features: dict[int, torch.Tensor] = {}  # host: the target feature before each request's last token
        tree = config.draft_tree
        self.tree_drafting = TreeDrafting(self, tree) if tree is not None else None

    def _head(self, features: torch.Tensor):
        """The head over ``features`` as ``forward_rows`` runs a model."""
        return lambda input_ids, positions, inputs: self.head(self.engine.model, input_ids, features, positions, inputs)

    # --- the per-request loop ----------------------------------------------------------------------------

    def carried(self, request) -> torch.Tensor:
        return self.last_features[request.request_id]

    def host_forward(self, rows: list[HostRow]) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.stack([feature for _, _, feature, _ in rows])
        predicted, _ = self.engine.forward_rows(
            [(request, token, position) for request, token, _, position in rows],
            [self.cache],
            self.scales,
            self._head(features),
        )
        return self.engine.model.logits(predicted), predicted

    def after_target(self, computed: list[Computed]) -> None:
        features = []
        for request, _, start, hidden in computed:
            previous = self.last_features.get(request.request_id) if start else None
            if previous is None:
                previous = torch.zeros_like(hidden[0])
            features.append(torch.cat([previous[None], hidden[:-1]]))
            self.last_features[request.request_id] = hidden[-1]
        self.engine.forward_rows(
            [(request, ids, start) for request, ids, start, _ in computed],
            [self.cache],
            self.scales,
            self._head(torch.cat(features)),
        )

    # --- the batched loop --------------------------------------------------------------------------------

    def allocate_slots(self, num_slots: int) -> None:
        super().allocate_slots(num_slots)
        config, device = self.engine.config, self.engine.device
        # The target's feature before each slot's next input token, and the feature each draft step
        # predicted (the next step's input).
        self.features = torch.zeros(num_slots, config.model.hidden_size, dtype=config.dtype, device=device)
        self.draft_features = torch.zeros_like(self.features)

    def enter_slot(self, request, slot: int) -> None:
        self.features[slot] = 0.0

    def device_forward(self, metadata, tensors: StepTensors, slots: torch.Tensor) -> torch.Tensor:
        engine = self.engine
        features = torch.where(self.draft_step == 0, self.features[slots], self.draft_features[slots])
        inputs = StepInputs(engine.backend, metadata, [self.cache], tensors.slot_mapping, self.scales)
        predicted = self.head(engine.model, tensors.input_ids, features, tensors.positions, inputs)
        self.draft_features[slots] = predicted
        return predicted

    def draft_tree(self, step: TreeDraftStep) -> None:
        self.tree_drafting.draft(step)

    def after_commit(self, verified: Verified) -> None:
        """The head's cache over the positions the step made valid; the target's feature at the
        last of them carried to the next draft. A token is fed the target's feature at its parent
        (a tree's node: its parent node's); a tree step's accepted nodes then move as the
        target's did."""
        rows, layout, tensors, hidden = verified.layout.token_row, verified.layout, verified.tensors, verified.hidden
        starts, offsets = layout.query_start_loc.long(), verified.offsets
        slots = layout.slots
        carried = torch.where((tensors.positions > 0)[:, None], self.features[slots[rows]], 0.0)
        parents = verified.parents
        features = torch.where((parents >= 0)[:, None], hidden[(starts[rows] + parents).clamp(min=0)], carried)
        query_lens = starts[1:] - starts[:-1]
        valid_count = torch.where(verified.decode.bool(), verified.emitted, query_lens)
        moved = verified.moved_slots
        # A tree's accepted nodes are known only as a path: every node is written, the path moved.
        head_slots = (
            tensors.slot_mapping
            if moved is not None
            else torch.where(offsets < valid_count[rows], tensors.slot_mapping, -1)
        )
        inputs = StepInputs(
            self.engine.backend,
            verified.metadata,
            [self.cache],
            head_slots,
            self.scales,
            KVWrites() if moved is not None else None,
        )
        self.head(self.engine.model, tensors.input_ids, features, tensors.positions, inputs)
        if moved is not None:
            inputs.kept_writes.store_at(moved)
        self.features[slots] = torch.where((valid_count > 0)[:, None], hidden[verified.last_kept], self.features[slots])
