"""The kinds of layer the contract knows, one object each (``AttentionSpec.layout``):
what differs between MHA/GQA and DeepSeek's absorbed MLA (the shape of a token's key and value,
what a cache entry holds, which part of it the attention weighs, how many fp8 scales a layer has)
is asked of the kind, so that code serving both never branches on its name.

* MHA (GQA and MQA too): a token's key ``[num_kv_heads, head_dim]`` and value
  ``[num_kv_heads, v_head_dim]``, two cache planes, a scale for each.
* MLA (absorbed): one latent entry ``[kv_lora_rank + rope_dim]`` per token, no separate value (the
  attention weighs the entry's first ``kv_lora_rank`` channels), one cache plane, one scale.
* The indexer (DeepSeek-V3.2's lightning indexer, the layer that chooses a sparse MLA layer's
  positions): one index key ``[head_dim]`` per token, no value; its output is each token's top
  ``sparse_topk`` positions, not an attention.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from backends.base import AttentionSpec


class LayerKind(abc.ABC):
    name: ClassVar[str]
    separate_value: ClassVar[bool]  # a value (and its fp8 scale) of its own beside the key
    attends: ClassVar[bool] = True  # its output is an attention over the keys (an indexer's: positions)

    @abc.abstractmethod
    def validate(self, spec: "AttentionSpec") -> None:
        """Raise ValueError for a spec this kind cannot have."""

    @abc.abstractmethod
    def v_head_dim(self, spec: "AttentionSpec") -> int:
        """The value's (and the output's) head dim."""

    def output_shape(self, spec: "AttentionSpec", rows: int) -> tuple[int, ...]:
        """What ``forward`` writes into for ``rows`` query rows: an attention's values."""
        return (rows, spec.num_heads, self.v_head_dim(spec))

    def output_dtype(self, spec: "AttentionSpec") -> torch.dtype:
        return spec.dtype

    # What a step must at the least read and compute (the bench's roofline), per request.
    def keys_read(self, spec: "AttentionSpec", seq_len: int) -> int:
        """Cache entries a request's step reads at the least: every one, or a sparse layer's top-k
        and window part (the most one token attends)."""
        if spec.sparse_topk is None:
            return seq_len
        return min(seq_len, spec.sparse_topk + (spec.sparse_window or 0))

    def scores(self, spec: "AttentionSpec", context_len: int, query_len: int) -> float:
        """Query token × key pairs a request's step weighs: each token's causal prefix, or a
        sparse layer's top-k and window part."""
        per_token = context_len + (query_len + 1) / 2
        if spec.sparse_topk is not None:
            per_token = min(per_token, spec.sparse_topk + (spec.sparse_window or 0))
        return query_len * per_token

    def flops_per_score(self, spec: "AttentionSpec") -> int:
        """FLOPs of one query token × key pair: its scores over every head and the values weighed."""
        return 2 * spec.num_heads * (spec.head_dim + self.v_head_dim(spec))

    def io_elements(self, spec: "AttentionSpec") -> int:
        """Elements a query token moves besides the cache: its query in, its output out."""
        return spec.num_heads * (spec.head_dim + self.v_head_dim(spec))

    def stored_entries(self, key: torch.Tensor, value: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What ``read_kv`` returned, as the kind's attention reads it: its keys and values as they
        are (an fp8 layer's scale is the layer's, applied by the reader)."""
        return key, value

    @abc.abstractmethod
    def key_shape(self, spec: "AttentionSpec", tokens: int) -> tuple[int, ...]:
        """The shape of ``tokens`` tokens' keys (MLA: their latent entries)."""

    @abc.abstractmethod
    def value_shape(self, spec: "AttentionSpec", tokens: int) -> tuple[int, ...] | None:
        """The shape of their values; None where the key is the value too."""

    @abc.abstractmethod
    def plane_row(self, spec: "AttentionSpec") -> int:
        """Elements one token takes in one cache plane."""

    @abc.abstractmethod
    def cache_row(self, spec: "AttentionSpec") -> int:
        """Elements one token's key and value take together."""

    @abc.abstractmethod
    def head_values(
        self, spec: "AttentionSpec", key: torch.Tensor, value: torch.Tensor | None, head: int
    ) -> torch.Tensor:
        """``[seq, v_head_dim]``: what query head ``head`` weighs, from a request's keys and values."""

    @abc.abstractmethod
    def scales(self, k_scale: float, v_scale: float) -> tuple[float, float]:
        """The (k, v) fp8 scales a layer has (MLA: one, the key's, for its one latent entry)."""

    @abc.abstractmethod
    def key_heads(self, key: torch.Tensor) -> torch.Tensor:
        """Keys with a KV-head axis (``[seq, kv_heads, head_dim]``), as an MHA reference takes them."""

    @abc.abstractmethod
    def value_heads(self, spec: "AttentionSpec", key: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
        """Values with a KV-head axis (``[seq, kv_heads, v_head_dim]``), as an MHA reference takes them."""


class MHA(LayerKind):
    name = "mha"
    separate_value = True

    def validate(self, spec: "AttentionSpec") -> None:
        if spec.value_head_dim is not None and spec.value_head_dim < 1:
            raise ValueError("value_head_dim is an MHA/GQA layer's (MLA's value is its latent), and at least 1")
        if spec.sparse_topk is not None:
            raise ValueError("sparse attention (sparse_topk) is an MLA layer's (DeepSeek's DSA)")

    def v_head_dim(self, spec: "AttentionSpec") -> int:
        return spec.head_dim if spec.value_head_dim is None else spec.value_head_dim

    def key_shape(self, spec: "AttentionSpec", tokens: int) -> tuple[int, ...]:
        return (tokens, spec.num_kv_heads, spec.head_dim)

    def value_shape(self, spec: "AttentionSpec", tokens: int) -> tuple[int, ...] | None:
        return (tokens, spec.num_kv_heads, spec.v_head_dim)

    def plane_row(self, spec: "AttentionSpec") -> int:
        return spec.num_kv_heads * spec.head_dim

    def cache_row(self, spec: "AttentionSpec") -> int:
        return 2 * spec.num_kv_heads * spec.head_dim

    def head_values(self, spec, key, value, head):
        return value[:, head // spec.query_group_size]

    def scales(self, k_scale: float, v_scale: float) -> tuple[float, float]:
        return k_scale, v_scale

    def key_heads(self, key: torch.Tensor) -> torch.Tensor:
        return key

    def value_heads(self, spec, key, value):
        return value


class OneEntry(LayerKind):
    """A kind with one entry a token and no value of its own (MLA's latent, an indexer's key):
    one cache plane, one fp8 scale."""

    separate_value = False

    def key_shape(self, spec: "AttentionSpec", tokens: int) -> tuple[int, ...]:
        return (tokens, spec.head_dim)

    def value_shape(self, spec: "AttentionSpec", tokens: int) -> tuple[int, ...] | None:
        return None

    def plane_row(self, spec: "AttentionSpec") -> int:
        return spec.head_dim

    def cache_row(self, spec: "AttentionSpec") -> int:
        return spec.head_dim

    def scales(self, k_scale: float, v_scale: float) -> tuple[float, float]:
        return k_scale, k_scale

    def key_heads(self, key: torch.Tensor) -> torch.Tensor:
        return key[:, None, :]  # one entry shared by every query head


class MLA(OneEntry):
    name = "mla"

    def validate(self, spec: "AttentionSpec") -> None:
        if spec.num_kv_heads != 1:
            raise ValueError("MLA has one latent KV head (num_kv_heads=1)")
        if spec.head_dim != spec.kv_lora_rank + spec.rope_dim or spec.kv_lora_rank <= 0:
            raise ValueError("MLA head_dim must equal kv_lora_rank + rope_dim")
        if spec.value_head_dim is not None:
            raise ValueError("value_head_dim is an MHA/GQA layer's (MLA's value is its latent), and at least 1")
        if spec.attention_sinks:
            raise ValueError("learned attention sinks are an MHA/GQA layer's (gpt-oss), not MLA's")

    def v_head_dim(self, spec: "AttentionSpec") -> int:
        return spec.kv_lora_rank

    def head_values(self, spec, key, value, head):
        return key[:, : spec.kv_lora_rank]

    def value_heads(self, spec, key, value):
        return key[:, None, : spec.kv_lora_rank]  # the entry's latent part is the value


class Indexer(OneEntry):
    """DeepSeek-V3.2's lightning indexer (``backends.base``: "The indexer"): ``num_heads`` index
    heads of ``head_dim`` over one index key a token; ``v_head_dim`` is its output row's width, the
    ``sparse_topk`` positions it chooses."""

    name = "indexer"
    attends = False

    def validate(self, spec: "AttentionSpec") -> None:
        if spec.num_kv_heads != 1 or spec.sparse_topk is None:
            raise ValueError("an indexer has one index key a token (num_kv_heads=1) and a top-k (sparse_topk)")
        others = {
            "value_head_dim": spec.value_head_dim,
            "sliding_window": spec.sliding_window,
            "logits_soft_cap": spec.logits_soft_cap,
            "sparse_window": spec.sparse_window,
        }
        given = [name for name, value in others.items() if value is not None]
        given += ["attention_sinks"] * spec.attention_sinks
        if given:
            raise ValueError(f"an indexer has no {', '.join(given)}")

    def v_head_dim(self, spec: "AttentionSpec") -> int:
        return spec.sparse_topk

    def output_shape(self, spec: "AttentionSpec", rows: int) -> tuple[int, ...]:
        return (rows, spec.sparse_topk)  # each token's chosen positions

    def keys_read(self, spec, seq_len):
        return seq_len  # it scores every key it may see; its top-k is what it writes

    def scores(self, spec, context_len, query_len):
        return query_len * (context_len + (query_len + 1) / 2)

    def flops_per_score(self, spec):
        return 2 * spec.num_heads * spec.head_dim  # q_h · k for every head; no values weighed

    def io_elements(self, spec):
        return spec.num_heads * (spec.head_dim + 1) + spec.sparse_topk  # query and weights in, positions out

    def stored_entries(self, key, value):
        if value is None:  # keys in the compute dtype
            return key, None
        return key.double() * value.double()[:, None], None  # each fp8 key times its own scale

    def output_dtype(self, spec: "AttentionSpec") -> torch.dtype:
        return torch.int32

    def head_values(self, spec, key, value, head):
        raise TypeError("an indexer weighs no values")

    def value_heads(self, spec, key, value):
        raise TypeError("an indexer weighs no values")


LAYER_KINDS: dict[str, LayerKind] = {kind.name: kind for kind in (MHA(), MLA(), Indexer())}
