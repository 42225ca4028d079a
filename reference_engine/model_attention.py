"""A whole model's attention behind the one object the engine steps (``build``,
``build_for_capture``, ``update_for_draft_step``), and each layer's view of it (``view``).

* **Layer groups.** One backend per distinct layer spec, each with metadata of its own every step,
  as vLLM builds one per KV-cache group: the windowed layers of gpt-oss and Gemma 2 beside their
  full ones (``ModelConfig.alternating_window``).
* **MLA's prefill.** vLLM and SGLang run MLA decode absorbed, over the latent cache, and prefill as
  ordinary attention over decompressed per-head keys (qk = nope + rope) and values (v):
  ``ModelConfig.prefill_spec``. Where a prefill backend serves it, each step's requests of more
  query tokens than the decode threshold (1 + k, vLLM's ``reorder_batch_threshold`` under
  speculation) go to it; the rest, among them every step a CUDA graph serves and every draft step,
  to the absorbed backend. The prefill backend's cache is a mirror every write fills with the
  decompressed keys and values (the model's layer decompresses: it holds the weights), so a
  prefill chunk attends its context there.
* **DCP.** Under decode context parallelism (``EngineConfig.dcp``) each group's attention is R
  backend instances, one a rank, merged by LSE (``dcp_attention.DcpAttention``); every rank call
  is a decode batch, so no companion serves beside it and MLA runs absorbed throughout.

Which backend takes which role follows what the backend under test claims (``plan_attention``):
every layer spec it claims, and MLA's prefill spec where it claims that; a role it does not claim
goes to a built-in (``attention_split.companion_candidates``), as serving engines pair a decode
kernel with a prefill kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from backends.base import (
    AttentionBackend,
    AttentionSpec,
    BackendLimits,
    Capabilities,
    CommonAttentionMetadata,
)
from backends.features import EMPTY_REQUESTS
from reference_engine.attention_split import (
    AUTO,
    Call,
    Routing,
    SplitAttention,
    attention_for,
    build_calls,
    companion_candidates,
    first_claiming,
    resolve_companion,
    runs,
    serves_every_batch,
)
from reference_engine.dcp_attention import DcpAttention
from reference_engine.lightning_indexer import IndexerView


@dataclass(frozen=True)
class GroupPlan:
    """The classes that serve one group of layers (equal specs): their attention, or (``indexes``)
    their lightning indexer."""

    layers: tuple[int, ...]
    spec: AttentionSpec
    backend_cls: type[AttentionBackend]  # the layers' spec; with a prefill backend, the decodes only
    prefill_spec: AttentionSpec | None = None
    prefill_cls: type[AttentionBackend] | None = None
    indexes: bool = False


def plan_indexers(
    backend_cls: type[AttentionBackend], model, dtype: torch.dtype, block_size: int, device: torch.device
) -> list[GroupPlan]:
    """Who chooses a sparse model's positions: the backend under test where it claims the model's
    indexer, else the first built-in that does (ValueError, one line, when none can)."""
    specs = [model.indexer_spec(layer, dtype, block_size) for layer in range(model.num_layers)]
    plans = []
    for spec in dict.fromkeys(spec for spec in specs if spec is not None):
        serving = backend_cls
        if backend_cls.unsupported_reason(spec, device):
            serving, why = first_claiming(companion_candidates(spec, device), spec, device, every_batch=True)
            if serving is None:
                raise ValueError(f"no built-in indexer serves the model's ({why})")
        resolve_companion(serving, spec, device)  # an indexer serving only some batches: a built-in beside it
        layers = tuple(index for index, other in enumerate(specs) if other == spec)
        plans.append(GroupPlan(layers, spec, serving, indexes=True))
    return plans


def plan_attention(
    backend_cls: type[AttentionBackend],
    model,
    dtype: torch.dtype,
    block_size: int,
    kv_cache_dtype: torch.dtype | None,
    device: torch.device,
    requested: str | None = AUTO,
    decompressed_prefill: bool = True,
    kv_scale_block: int | None = None,
    query_dtype: torch.dtype | None = None,
) -> list[GroupPlan]:
    """Who serves what when ``model`` runs through ``backend_cls``; ValueError, one line, when it
    cannot. ``decompressed_prefill=False``: every MLA request absorbed (the engine check's reference
    for the prefill path), by a built-in where the backend claims only MLA's prefill."""
    specs = [
        model.layer_spec(layer, dtype, block_size, kv_cache_dtype, kv_scale_block, query_dtype)
        for layer in range(model.num_layers)
    ]
    prefill_spec = model.prefill_spec(dtype, block_size)
    indexers = plan_indexers(backend_cls, model, dtype, block_size, device)
    # The prefill backend serves whole prefills: a decode-only kernel that claims the layer cannot.
    claims_prefill = (
        prefill_spec is not None
        and backend_cls.unsupported_reason(prefill_spec, device) is None
        and serves_every_batch(backend_cls.capabilities)
    )
    decompresses = claims_prefill and decompressed_prefill
    plans = []
    for spec in dict.fromkeys(specs):
        serving = backend_cls
        reason = backend_cls.unsupported_reason(spec, device)
        if reason and not (claims_prefill or indexers[:1] and indexers[0].backend_cls is backend_cls):
            raise ValueError(reason)
        if reason:  # the backend under test serves MLA's prefill or the indexer only: a built-in decodes
            serving, why = first_claiming(companion_candidates(spec, device), spec, device, every_batch=False)
            if serving is None:
                raise ValueError(f"no built-in serves the model's attention beside it ({why})")
        resolve_companion(serving, spec, device, requested)
        layers = tuple(index for index, other in enumerate(specs) if other == spec)
        plans.append(
            GroupPlan(
                layers, spec, serving, prefill_spec if decompresses else None, backend_cls if decompresses else None
            )
        )
    return plans + indexers


