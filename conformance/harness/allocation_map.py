"""Which tensor a device address belongs to: the allocations a harness handed a backend, and the
KV pool down to the block, slot and owning request.

The memory check's sanitized child records this map beside the run (it is JSON, read by the
parent), so that a report's bare address becomes "block_table, 4 bytes past its end" or "KV pool
block 0 (reserved: no request owns it)".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class Allocation:
    """One tensor's whole allocation (its storage: a view names the allocation it lies in)."""

    name: str
    start: int
    size: int  # bytes

    def contains(self, address: int) -> bool:
        return self.start <= address < self.start + self.size


@dataclass
class PoolLayout:
    """The KV pool's shape and strides, and which request owns each block up to which length."""

    start: int
    shape: list[int]
    strides: list[int]  # in elements
    element_size: int
    block_size: int
    num_blocks: int
    # block -> [[request, position of the block's first slot in the request, the request's length], ...]
    # (a shared prefix block has several owners); JSON keys are strings.
    owners: dict[str, list[list[int]]] = field(default_factory=dict)

    def _dim(self, size: int, exclude: int | None) -> int | None:
        """The one dimension of ``size`` (None when none or several: the layout is ambiguous)."""
        dims = [d for d, extent in enumerate(self.shape) if extent == size and d != exclude]
        return dims[0] if len(dims) == 1 else None

    def block_dim(self) -> int | None:
        return self._dim(self.num_blocks, exclude=None)

    def token_dim(self) -> int | None:
        """The dimension of the slot within a block; None when the layout does not say (no single
        dimension of the pool's block count, or of the block size)."""
        block_dim = self.block_dim()
        return None if block_dim is None else self._dim(self.block_size, exclude=block_dim)

    def locate(self, address: int) -> tuple[int, int] | None:
        """(block, slot within the block) of the element at ``address``; None when the layout does not say."""
        block_dim, token_dim = self.block_dim(), self.token_dim()
        if token_dim is None:
            return None
        offset = (address - self.start) // self.element_size
        index = [0] * len(self.shape)
        for dim in sorted(range(len(self.shape)), key=lambda d: -self.strides[d]):
            index[dim], offset = divmod(offset, self.strides[dim]) if self.strides[dim] else (0, offset)
        return index[block_dim], index[token_dim]

    def describe(self, address: int) -> str:
        place = self.locate(address)
        if place is None:
            return f"KV pool, byte {address - self.start}"
        block, slot = place
        owners = self.owners.get(str(block), [])
        where = f"KV pool block {block} slot {slot}"
        if not owners:
            return where + (" (block 0, reserved: no request owns it)" if block == 0 else " (a block no request owns)")
        for request, first_position, length in owners:
            position = first_position + slot
            if position < length:
                return where + f" (request {request}'s position {position}, within its length {length})"
        request, first_position, length = owners[0]
        return where + f" (past request {request}'s length: position {first_position + slot}, length {length})"


HARNESS_UNMAPPED = "an allocation the harness did not make (the backend's own: workspace, metadata, temporaries)"


@dataclass
class AllocationMap:
    allocations: list[Allocation] = field(default_factory=list)
    pool: PoolLayout | None = None
    unmapped: str = HARNESS_UNMAPPED  # what an address outside every allocation here is

    def add(self, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is None or tensor.device.type != "cuda":
            return
        storage = tensor.untyped_storage()
        self.allocations.append(Allocation(name, storage.data_ptr(), storage.nbytes()))

    def add_pool(
        self, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int], block_size: int, num_blocks: int
    ) -> None:
        """The pool and its owners: ``block_table`` [requests, blocks] on the host, ``seq_lens`` the
        length each request has once the run is over."""
        self.add("KV pool", kv_cache)
        owners: dict[str, list[list[int]]] = {}
        for request, (row, length) in enumerate(zip(block_table.tolist(), seq_lens)):
            for index in range(-(-length // block_size)):
                owners.setdefault(str(row[index]), []).append([request, index * block_size, length])
        self.pool = PoolLayout(
            kv_cache.data_ptr(),
            list(kv_cache.shape),
            list(kv_cache.stride()),
            kv_cache.element_size(),
            block_size,
            num_blocks,
            owners,
        )

    def holds(self, address: int) -> bool:
        """Whether ``address`` lies in a tensor the harness made."""
        return any(allocation.contains(address) for allocation in self.allocations)

    def describe(self, address: int, nearest: int | None = None) -> str:
        """What ``address`` is; ``nearest`` (the allocation start memcheck names for an address
        out of bounds) places an address outside every allocation relative to its neighbour."""
        for allocation in self.allocations:
            if allocation.contains(address):
                if allocation.name == "KV pool" and self.pool is not None:
                    return self.pool.describe(address)
                return f"{allocation.name}, byte {address - allocation.start} of {allocation.size}"
        if nearest is not None:
            for allocation in self.allocations:
                if allocation.start == nearest:
                    end = allocation.start + allocation.size
                    if address >= end:
                        past = "just past" if address == end else f"{address - end} bytes past"
                        return f"{past} the end of {allocation.name} ({allocation.size} bytes)"
                    return f"{allocation.start - address} bytes before {allocation.name}"
        return self.unmapped

    def save(self, path: Path) -> None:
        data = {
            "allocations": [asdict(a) for a in self.allocations],
            "pool": None if self.pool is None else asdict(self.pool),
            "unmapped": self.unmapped,
        }
        Path(path).write_text(json.dumps(data))

    @staticmethod
    def load(path: Path) -> "AllocationMap":
        data = json.loads(Path(path).read_text())
        pool = PoolLayout(**data["pool"]) if data.get("pool") else None
        return AllocationMap(
            [Allocation(**a) for a in data.get("allocations", [])], pool, data.get("unmapped", HARNESS_UNMAPPED)
        )
