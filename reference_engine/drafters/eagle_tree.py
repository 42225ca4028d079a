"""EAGLE's token-tree drafting (top-k > 1) in the batched loop, on the device, without a host sync.

The tree grows one level per draft step (``draft_tree``): step d runs the head over every node of
depth <= d, a token-tree step through the attention backend (each node sees the context and its
ancestors, at position committed + depth, its KV at its row's slot committed + node index), and
expands the level-d nodes by their likeliest tokens. A node's input feature is what the head
predicted at its parent (the root's: the target's feature the last verify carried). The nodes
above level d are computed again at step d: their outputs are the same, and so a step is one
ordinary tree step a backend serves, with no state from the step before but the tree itself.

The verify tree (breadth-first, root first) goes into the device state: ``drafts[slot, :n]``,
``tree_parents[slot]`` and ``tree_depths[slot]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from backends.base import CommonAttentionMetadata
from reference_engine.draft_tree import DraftTree
from reference_engine.step_inputs import StepInputs

if TYPE_CHECKING:
    from reference_engine.drafters.base import TreeDraftStep
    from reference_engine.drafters.eagle import EagleDrafter

_LOG_FLOOR = -1e4  # a path's log-probability per level at least this: scores stay finite and ordered


class TreeDrafting:
    def __init__(self, drafter: EagleDrafter, tree: DraftTree) -> None:
        self.drafter, self.tree = drafter, tree
        sizes = tree.level_sizes()
        self.level_start = [sum(sizes[:level]) for level in range(len(sizes) + 1)]  # node index of each level
        self.num_nodes = self.level_start[-1]
        self.node_depth = torch.tensor(
            [level for level, size in enumerate(sizes) for _ in range(size)], device=drafter.engine.device
        )
        if tree.is_static:
            self.static_parents = torch.tensor(tree.parents, device=drafter.engine.device)
            self.static_ranks = torch.tensor(tree.child_ranks(), device=drafter.engine.device)
            self.most_children = max(tree.child_ranks()) + 1  # on the host: no sync to size the top-k

    def draft(self, step: TreeDraftStep) -> None:
        engine, tree = self.drafter.engine, self.tree
        state, block_size = engine.state, engine.config.kv_block_size
        rows, device = step.slots.shape[0], step.slots.device
        starts = state.num_computed[step.slots].long()
        nodes = self.num_nodes
        tokens = torch.zeros(rows, nodes, dtype=torch.long, device=device)
        tokens[:, 0] = state.last_token[step.slots]
        parents = torch.full((rows, nodes), -1, dtype=torch.long, device=device)
        scores = torch.zeros(rows, nodes, dtype=torch.float64, device=device)
        outputs = torch.zeros(
            rows, nodes, self.drafter.features.shape[1], dtype=self.drafter.features.dtype, device=device
        )
        if tree.is_static:
            parents[:] = self.static_parents
        for level in range(tree.depth):
            count = self.level_start[level + 1]
            predicted = self._forward(step, starts, tokens[:, :count], parents[:, :count], outputs, block_size)
            first = self.level_start[level]
            outputs[:, first:count] = predicted[:, first:count]
            logits = engine.model.logits(predicted[:, first:count].reshape(-1, predicted.shape[-1]))
            self._expand(level, logits.view(rows, count - first, -1).float(), tokens, parents, scores)
        chosen_tokens, chosen_parents = self._verify_tree(tokens, parents, scores)
        depths = torch.zeros_like(chosen_parents)
        for _ in range(tree.depth):  # a node's depth is its parent's + 1 (parents come first)
            depths = torch.where(chosen_parents >= 0, depths.gather(1, chosen_parents.clamp(min=0)) + 1, 0)
        state.drafts[step.slots, : tree.num_drafts] = chosen_tokens[:, 1:]
        state.tree_parents[step.slots] = chosen_parents
        state.tree_depths[step.slots] = depths

    def _forward(self, step, starts, tokens, parents, outputs, block_size) -> torch.Tensor:
        """The head over every node so far (one tree step): predicted features [rows, count, hidden]."""
        drafter, engine = self.drafter, self.drafter.engine
        rows, count = tokens.shape
        index = torch.arange(count, device=tokens.device)
        offsets = starts[:, None] + index[None, :]  # each node's KV at its row's slot committed + index
        slot_mapping = (
            step.block_table.long().gather(1, offsets // block_size) * block_size + offsets % block_size
        ).reshape(-1)
        positions = (starts[:, None] + self.node_depth[:count][None, :]).reshape(-1)
        inputs = torch.where(
            (parents >= 0)[:, :, None],
            outputs.gather(1, parents.clamp(min=0)[:, :, None].expand(-1, -1, outputs.shape[-1])),
            drafter.features[step.slots][:, None, :],
        )
        host_parents = list(self.tree.parents[:count]) * rows if self.tree.is_static else None
        common = CommonAttentionMetadata.from_lengths(
            query_start_loc=(torch.arange(rows + 1, device=tokens.device) * count).to(torch.int32),
            seq_lens=(starts + count).to(torch.int32),
            block_table=step.block_table,
            slot_mapping=slot_mapping,
            query_starts=[row * count for row in range(rows + 1)],
            host_seq_lens=[start + count for start in step.host_starts],
            lengths_known=step.lengths_known,
            tree_parents=parents.reshape(-1).to(torch.int32),
            host_tree_parents=host_parents,
        )
        metadata = engine.backend.build(common)
        step_inputs = StepInputs(engine.backend, metadata, [drafter.cache], slot_mapping, drafter.scales)
        predicted = drafter.head(
            engine.model, tokens.reshape(-1), inputs.reshape(rows * count, -1), positions, step_inputs
        )
        return predicted.view(rows, count, -1)

    def _expand(self, level: int, logits: torch.Tensor, tokens, parents, scores) -> None:
        """Level ``level + 1``'s nodes from the level-``level`` nodes' logits [rows, width, V]."""
        first, following, end = self.level_start[level], self.level_start[level + 1], self.level_start[level + 2]
        if self.tree.is_static:
            # Each node's children: its parent's likeliest tokens, by rank.
            ranks = self.static_ranks[following:end]
            likeliest = logits.topk(self.most_children, dim=-1).indices  # [rows, width, most children]
            parent = self.static_parents[following:end] - first
            tokens[:, following:end] = likeliest[:, parent, ranks]
            return
        topk = self.tree.topk
        log_probabilities = torch.log_softmax(logits, dim=-1).clamp(min=_LOG_FLOOR)
        best = log_probabilities.topk(topk, dim=-1)  # [rows, width, topk]
        paths = (scores[:, first:following, None] + best.values.double()).flatten(1)
        kept = paths.topk(topk, dim=-1)  # the level's topk likeliest paths
        tokens[:, following:end] = best.indices.flatten(1).gather(1, kept.indices)
        parents[:, following:end] = first + kept.indices // topk
        scores[:, following:end] = kept.values

    def _verify_tree(self, tokens, parents, scores) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify tree, breadth-first: a static tree as drafted; a dynamic one's ``num_drafts``
        likeliest nodes (a node never likelier than its parent: the choice keeps every ancestor;
        among equal paths the shallower first)."""
        if self.tree.is_static:
            return tokens, parents
        key = scores[:, 1:] - 1e-3 * self.node_depth[1:].double()
        chosen = key.topk(self.tree.num_drafts, dim=-1).indices.sort(dim=-1).values + 1  # node indices, BFS
        chosen = torch.cat([torch.zeros_like(chosen[:, :1]), chosen], dim=1)
        new_index = torch.full_like(tokens, -1).scatter_(
            1, chosen, torch.arange(chosen.shape[1], device=chosen.device).expand_as(chosen)
        )
        old_parents = parents.gather(1, chosen)
        new_parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), -1)
        return tokens.gather(1, chosen), new_parents
