"""Inputs must come back as they went in: a backend that scales the query in place, applies rope
to the key it was handed, clamps ``seq_lens`` or rewrites the block table corrupts the engine's
next use of them (the next layer's query, the next step's lengths) while its own output is right.

``InputWatch`` keeps a copy of every tensor the backend is handed and, after each call (``build``,
``write_kv``, ``forward``), a fingerprint of each, made on the device in stream order: nothing is
read on the host between the calls, so a watched step still runs as an engine's does (queued
behind a busy stream, or with the next step built while it is in flight). ``changes()``, after the
step has run, compares the fingerprints and, for a changed tensor, finds its first changed element
against the copy. Host tensors (the host lengths) are compared directly.

The layer's own inputs, its ``LayerParameters`` (an fp8 layer's ``scales``, learned ``sinks``, any
field added later; not ``lse``, an output the backend writes), are watched whole, whatever they
hold: every tensor in them as above, every host number by value (``scales.k_scale``). The KV
pool is watched outside the blocks the step writes: a digest per block (``PoolWatch``), since a
copy of a full-suite pool would not fit beside it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from backends.base import LayerParameters


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The elements as integers of their width, flattened: NaN equal to itself, -0 unequal to 0."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(width).reshape(-1)


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A 2-element int64 digest on the tensor's device: the sum of its bit patterns and their sum
    weighted by position, so a change, a swap or a shift of elements changes it (int64 wraps alike
    on every device)."""
    bits = _bits(tensor).long()
    positions = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
    return torch.stack([bits.sum(), (bits * positions).sum()])


