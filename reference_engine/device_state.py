"""Per-request state on the device: how many tokens are in the KV cache and the last sampled
token, one slot per running request. The device is the source of truth for the next step's
inputs (the decode row's first token is read from here, never from the host), so the async loop
of part 2 can run ahead of the host; the host keeps a mirror it can check against.
"""

from __future__ import annotations

import torch


class DeviceState:
    def __init__(self, max_num_reqs: int, device: torch.device, num_spec_tokens: int = 0) -> None:
        self.num_computed = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.last_token = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        # Used by the batched engine: output tokens so far (the scripted drafter's index) and the
        # drafts proposed for the next verify, so the host never needs to see either.
        self.num_output = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.drafts = torch.zeros(max_num_reqs, max(num_spec_tokens, 1), dtype=torch.int64, device=device)
        # A token-tree engine's verify tree per slot (``draft_tree``): each node's parent (the root,
        # the last token, -1) and depth; a chain until a tree is drafted.
        chain = torch.arange(-1, num_spec_tokens, device=device)
        self.tree_parents = chain.repeat(max_num_reqs, 1)
        self.tree_depths = (chain + 1).repeat(max_num_reqs, 1)
        self.free_slots = list(range(max_num_reqs))
        self.slot_of: dict[int, int] = {}

    def slot(self, request_id: int) -> int:
        if request_id not in self.slot_of:
            if not self.free_slots:
                raise RuntimeError("more running requests than device state slots")
            slot = self.free_slots.pop(0)
            # Enqueued after any in-flight step that still commits into the slot's old owner.
            self.num_computed[slot] = 0
            self.slot_of[request_id] = slot
        return self.slot_of[request_id]

    def release(self, request_id: int) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def reset(self, request_id: int) -> None:
        """Preemption: nothing of this request is in the cache any more; its slot is free."""
        self.release(request_id)

    def add_computed(self, request_id: int, count: int) -> None:
        self.num_computed[self.slot(request_id)] += count

    def set_last_token(self, request_id: int, token: torch.Tensor) -> None:
        self.last_token[self.slot(request_id)] = token.reshape(())

    def commit(self, request_id: int, tokens: torch.Tensor, emitted: torch.Tensor) -> None:
        """After verification, on the device: the last emitted token becomes the next input and the
        cache holds the previous input plus every accepted draft (``emitted`` positions)."""
        slot = self.slot(request_id)
        self.last_token[slot] = tokens.reshape(-1).gather(0, (emitted.reshape(1) - 1).long()).reshape(())
        self.num_computed[slot] += emitted.reshape(()).to(torch.int32)

    def check(self, request_id: int, num_computed: int, last_token: int) -> None:
        """Compare with the host's mirror (reads the device: for tests and debug runs)."""
        slot = self.slot(request_id)
        device = (int(self.num_computed[slot]), int(self.last_token[slot]))
        if device != (num_computed, last_token):
            raise AssertionError(f"request {request_id}: device state {device} != host {(num_computed, last_token)}")