@dataclass(frozen=True)
class LayerView:
    """One layer's attention this step: the backend of its spec and its cache; MLA's prefill
    backend and its cache of decompressed keys and values, or None; and the step's calls, each a
    run of requests one of the two serves (one call, the whole step, without a prefill backend)."""

    backend: AttentionBackend
    kv_cache: Any
    prefill: AttentionBackend | None
    prefill_cache: Any
    calls: list[Call]

    @property
    def metadata(self) -> Any:
        """The backend's metadata, for a layer whose every request it serves."""
        (call,) = self.calls
        return call.metadata


@dataclass(frozen=True)
class Group:
    plan: GroupPlan
    backend: AttentionBackend
    prefill: AttentionBackend | None


class ModelAttention:
    def __init__(
        self,
        plans: list[GroupPlan],
        limits: BackendLimits,
        device: torch.device,
        decode_threshold: int,
        requested: str | None = AUTO,
        dcp: int = 1,
    ) -> None:
        def attention(plan: GroupPlan) -> AttentionBackend:
            if dcp > 1:  # every rank's rows are decode rows: no companion (``dcp_attention``)
                return DcpAttention(plan.backend_cls, plan.spec, limits, device, dcp)
            # --prefill-backend names the attention's companion; an indexer's is a built-in's.
            return attention_for(plan.backend_cls, plan.spec, limits, device, AUTO if plan.indexes else requested)

        self.groups = [
            Group(
                plan, attention(plan), plan.prefill_cls(plan.prefill_spec, limits, device) if plan.prefill_cls else None
            )
            for plan in plans
        ]
        self.group_of, self.indexer_of = {}, {}
        for index, group in enumerate(self.groups):
            for layer in group.plan.layers:
                (self.indexer_of if group.plan.indexes else self.group_of)[layer] = index
        self.decode_threshold = decode_threshold
        self.capabilities = captured_together([group.backend.capabilities for group in self.groups])
        self.routing = Routing()  # MLA with a prefill backend: the batches and tokens each route served

    @property
    def splits(self) -> list[AttentionBackend]:
        """The groups' backends (a ``SplitAttention`` where one runs beside a companion)."""
        return [group.backend for group in self.groups]

    def routings(self) -> list[Routing]:
        """What each backend served, counted as steps are built: the MLA routes and the companions'."""
        return [self.routing] + [backend.routing for backend in self.splits if isinstance(backend, SplitAttention)]

    def allocate_kv_cache(self, num_blocks: int, layer: int = 0) -> "LayerCaches":
        """Layer ``layer``'s caches: its backend's, MLA's prefill mirror and its indexer's (or None)."""
        group = self.groups[self.group_of[layer]]
        prefill = group.prefill.allocate_kv_cache(num_blocks) if group.prefill else None
        indexer = self.indexer_of.get(layer)
        index_cache = None if indexer is None else self.groups[indexer].backend.allocate_kv_cache(num_blocks)
        return LayerCaches(group.backend.allocate_kv_cache(num_blocks), prefill, index_cache)

    def _label(self, group: Group):
        def label(backend: AttentionBackend) -> str | None:
            name = getattr(backend, "name", "") or type(backend).__name__
            if backend is group.prefill:
                return f"{name} (MLA prefill, decompressed)"
            # A split counts what each of its backends served itself.
            return None if isinstance(backend, SplitAttention) else f"{name} (absorbed)"

        return label

    def _calls(self, group: Group, common: CommonAttentionMetadata, build_name: str) -> list[Call]:
        if group.prefill is None:
            return [Call(group.backend, 0, common.num_actual_tokens, getattr(group.backend, build_name)(common), True)]
        prefills = [length > self.decode_threshold for length in common.query_lens_cpu.tolist()]
        parts = [(first, last, group.prefill if prefill else group.backend) for first, last, prefill in runs(prefills)]
        return build_calls(common, parts, build_name, self.routing, self._label(group))

    def build(self, common: CommonAttentionMetadata) -> list[list[Call]]:
        return [self._calls(group, common, "build") for group in self.groups]

    def build_for_capture(self, common: CommonAttentionMetadata) -> list[list[Call]]:
        return [self._calls(group, common, "build_for_capture") for group in self.groups]

    def update_for_draft_step(self, metadata: list[list[Call]], common: CommonAttentionMetadata) -> list[list[Call]]:
        # Draft steps decode one token per request: one call per group, the decoding backend's.
        updated = []
        for calls in metadata:
            (call,) = calls
            updated.append(
                [dataclasses.replace(call, metadata=call.backend.update_for_draft_step(call.metadata, common))]
            )
        return updated

    def view(self, layer: int, metadata: list[list[Call]], kv_cache: "LayerCaches") -> LayerView:
        index = self.group_of[layer]
        group = self.groups[index]
        return LayerView(group.backend, kv_cache.attention, group.prefill, kv_cache.prefill, metadata[index])

    def indexer_view(self, layer: int, metadata: list[list[Call]], kv_cache: "LayerCaches") -> IndexerView:
        """Layer ``layer``'s lightning indexer this step (a sparse model's)."""
        index = self.indexer_of[layer]
        return IndexerView(self.groups[index].backend, kv_cache.indexer, metadata[index])


class LayerCaches(NamedTuple):
    """One layer's caches: its attention's, MLA's prefill mirror (or None), its indexer's (or None)."""

    attention: Any
    prefill: Any = None
    indexer: Any = None


def captured_together(claims: list[Capabilities]) -> Capabilities:
    """What an engine may do with a step every group's backend serves: the first's claims (the
    steps the engine captures and drafts are its), with each graph-related one only as far as every
    group's backend makes it (a sparse model's indexer captured beside its attention)."""
    first = claims[0]
    empty_padding = all(claim.supports(EMPTY_REQUESTS) for claim in claims)  # vLLM's graph padding style
    return dataclasses.replace(
        first,
        features=first.features if empty_padding else first.features - {EMPTY_REQUESTS},
        cuda_graphs=min(claim.cuda_graphs for claim in claims),
        draft_step_update=all(claim.draft_step_update for claim in claims),
        needs_cpu_seq_lens=any(claim.needs_cpu_seq_lens for claim in claims),
    )