def layer_inputs(
    layers: dict[str, LayerParameters],
) -> tuple[dict[str, torch.Tensor], dict[str, Callable[[], Any]]]:
    """Every tensor and every host value (read back through a getter) inside each layer's
    parameters but its ``lse`` (``for_write``: the inputs), named by their path
    (``scales.k_scale_tensor``) and then the layer's key in ``layers`` (``""``, `` (layer 1)``):
    dataclasses and sequences are walked, so a field added to ``LayerParameters`` is watched too."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Callable[[], Any]] = {}

    def walk(name: str, suffix: str, value: Any, read: Callable[[], Any]) -> None:
        if isinstance(value, torch.Tensor):
            tensors[name + suffix] = value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for item in dataclasses.fields(value):
                walk(
                    f"{name}.{item.name}", suffix, getattr(value, item.name), lambda v=value, n=item.name: getattr(v, n)
                )
        elif isinstance(value, (list, tuple)):
            for index, element in enumerate(value):
                walk(f"{name}[{index}]", suffix, element, lambda v=value, i=index: v[i])
        else:
            values[name + suffix] = read

    for suffix, layer in layers.items():
        inputs = layer.for_write()
        for item in dataclasses.fields(inputs):
            value = getattr(inputs, item.name)
            if value is not None:  # a feature the layer lacks
                walk(item.name, suffix, value, lambda v=inputs, n=item.name: getattr(v, n))
    return tensors, values


def _same(was: Any, now: Any) -> bool:
    if isinstance(was, float) and isinstance(now, float) and math.isnan(was) and math.isnan(now):
        return True
    return type(was) is type(now) and was == now


@dataclass
class PoolWatch:
    """The KV pool outside the blocks a step writes: a digest per block before the step and after
    each call. A block holding a slot of the step is left out (the NaN-poison pass checks those
    slot by slot); every other block must come back bit for bit."""

    pool: torch.Tensor
    block_dim: int
    written: torch.Tensor  # bool [num_blocks]: blocks the step's slots lie in
    before: torch.Tensor | None = None  # the digest before the step (set by ``of``)

    CHUNK_ELEMENTS = 1 << 24  # digests are made a few blocks at a time: no int64 copy of a whole pool

    @classmethod
    def of(cls, pool: torch.Tensor, num_blocks: int, block_size: int, slots: torch.Tensor) -> "PoolWatch | None":
        """None when the pool's layout does not say which dimension is the block (no single
        dimension of ``num_blocks``)."""
        dims = [dim for dim, extent in enumerate(pool.shape) if extent == num_blocks]
        if len(dims) != 1:
            return None
        # Padding rows' slot -1 lands in a spare last entry; no host read (the step may be queued).
        # scatter_, not written[blocks] = True: that index_put_ waits for the stream on the host
        # (measured on an H200: it hid a backend launching on the default stream).
        slots = slots.to(pool.device).long()
        blocks = torch.where(slots >= 0, torch.div(slots, block_size, rounding_mode="floor"), num_blocks)
        written = torch.zeros(num_blocks + 1, dtype=torch.bool, device=pool.device).scatter_(0, blocks, True)
        watch = cls(pool, dims[0], written[:num_blocks])
        watch.before = watch.digest()
        return watch

    def digest(self) -> torch.Tensor:
        """[num_blocks, 2] int64: each block's sum of bit patterns and their position-weighted sum."""
        blocks = self.pool.movedim(self.block_dim, 0)
        per_block = max(1, blocks[0].numel())
        step = max(1, self.CHUNK_ELEMENTS // per_block)
        positions = torch.arange(1, per_block + 1, device=self.pool.device, dtype=torch.int64)
        parts = []
        for start in range(0, blocks.shape[0], step):
            bits = _bits(blocks[start : start + step]).view(-1, per_block).long()
            parts.append(torch.stack([bits.sum(1), (bits * positions).sum(1)], dim=1))
        return torch.cat(parts)

    def changed_blocks(self, digest: torch.Tensor) -> list[int]:
        differs = (digest != self.before).any(dim=1) & ~self.written
        return differs.nonzero().flatten().tolist()


@dataclass
class InputWatch:
    tensors: dict[str, torch.Tensor]
    values: dict[str, Callable[[], Any]] = field(default_factory=dict)  # host values: name -> how to read it now
    copies: dict[str, torch.Tensor] = field(default_factory=dict)
    value_copies: dict[str, Any] = field(default_factory=dict)
    before: dict[str, torch.Tensor] = field(default_factory=dict)
    after: list[tuple[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    pools: dict[str, PoolWatch] = field(default_factory=dict)  # name -> the pool outside the step's blocks
    pools_after: list[tuple[str, dict[str, torch.Tensor]]] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        tensors: dict[str, torch.Tensor | None],
        layers: dict[str, LayerParameters] | None = None,
        pools: dict[str, PoolWatch | None] | None = None,
    ) -> "InputWatch":
        """``layers``: each layer's ``LayerParameters`` by the suffix its inputs are named with
        (``""`` for a step's one layer), watched whole (``layer_inputs``); ``pools``: each layer's KV
        pool outside the step's blocks, by name."""
        layer_tensors, values = layer_inputs(layers or {})
        given = {**tensors, **layer_tensors}
        watch = cls({name: tensor for name, tensor in given.items() if tensor is not None and tensor.numel()}, values)
        for name, tensor in watch.tensors.items():
            watch.copies[name] = tensor.clone()
            watch.before[name] = fingerprint(tensor)
        watch.value_copies = {name: read() for name, read in values.items()}
        watch.pools = {name: pool for name, pool in (pools or {}).items() if pool is not None}
        return watch

    def called(self, call: str) -> None:
        """Fingerprint every watched tensor after ``call`` returned (queued, not waited for)."""
        self.after.append((call, {name: fingerprint(tensor) for name, tensor in self.tensors.items()}))
        if self.pools:
            self.pools_after.append((call, {name: pool.digest() for name, pool in self.pools.items()}))

    def changes(self) -> list[str]:
        """Per changed input: the first call after which it differed, and its first changed element
        (a host value: what it became; the pool: the blocks outside the step's that changed)."""
        found = []
        for name, read in self.values.items():
            now = read()
            if not _same(self.value_copies[name], now):
                found.append(f"the step's calls changed {name} ({self.value_copies[name]!r} → {now!r})")
        for name, pool in self.pools.items():
            for call, digests in self.pools_after:
                blocks = pool.changed_blocks(digests[name])
                if blocks:
                    shown = ", ".join(map(str, blocks[:4])) + (", …" if len(blocks) > 4 else "")
                    found.append(
                        f"{call} changed the {name} outside the blocks the step writes "
                        f"({len(blocks)} block(s): {shown})"
                    )
                    break
        for name, tensor in self.tensors.items():
            call = next((call for call, prints in self.after if not torch.equal(prints[name], self.before[name])), None)
            if call is None:
                continue
            now, then = _bits(tensor), _bits(self.copies[name])
            changed = (now != then).nonzero()
            where = (
                "then put back by the end of the step"
                if not changed.numel()
                else self._element(name, int(changed[0]), tensor)
            )
            found.append(f"{call} changed {name} ({where})")
        return found

    def _element(self, name: str, flat: int, tensor: torch.Tensor) -> str:
        index, rest = [], flat
        for size in reversed(tensor.shape):  # divmod, not torch.unravel_index (its first call imports sympy)
            rest, position = divmod(rest, size)
            index.insert(0, position)
        was, now = self.copies[name].reshape(-1)[flat], tensor.contiguous().reshape(-1)[flat]
        return f"first at [{', '.join(map(str, index))}]: {_value(was)} → {_value(now)}"


def _value(element: torch.Tensor) -> str:
    return f"{element.double().item():.6g}" if element.is_floating_point() else str(element.item())
