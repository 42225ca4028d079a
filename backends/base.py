"""The contract every attention backend implements.

Names follow vLLM's v1 attention contract where one exists (``CommonAttentionMetadata``,
``query_start_loc``, ``seq_lens``, ``slot_mapping``, ``CGSupport``), so a backend author finds
what they already know.

Conventions shared by every backend and the harness:

* Slots: ``slot = physical_block * block_size + offset``. ``slot_mapping == -1`` means
  "write nothing" (graph padding rows).
* Block 0 is reserved: no real request ever owns it. Graph padding rows point their block-table
  rows at it, so whatever a padded row reads is harmless.
* MHA/GQA: ``key``/``value`` are ``[T, num_kv_heads, head_dim]``; ``query`` ``[T, num_heads, head_dim]``.
* MLA (absorbed): ``key`` is the latent entry ``[T, kv_lora_rank + rope_dim]``, ``value`` is None;
  ``query`` is ``[T, num_heads, kv_lora_rank + rope_dim]``; output ``[T, num_heads, kv_lora_rank]``.
* Token ``i`` of request ``r`` sits at position ``seq_lens[r] - query_len[r] + i`` and attends
  causally to every earlier position of its own request (within the sliding window, if any).
* Token trees (feature ``token_trees``; EAGLE's top-k > 1 drafting, verified in one step): a
  step's metadata may carry ``tree_parents``, int32 ``[num_actual_tokens]`` on the device (and
  ``tree_parents_cpu`` on the host, where the producer knew it), each token's parent as an index
  among its own request's new tokens, -1 where its parent is the context's last token; a parent
  always precedes its children. Without it (None) every request is a chain, ``[-1, 0, 1, ...]``.
  Token ``i`` of a tree sits at position ``context_len + depth(i)`` (the root's depth 0: what rope
  and the sliding window see) and has its own KV slot (``slot_mapping``, as every new token); it
  sees every context key and, among its request's new tokens, its ancestors and itself, nothing
  else (not its siblings, not a later token of another branch); with a sliding window W, only the
  keys whose *position* is within W of its own (``backends.token_tree``). The tree belongs to the
  step: every layer of it, and its graph replays, read the metadata's, and a captured graph must
  read the parents of the step it replays. An engine that verifies trees hands tree metadata to
  every step of a graph it captures for them (a chain written as a tree, an idle capture's of no
  token), so a backend may specialize a graph on a tree's presence, not on its shape.
* Features (``backends.features``): what a case may ask beyond attention over a cache in the
  compute dtype; a backend claims each by name in ``Capabilities.features``. What a layer hands
  ``write_kv`` and ``forward`` for them is one ``LayerParameters`` (scales, sinks, the LSE buffer).
* fp8 KV cache (``AttentionSpec.kv_cache_dtype`` ``float8_e4m3fn`` or ``float8_e5m2``: features
  ``fp8_e4m3_kv_cache``, ``fp8_e5m2_kv_cache``): ``write_kv`` and ``forward`` get the layer's
  ``Fp8Scales`` (``layer.scales``). ``write_kv`` stores ``value / scale`` rounded to the nearest fp8 number,
  ties to even, saturated to the format's largest finite magnitude (448 for e4m3, 57344 for
  e5m2), as vLLM's cache writers do; ``forward`` computes the attention of the dequantized cache
  (``stored × scale``). Keys use ``k_scale``, values ``v_scale``; MLA's latent entry uses
  ``k_scale`` alone (DeepSeek's one scale). Scales belong to a layer, not to the backend: every
  layer of a step may pass other scales with the same metadata. ``read_kv`` returns what
  ``write_kv`` stored, so the harness can check both halves separately.
* fp8 query (``AttentionSpec.query_dtype`` ``float8_e4m3fn``, feature ``fp8_query``; vLLM's
  ``supports_quant_query_input``): ``forward`` is handed the query in e4m3, quantized as a cache
  is (``query / q_scale``, nearest, saturated at 448), and the layer's ``Fp8Scales`` with its
  ``q_scale`` (host float and 1-element device tensor, as for k and v; k and v 1 without an fp8
  cache); it computes the attention of the dequantized query (``stored × q_scale``) and writes its
  output in the compute dtype. The q scale is the layer's, like k and v's.
* Decode context parallelism (feature ``dcp``; vLLM's ``decode_context_parallel_size``): each
  request's KV is sharded over R ranks token by token (position ``p`` on rank ``p % R``, at local
  position ``p // R``), and each rank's backend is handed a decode step over its shard: every
  query head, each request's ``seq_lens`` the keys that rank holds (vLLM's ``dcp_local_seq_lens``),
  its own block table, and the new token's key to write only where it owns it (``slot_mapping`` -1
  elsewhere). A rank may hold no key of a request: its row has ``seq_lens`` 0 and must give output
  0 and LSE ``-inf``, reading no block. The ranks' outputs are merged by their natural-log LSEs
  (``layer.lse``, which a DCP step always hands; vLLM's ``cp_lse_ag_out_rs``). Decode rows only:
  a verify row's per-token causal cut over a rank's keys is not handed to a backend yet. In a
  draft loop each rank's lengths advance by their own pattern (``update_for_draft_step``).
* Log-sum-exp (feature ``lse``): ``forward`` may be handed ``layer.lse``, a
  float32 ``[rows, num_heads]`` tensor; a backend that claims it writes, for each of the first
  ``num_actual_tokens`` rows and each head, the natural log of its softmax's denominator,
  ``log(Σ_j exp(s_j) + exp(sink))`` over the scaled, soft-capped, visible logits: what merges
  partial results (vLLM's ``merge_attn_states``, MLA prefill over context chunks) consume.
* Padding (``PaddingStyle``; empty requests are feature ``empty_requests``): an engine pads a batch to
  a captured graph's shape with padding *rows* (requests of at least one token, seq_len =
  query_len, block-table rows 0, slots -1: ``ROWS``, every backend) or, as vLLM does, with *empty
  requests* (query length 0, so ``query_start_loc`` repeats, seq_len 0, block-table rows -1:
  ``EMPTY_REQUESTS``). A backend that claims the latter leaves every real row exact and writes
  nothing for an empty request: no output row (it has none; ``query_start_loc[r + 1] - 1`` is the
  previous request's last token), no cache slot, and it reads no block of a -1 row.
* Sparse attention (``AttentionSpec.sparse_topk``, feature ``sparse_topk``; DeepSeek-V3.2's DSA,
  an MLA layer): a lightning indexer chooses, for each query token, the positions it attends.
  ``forward`` gets them as ``layer.topk_indices``, int32 ``[rows, sparse_topk]`` on the device, one
  row per query row: positions inside the token's own request (0 is its first token), as vLLM's
  indexer writes them, never cache slots; translating a position to a slot through the block
  table is the backend's job. ``-1`` is no entry and may stand anywhere in a row. A token at
  position ``p`` attends to the entries ``0 <= i <= p`` of its row and to nothing else: an entry
  past its own position (``i > p``, even ``i >= seq_len``) is ignored, as causality says. A row
  lists a position it attends at most once and, without a window part, holds at least one entry
  ``<= p`` (an indexer's top-k over the token's visible positions does both); rows past
  ``num_actual_tokens`` (padding) are all -1.
  With a window part (``sparse_window`` W, feature ``sparse_window``: DeepSeek-V4's sliding
  part), the token also attends to the W most recent positions ``p - W + 1 .. p``, and its row
  then lists only positions older than those (``i <= p - W``), so the two sets never overlap.
  Each attended position is one term of the softmax (scale, cap and LSE as for dense attention).
  Indices and lengths are step data, and position-derived metadata (a window's first position,
  each token's position) must follow the positions: ``update_for_draft_step`` advances it.
* The indexer (``AttentionSpec.kind == "indexer"``: DeepSeek-V3.2's lightning indexer, the layer
  that chooses a sparse layer's positions) is a layer of its own kind, served by a backend that
  claims ``"indexer"`` in ``Capabilities.kinds`` through the same methods. ``write_kv`` stores each
  token's index key ``[head_dim]`` (``value`` is None); with an fp8 cache (``kv_cache_dtype``
  e4m3) it stores ``key / s`` rounded to the nearest e4m3 number, ``s`` the token's own scale, the
  smallest power of two at least ``max|key| / 448`` (DeepSeek's ue8m0 scales), and ``read_kv``
  returns ``(stored keys [n, head_dim], their scales [n] float32)``. ``forward`` gets the query
  ``[T, num_heads, head_dim]`` and ``layer.index_weights`` (float32 ``[rows, num_heads]``: each
  token's head weights, the softmax scale folded in, as the model computes them) and writes into
  ``out`` (int32 ``[rows, sparse_topk]``), for each real token at position ``p``, the positions
  ``s <= p`` of its own request with the largest logits ``Σ_h w_h · max(0, q_h · k_s)`` over the
  dequantized stored keys: all of them (then -1) where the token has at most ``sparse_topk``, in
  any order, each once. Rows past ``num_actual_tokens`` stay as they were.
* DeepSeek's fp8_ds_mla cache (``AttentionSpec.kv_scale_block`` 128 on an MLA layer with an e4m3
  cache, feature ``fp8_ds_mla_kv_cache``): the scales are the cache's own, not the layer's.
  ``write_kv`` stores each token's latent in tiles of 128 values, each tile as ``x / s`` rounded to
  the nearest e4m3 number with ``s = max(max|x| / 448, FLT_MIN)`` in float32 (vLLM's writer), and
  its rope part as given; ``layer.scales`` is None. vLLM's layout is 656 bytes a token (512 e4m3,
  four float32 scales, 64 bf16 rope values); a backend may lay it out as it likes, and its
  ``read_kv`` returns each token's entry dequantized, float32 ``[n, head_dim]`` (latent × its
  tile's scale, then the rope part), and None.
* Learned attention sinks (``AttentionSpec.attention_sinks``, claimed by
  feature ``attention_sinks``; gpt-oss): ``forward`` gets the layer's ``sinks`` (``layer.sinks``), a
  float32 device tensor ``[num_heads]``, one logit per *query* head, persistent like a layer's
  weights. Each query head's softmax gains one term in its denominator and none in its numerator:
  ``out = Σ_j exp(s_j − m) v_j / (Σ_j exp(s_j − m) + exp(sink_h − m))`` (any common ``m``), on
  every path (decode, verify, prefill). Sinks belong to a layer, as scales do.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar

import torch

from backends.features import EMPTY_REQUESTS, FEATURES, Feature, Needs
from backends.layer_kinds import LAYER_KINDS, LayerKind

FP8_KV_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}


def kv_dtype_name(dtype: torch.dtype) -> str:
    """fp8 formats as the case grammar writes them (fp8e4m3, fp8e5m2); others as ``dtype_name``."""
    return {torch.float8_e4m3fn: "fp8e4m3", torch.float8_e5m2: "fp8e5m2"}.get(dtype) or dtype_name(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPE_NAMES.items():
        if value == dtype:
            return name
    return str(dtype).removeprefix("torch.")


class CGSupport(enum.IntEnum):
    """How much of a step a backend lets an engine capture in a CUDA graph (vLLM's names)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # every request has query length 1
    UNIFORM_BATCH = 2  # every request has the same query length (decode, spec-verify 1+k)
    ALWAYS = 3  # any batch, mixed prefill + decode included


class PaddingStyle(enum.Enum):
    """How an engine pads a batch up to a captured CUDA graph's shape (module docstring)."""

    ROWS = "rows"  # padding requests of >= 1 token, seq_len = query_len, block-table rows 0, slots -1
    EMPTY_REQUESTS = "empty requests"  # vLLM's: query length 0, seq_len 0, block-table rows -1


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer asks of a backend."""

    kind: str  # "mha" (covers GQA/MQA), "mla", or "indexer" (DeepSeek-V3.2's lightning indexer)
    num_heads: int
    num_kv_heads: int
    head_dim: int  # MHA: per-head dim. MLA: kv_lora_rank + rope_dim.
    dtype: torch.dtype
    block_size: int = 16
    kv_cache_dtype: torch.dtype | None = None  # None: same as dtype; or an fp8 format (FP8_KV_DTYPES)
    sliding_window: int | None = None  # a token sees itself and the sliding_window - 1 before it
    logits_soft_cap: float | None = None  # scores become cap * tanh(scores / cap)
    scale: float | None = None  # None: 1 / sqrt(qk head dim)
    attention_sinks: bool = False  # learned per-head sink logits (gpt-oss), handed to forward as ``sinks``
    value_head_dim: int | None = None  # MHA: the value (and output) head dim where it is not head_dim
    kv_lora_rank: int = 0  # MLA only
    rope_dim: int = 0  # MLA only
    sparse_topk: int | None = None  # MLA: attends to its layer.topk_indices row; an indexer: how many it chooses
    sparse_window: int | None = None  # a sparse layer's window part: the W most recent positions too
    kv_scale_block: int | None = None  # MLA fp8: a scale per this many latent values a token (fp8_ds_mla: 128)
    query_dtype: torch.dtype | None = None  # None: the query in dtype; float8_e4m3fn: an fp8 query (q_scale)

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, LAYER_KINDS))}, not {self.kind!r}")
        self.layout.validate(self)
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.sparse_topk is not None and self.sparse_topk < 1:
            raise ValueError("sparse_topk: a sparse layer attends to at least 1 indexed position a token")
        if self.sparse_window is not None and (self.sparse_topk is None or self.sparse_window < 1):
            raise ValueError("sparse_window is a sparse layer's window part (give sparse_topk), at least 1 position")
        if self.sparse_topk is not None and self.sliding_window is not None:
            raise ValueError("a sparse layer's window is its window part (sparse_window), not a sliding window")
        if self.kv_scale_block is not None and not (
            self.kind == "mla"
            and self.kv_cache_dtype == torch.float8_e4m3fn
            and self.kv_lora_rank % self.kv_scale_block == 0
        ):
            raise ValueError(
                "kv_scale_block is an MLA layer's e4m3 cache (DeepSeek's fp8_ds_mla), its latent whole blocks"
            )
        if self.query_dtype not in (None, self.dtype, torch.float8_e4m3fn) or (
            self.fp8_query and self.kind == "indexer"
        ):
            raise ValueError("query_dtype: the compute dtype, or float8_e4m3fn for an attention layer (an fp8 query)")
        if self.kv_cache_dtype not in (None, self.dtype) and self.kv_cache_dtype not in FP8_KV_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} is neither the compute dtype nor an fp8 format")

    @property
    def layout(self) -> LayerKind:
        """The layer kind's object (``backends.layer_kinds``): what differs between MHA and MLA."""
        return LAYER_KINDS[self.kind]

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype in FP8_KV_DTYPES

    @property
    def fp8_query(self) -> bool:
        return self.query_dtype == torch.float8_e4m3fn

    @property
    def handed_query_dtype(self) -> torch.dtype:
        """The dtype of the query ``forward`` is handed: e4m3 for an fp8 query, else the compute dtype."""
        return self.query_dtype or self.dtype

    @property
    def effective_kv_cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    @property
    def v_head_dim(self) -> int:
        return self.layout.v_head_dim(self)

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def query_group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class Fp8Scales:
    """One layer's per-tensor fp8 scales, the KV cache's and the query's, in both forms vLLM hands
    a backend: host floats (``layer._k_scale_float``, ``_q_scale_float``) and 1-element float32
    device tensors (``layer._k_scale``, ``_q_scale``). A kernel that reads the device tensor stays
    graph-safe; reading it on the host (``.item()``) is a host sync. Stored = value / scale;
    dequantized = stored × scale. A layer without an fp8 cache has k and v scales 1; one without an
    fp8 query, a q scale 1."""

    k_scale: float
    v_scale: float
    k_scale_tensor: torch.Tensor  # [1] float32, device
    v_scale_tensor: torch.Tensor  # [1] float32, device
    q_scale: float = 1.0
    q_scale_tensor: torch.Tensor | None = None  # [1] float32, device (``on`` always makes it)

    @classmethod
    def on(cls, device: torch.device | str, k_scale: float, v_scale: float, q_scale: float = 1.0) -> "Fp8Scales":
        def tensor(value: float) -> torch.Tensor:
            return torch.full((1,), value, dtype=torch.float32, device=device)

        return cls(k_scale, v_scale, tensor(k_scale), tensor(v_scale), q_scale, tensor(q_scale))


KVScales = Fp8Scales  # its name before the query's scale joined it: a backend written against it still imports


@dataclass(frozen=True)
class LayerParameters:
    """What one layer hands ``write_kv`` and ``forward`` beyond the step's tensors: one typed object,
    the same for every backend, so that a feature to come is one more field here, not one more
    keyword in every signature. A field is None where the layer has no such thing; a backend reads
    only the fields of the features it claims (``Capabilities.features``).

    * ``scales``: an fp8 layer's ``Fp8Scales``, its cache's and its query's (``write_kv`` stores
      ``value / scale``; ``forward`` attends over ``stored × scale``, with ``query × q_scale``).
    * ``sinks``: a layer's learned sink logits, float32 ``[num_heads]`` on the device (gpt-oss).
    * ``lse``: ``forward`` only: float32 ``[rows, num_heads]`` where a backend that claims the
      log-sum-exp writes it for the first ``num_actual_tokens`` rows.
    * ``topk_indices``: ``forward`` only, a sparse layer's (``sparse_topk``): int32 ``[rows,
      sparse_topk]``, each query row's indexed positions (module docstring), this step's.
    * ``index_weights``: ``forward`` only, an indexer's: float32 ``[rows, num_heads]``, each
      token's head weights (module docstring), this step's.

    Scales and sinks belong to a layer, like its weights: every layer of a step hands its own with
    the same metadata, and a backend keeps none of them between calls."""

    scales: Fp8Scales | None = None
    sinks: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    topk_indices: torch.Tensor | None = None
    index_weights: torch.Tensor | None = None

    def for_write(self) -> "LayerParameters":
        """What ``write_kv`` is handed: the layer less what only ``forward`` reads or writes."""
        return replace(self, lse=None, topk_indices=None, index_weights=None)

    def with_indices(self, topk_indices: torch.Tensor | None) -> "LayerParameters":
        return replace(self, topk_indices=topk_indices)

    def with_lse(self, lse: torch.Tensor | None) -> "LayerParameters":
        return replace(self, lse=lse)

    def rows_of(self, cut: Callable[[torch.Tensor], torch.Tensor]) -> "LayerParameters":
        """These parameters for a run of the step's rows (an engine handing part of a step to another
        backend): every field with a row per query row (``lse``, ``topk_indices``,
        ``index_weights``) cut by ``cut``; scales and sinks are the layer's, whole."""
        per_row = {"lse": self.lse, "topk_indices": self.topk_indices, "index_weights": self.index_weights}
        return replace(self, **{name: cut(rows) for name, rows in per_row.items() if rows is not None})


PLAIN_LAYER = LayerParameters()  # a layer with none of them: the compute-dtype cache, no sinks, no LSE


@dataclass(frozen=True)
class BackendLimits:
    """Static sizes a backend may allocate persistent buffers for, once, in ``__init__``."""

    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int

    def max_blocks_per_req(self, block_size: int) -> int:
        return -(-self.max_model_len // block_size)


@dataclass(frozen=True)
class DeviceInfo:
    """The device a backend would run on, reduced to what claims are checked against."""

    type: str  # "cpu" or "cuda"
    name: str = ""
    compute_capability: tuple[int, int] | None = None

    @staticmethod
    def of(device: "torch.device | str | DeviceInfo") -> "DeviceInfo":
        if isinstance(device, DeviceInfo):
            return device
        device = torch.device(device)
        if device.type != "cuda":
            return DeviceInfo(type=device.type, name=device.type)
        if not torch.cuda.is_available():
            return DeviceInfo(type="cuda", name="(no CUDA device)")
        return DeviceInfo(
            type="cuda",
            name=torch.cuda.get_device_name(device),
            compute_capability=tuple(torch.cuda.get_device_capability(device)),
        )

    @property
    def sm(self) -> str:
        if self.compute_capability is None:
            return "no compute capability"
        major, minor = self.compute_capability
        return f"SM{major}{minor}"


def _format_set(values) -> str:
    return ", ".join(sorted(str(v) for v in values))


def _sm_names(capabilities: "frozenset[tuple[int, int]] | None") -> list[str] | None:
    return None if capabilities is None else [f"SM{a}{b}" for a, b in sorted(capabilities)]


def plain(value: Any) -> Any:
    """A claim's value as JSON holds it: dtypes by their case-grammar names, enums and features by
    name, sets sorted, mappings with plain keys; every field of ``Capabilities`` goes through here
    (or through its field's own ``encode``), so a new field needs no line in ``to_dict``."""
    if isinstance(value, enum.Enum):  # before int: CGSupport is an IntEnum
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return kv_dtype_name(value)
    if isinstance(value, Feature):
        return value.name
    if isinstance(value, (set, frozenset)):
        return sorted(plain(item) for item in value)
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {plain(key): plain(item) for key, item in sorted(value.items(), key=lambda pair: str(plain(pair[0])))}
    if dataclasses.is_dataclass(value):
        return {item.name: _encoded(item, getattr(value, item.name)) for item in dataclasses.fields(value)}
    raise TypeError(f"no plain form for {type(value).__name__}")


def _encoded(field_: dataclasses.Field, value: Any) -> Any:
    encode = field_.metadata.get("encode")
    return encode(value) if encode else plain(value)


@dataclass(frozen=True)
class GpuLimit:
    """The GPUs a claimed feature runs on, where fewer than the backend's, and why."""

    compute_capabilities: frozenset[tuple[int, int]] = field(metadata={"encode": _sm_names})
    why: str = ""


@dataclass(frozen=True)
class OnlyWith:
    """The features a claimed feature is served with, where a backend serves it on some layers only
    (DeepSeek's fp8_ds_mla by a sparse kernel alone, say): a case asking it without every one of
    them SKIPs, quoting ``why``."""

    features: frozenset[Feature]
    why: str = ""


SERVES = {"list": "serves"}  # a field ``conformance list`` shows as what a backend serves
CLAIMS = {"list": "claims"}  # ... as what it claims


@dataclass(frozen=True)
class Capabilities:
    """What a backend claims. Every claim is verified by a check; claim only what passes.

    Three kinds of claim: the layouts it serves (kinds, dtypes, head dims, block sizes, head
    counts, query lengths: limits a case's shape must fall within); the contract's features
    (``backends.features``: fp8 caches, sinks, a value head dim of its own, the LSE, empty
    requests, ...), each claimed by name in ``features`` or, with the reason a SKIP gives, in
    ``not_claimed`` (``feature_only_with``: one claimed for the layers that ask some other
    features too, and why not without them); and behaviours the checks measure (graphs, host
    lengths, draft update, determinism). A field's ``list`` metadata puts it in ``conformance
    list`` (what a backend serves, or what it claims); every field is in ``to_dict``."""

    # What it serves: limits a case's layout must fall within (None: any).
    kinds: frozenset[str] = field(default=frozenset({"mha"}), metadata=SERVES)
    dtypes: frozenset[torch.dtype] = field(default=frozenset({torch.float16, torch.bfloat16}), metadata=SERVES)
    head_dims: frozenset[int] | None = field(default=None, metadata=SERVES)
    block_sizes: frozenset[int] | None = field(default=None, metadata=SERVES)
    num_heads: frozenset[int] | None = field(default=None, metadata=SERVES)  # MLA kernels often fix a few
    max_query_len: int | None = field(default=None, metadata=SERVES)  # None: prefill too; 1: decode only
    # The longest request of a step with token trees (each request a tree then, chains too); None: any.
    max_tree_tokens: int | None = field(default=None, metadata=SERVES)
    uniform_query_len: bool = field(default=False, metadata=SERVES)  # every request of a batch the same length
    only_with: frozenset[Feature] = field(default=frozenset(), metadata=SERVES)  # features every case must ask
    # The contract's features (backends.features): claimed, or why not (said in the SKIP), and
    # where a feature runs on fewer GPUs than the backend.
    features: frozenset[Feature] = field(default=frozenset(), metadata=CLAIMS)
    not_claimed: dict[Feature, str] = field(default_factory=dict)
    feature_gpus: dict[Feature, GpuLimit] = field(default_factory=dict)
    feature_only_with: dict[Feature, OnlyWith] = field(default_factory=dict)  # a claim for some layers only
    # What the checks measure it to do.
    cuda_graphs: CGSupport = field(default=CGSupport.NEVER, metadata=CLAIMS)
    needs_cpu_seq_lens: bool = field(default=True, metadata=CLAIMS)  # False: no host sync without host lengths
    draft_step_update: bool = field(default=False, metadata=CLAIMS)  # update_for_draft_step advances in place
    deterministic: bool = field(default=False, metadata=CLAIMS)  # bitwise-equal output, eager and replay
    batch_invariant: bool = field(default=False, metadata=CLAIMS)  # a request's bits independent of the batch
    # Where it runs.
    devices: frozenset[str] = frozenset({"cuda"})
    compute_capabilities: frozenset[tuple[int, int]] | None = field(default=None, metadata={"encode": _sm_names})
    required_modules: tuple[str, ...] = ()
    install_hint: str = ""  # the command that installs required_modules

    def __post_init__(self) -> None:
        claimed_and_not = sorted(str(f) for f in self.not_claimed if f in self.features)
        if claimed_and_not:
            raise ValueError(f"Capabilities.not_claimed names {', '.join(claimed_and_not)}, claimed in features")
        limited_unclaimed = sorted(str(f) for f in self.feature_only_with if f not in self.features)
        if limited_unclaimed:
            raise ValueError(
                f"Capabilities.feature_only_with names {', '.join(limited_unclaimed)}, not claimed in features"
            )

    def supports(self, feature_: Feature) -> bool:
        return feature_ in self.features

    def availability_reason(self, device: "torch.device | str | DeviceInfo") -> str | None:
        """Why this backend cannot run at all on ``device``; None when it can."""
        info = DeviceInfo.of(device)
        # The machine first: a package installed here would not help a backend that cannot run on it.
        if info.type not in self.devices:
            return f"runs on {_format_set(self.devices)}, not {info.type}"
        if info.type == "cuda" and info.compute_capability is None:
            return "no CUDA device is visible"
        if self.compute_capabilities is not None and info.compute_capability not in self.compute_capabilities:
            wanted = ", ".join(_sm_names(self.compute_capabilities))
            return f"needs compute capability {wanted}; this GPU ({info.name}) is {info.sm}"
        missing = [m for m in self.required_modules if importlib.util.find_spec(m.split(".")[0]) is None]
        if missing:
            hint = f": {self.install_hint}" if self.install_hint else ""
            return f"missing Python package {', '.join(missing)}{hint}"
        return None

    def skip_reason(self, needs: Needs, device: "torch.device | str | DeviceInfo") -> str | None:
        """The one rule table: why this backend cannot run a case asking ``needs`` on ``device``
        (the machine, then the layout's limits, then each feature of ``backends.features`` the
        case asks for, then its query lengths); None when it can."""
        return (
            self.availability_reason(device)
            or self.layout_reason(needs.spec)
            or self.feature_reason(needs, device)
            or (self.query_len_reason(needs.max_query_len, list(needs.query_lens)) if needs.query_lens else None)
            or self.tree_reason(needs.tree_tokens)
        )

    def tree_reason(self, tree_tokens: int) -> str | None:
        if self.max_tree_tokens is not None and tree_tokens > self.max_tree_tokens:
            return (
                f"a step of token trees with a request of {tree_tokens} tokens exceeds the claimed maximum "
                f"{self.max_tree_tokens} (every request of such a step is a tree to the backend)"
            )
        return None

    def unsupported_reason(self, spec: AttentionSpec, device: "torch.device | str | DeviceInfo") -> str | None:
        """Why this backend cannot run layer ``spec`` on ``device`` (any batch); None when it can."""
        return self.skip_reason(Needs(spec), device)

    def layout_reason(self, spec: AttentionSpec) -> str | None:
        lacking = sorted(feature_.name for feature_ in self.only_with if not feature_.asked(Needs(spec)))
        if lacking:
            return f"serves only layers with {', '.join(lacking)} (this layer has none)"
        if spec.kind not in self.kinds:
            return f"{spec.kind.upper()} not supported (supports {_format_set(self.kinds)})"
        if spec.dtype not in self.dtypes:
            return (
                f"dtype {dtype_name(spec.dtype)} not supported (supports {_format_set(map(dtype_name, self.dtypes))})"
            )
        for what, claimed, value in (
            ("head_dim {} not supported", self.head_dims, spec.head_dim),
            ("block size {} not supported", self.block_sizes, spec.block_size),
            ("{} query heads not supported", self.num_heads, spec.num_heads),
        ):
            if claimed is not None and value not in claimed:
                return f"{what.format(value)} (supports {_format_set(claimed)})"
        return None

    def feature_reason(self, needs: Needs, device: "torch.device | str | DeviceInfo") -> str | None:
        """The first feature ``needs`` asks for that this backend does not serve on ``device``."""
        for feature_ in FEATURES.values():
            if not feature_.asked(needs):
                continue
            if not self.supports(feature_):
                why = self.not_claimed.get(feature_)
                return f"{feature_.words(needs)} not supported" + (f": {why}" if why else "")
            only_with = self.feature_only_with.get(feature_)
            lacking = sorted(f.name for f in only_with.features if not f.asked(needs)) if only_with else []
            if lacking:
                return f"{feature_.words(needs)} not supported without {', '.join(lacking)}" + (
                    f": {only_with.why}" if only_with.why else ""
                )
            limit = self.feature_gpus.get(feature_)
            info = DeviceInfo.of(device)
            if limit is not None and info.compute_capability not in (None, *limit.compute_capabilities):
                wanted = ", ".join(_sm_names(limit.compute_capabilities))
                return (
                    f"{feature_.words(needs)} needs compute capability {wanted} ({limit.why}); this GPU "
                    f"({info.name}) is {info.sm}"
                )
        return None

    @property
    def graph_padding(self) -> PaddingStyle:
        """How an engine pads a CUDA graph's batch for this backend: vLLM's empty requests where
        claimed (the harder for a kernel), else padding rows."""
        return PaddingStyle.EMPTY_REQUESTS if self.supports(EMPTY_REQUESTS) else PaddingStyle.ROWS

    def query_len_reason(self, max_query_len: int, query_lens: "list[int] | None" = None) -> str | None:
        """Why a batch of these query lengths is past the claimed limits (an empty request is a
        feature: ``skip_reason``)."""
        if self.max_query_len is not None and max_query_len > self.max_query_len:
            return f"query length {max_query_len} exceeds the claimed maximum {self.max_query_len}"
        if self.uniform_query_len and query_lens is not None and len(set(query_lens)) > 1:
            return (
                "mixed query lengths in one batch (the backend takes only uniform batches: decode, or spec-verify 1+k)"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        """Every claim, by field name (``plain``)."""
        return plain(self)


@dataclass
class CommonAttentionMetadata:
    """One step's batch. Device tensors are the truth; host values are what the producer knew.

    ``max_seq_len`` is an UPPER BOUND: under async spec decode the host assumes every draft was
    accepted. ``max_query_len`` is exact. Host lengths are optional: a producer that does not know
    them (async scheduling) leaves ``seq_lens_cpu`` unset, and reading the property then copies
    from the device, a host sync that is recorded in ``device_to_host_copies`` (and that the
    host-sync detector sees).
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device: context + this step's query
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, device (-1: write nothing)
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, host
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    host_seq_lens: torch.Tensor | None = None  # [num_reqs] int32, host, when the producer knew them
    device_to_host_copies: list[str] = field(default_factory=list)
    # Token trees (the module docstring): each token's parent among its request's new tokens, -1
    # for the context; None: every request a chain.
    tree_parents: torch.Tensor | None = None  # [num_actual_tokens] int32, device
    tree_parents_cpu: torch.Tensor | None = None  # the same on the host, when the producer knew it

    @classmethod
    def from_lengths(
        cls,
        *,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_starts: Sequence[int],
        host_seq_lens: Sequence[int],
        lengths_known: bool = True,
        max_seq_len: int | None = None,
        tree_parents: torch.Tensor | None = None,
        host_tree_parents: Sequence[int] | None = None,
    ) -> "CommonAttentionMetadata":
        """The one way a step's metadata is made. The device tensors as given; the host values
        from the host's lists: ``query_starts`` (always known on the host) and ``host_seq_lens``,
        exact when ``lengths_known`` (then handed over as ``host_seq_lens``), else the host's upper
        bound (async scheduling: only ``max_seq_len`` is taken from it). ``max_seq_len``
        overrides the bound (a graph replayed for every length passes max_model_len). A step of
        token trees passes ``tree_parents`` (device) and, where the host knows it, its
        ``host_tree_parents``."""
        starts = list(query_starts)
        return cls(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
            num_reqs=len(starts) - 1,
            num_actual_tokens=starts[-1],
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
            max_seq_len=max(host_seq_lens) if max_seq_len is None else max_seq_len,
            host_seq_lens=torch.tensor(list(host_seq_lens), dtype=torch.int32) if lengths_known else None,
            tree_parents=tree_parents,
            tree_parents_cpu=(
                None if host_tree_parents is None else torch.tensor(list(host_tree_parents), dtype=torch.int32)
            ),
        )

    @property
    def has_host_seq_lens(self) -> bool:
        return self.host_seq_lens is not None

    @property
    def seq_lens_cpu(self) -> torch.Tensor:
        if self.host_seq_lens is None:
            # The producer did not know the lengths: fetching them stalls the host on the device.
            self.device_to_host_copies.append("seq_lens")
            self.host_seq_lens = self.seq_lens.to("cpu")
        return self.host_seq_lens

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @property
    def host_tree_parents(self) -> torch.Tensor | None:
        """``tree_parents`` on the host (None: no tree); copied from the device, a recorded host
        sync, where the producer did not know them."""
        if self.tree_parents is not None and self.tree_parents_cpu is None:
            self.device_to_host_copies.append("tree_parents")
            self.tree_parents_cpu = self.tree_parents.to("cpu")
        return self.tree_parents_cpu


class AttentionBackend(abc.ABC):
    """One attention backend. Subclasses set ``name`` and ``capabilities``.

    ``__init__`` allocates every persistent buffer once, sized by ``limits``, so that ``build``
    and ``forward`` can run inside a CUDA graph capture without allocating.
    """

    name: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        self.spec = spec
        self.limits = limits
        self.device = torch.device(device)

    @classmethod
    def availability_reason(cls, device: "torch.device | str | DeviceInfo") -> str | None:
        return cls.capabilities.availability_reason(device)

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec, device: "torch.device | str | DeviceInfo") -> str | None:
        return cls.capabilities.unsupported_reason(spec, device)

    @abc.abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of the paged cache for ``num_blocks`` blocks (block 0 included)."""

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(
            self.kv_cache_shape(num_blocks), dtype=self.spec.effective_kv_cache_dtype, device=self.device
        )

    @abc.abstractmethod
    def write_kv(
        self,
        kv_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        slot_mapping: torch.Tensor,
        layer: LayerParameters = PLAIN_LAYER,
    ) -> None:
        """Store ``key``/``value`` rows at ``slot_mapping``; a slot of -1 writes nothing. For an fp8
        layer (``layer.scales``) each value is stored quantized as the module docstring says."""

    def read_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What ``write_kv`` stored at ``slot_mapping`` (every slot >= 0), as stored (the cache
        dtype, no scale applied): key ``[n, num_kv_heads, head_dim]`` and value (MLA: the entry
        ``[n, head_dim]`` and None). Needed by a backend that claims an fp8 cache: the harness
        checks the stored bytes, then the attention of exactly those."""
        raise NotImplementedError(f"{type(self).__name__} does not implement read_kv (needed for an fp8 KV cache)")

    @abc.abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Backend metadata for one step. Runs on the host before every forward or graph replay."""

    def build_for_capture(self, common: CommonAttentionMetadata) -> Any:
        """Metadata for a CUDA-graph capture; by default the same as ``build``."""
        return self.build(common)

    def update_for_draft_step(self, metadata: Any, common: CommonAttentionMetadata) -> Any:
        """Advance ``metadata`` in place, on device, to ``common``: the next draft step, after every
        request gained one token. Take the new lengths from ``common.seq_lens`` (on the device), not
        from a count of your own: under DCP a rank's row gains a key only where the new position
        lands on that rank, and stays as it was on the others.

        Only backends claiming ``draft_step_update`` implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not claim draft_step_update")

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        out: torch.Tensor,
        layer: LayerParameters = PLAIN_LAYER,
    ) -> None:
        """Attention for the first ``num_actual_tokens`` rows of ``query``, written into ``out``, with
        the layer's scales and sinks, and its log-sum-exp written to ``layer.lse`` where handed one
        (``LayerParameters``)."""
