"""Deliberately broken batched engines: each plants one async-scheduling bug that the engine's
tests (and its debug input checks) must catch."""

from reference_engine.batched_engine import BatchedEngine


class OptimisticStartEngine(BatchedEngine):
    """Positions start at the host's optimistic length (every draft assumed accepted) where the
    committed length on the device is needed: after a rejection the row skips ahead."""

    def _starts(self, uploaded):
        return uploaded.host_start.to(self.state.num_computed.dtype)


class HostLastTokenEngine(BatchedEngine):
    """A decoding row takes its input from the host's last token, as a synchronous engine may.
    Under async scheduling that token is still a placeholder (-1) for the step in flight."""

    def _decode_inputs(self, request, count):
        return False, request.tokens[-count:]


class TreeBranchesKVLeftEngine(BatchedEngine):
    """A token-tree engine that commits the accepted path's length but leaves the KV where the
    tree step wrote it: node j at slot start + j. Where the path leaves the first branch, the next
    step reads a rejected sibling's keys at an accepted position."""

    def _moved_slots(self, path, emitted, layout, starts):
        return super()._moved_slots(path, emitted, layout, starts).fill_(-1)
