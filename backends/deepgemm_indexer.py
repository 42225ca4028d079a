"""``deepgemm_indexer``: DeepSeek-V3.2's lightning indexer over DeepGEMM's paged fp8 logits kernel
(``fp8_paged_mqa_logits`` of sgl-deep-gemm, the kernel vLLM and SGLang run for it; SM90 has its own),
then ``triton_indexer``'s top-k and write.

The cache is DeepGEMM's page: a page of 64 tokens holds the 64 e4m3 keys first, then their 64
float32 scales (``block_planes``; the contract's keys and scales, laid out as the kernel reads
them). Each query token is a request of one query (``next_n`` 1), so query lengths may differ:
its context is its own position + 1, its block-table row its request's, gathered on the device
from ``triton_indexer``'s metadata (``build`` and ``update_for_draft_step`` place each token's
request and position on the device); the kernel's schedule is made on the device every forward
(``get_paged_mqa_logits_metadata``), so a captured graph remakes it on every replay. The kernel
writes the columns of every page a token's context touches, past its own position too, and leaves
the rest of the row as ``torch.empty`` made it: every column past the token is masked to -inf here.

The kernel takes the query in e4m3, as DeepSeek's reference indexer quantizes it (a power-of-two
scale for each token and head, folded into the head weights): the contract hands an indexer its
query in the compute dtype and judges a choice within one bf16 rounding of each head's score,
which an e4m3 query is not (three bits of mantissa). So the fp8-key layers it serves are not
claimed (``QUERY_IN_FP8``, the reason every case gives) until the contract hands fp8 queries.
"""

from __future__ import annotations

import torch

from backends.base import AttentionSpec, BackendLimits, Capabilities, CGSupport
from backends.features import EMPTY_REQUESTS, FP8_E4M3
from backends.fp8 import to_cache, token_scales
from backends.torch_indexer import SCALE_BYTES
from backends.triton.indexer import TritonIndexerBackend
from backends.triton.sparse_mla import SparseMetadata

PAGE = 64  # the kernel's block_kv
INSTALL_HINT = "pip install 'specdec-conformance[deepgemm]'"
QUERY_IN_FP8 = (
    "DeepGEMM's fp8_paged_mqa_logits takes the query in e4m3 too (DeepSeek's power-of-two scale a "
    "token and head); the contract hands an indexer its query in the compute dtype and judges a "
    "choice within one bf16 rounding of each head's score (the contract's fp8 query is an attention layer's)"
)


class DeepGEMMIndexerBackend(TritonIndexerBackend):
    name = "deepgemm_indexer"
    capabilities = Capabilities(
        kinds=frozenset({"indexer"}),
        dtypes=frozenset({torch.bfloat16}),
        head_dims=frozenset({32, 64, 128}),
        block_sizes=frozenset({PAGE}),
        num_heads=frozenset({32, 64}),
        max_query_len=None,
        only_with=frozenset({FP8_E4M3}),  # the kernel reads e4m3 keys only
        features=frozenset({EMPTY_REQUESTS}),
        not_claimed={FP8_E4M3: QUERY_IN_FP8},
        cuda_graphs=CGSupport.ALWAYS,
        needs_cpu_seq_lens=False,
        draft_step_update=True,
        devices=frozenset({"cuda"}),
        compute_capabilities=frozenset({(9, 0)}),
        required_modules=("deep_gemm", "triton"),
        install_hint=INSTALL_HINT,
    )

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        try:
            import deep_gemm  # noqa: PLC0415 - optional dependency
        except (ImportError, OSError, AssertionError) as error:  # a wheel built for another torch; no CUDA_HOME
            raise RuntimeError(f"deep_gemm did not load ({error}): {INSTALL_HINT}, built for this torch") from None
        self.deep_gemm = deep_gemm
        self.rows = torch.arange(limits.max_num_tokens, dtype=torch.int32, device=self.device)

    # A page of bytes: the 64 keys, then their 64 float32 scales (DeepGEMM's and vLLM's layout). No
    # dimension of it is a token's (the kernel's [blocks, 64, 1, head_dim + 4] is a view of the
    # page's size only), so that no reader places a token's bytes by the shape.
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.spec.block_size * (self.spec.head_dim + SCALE_BYTES))

    def block_planes(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pages = kv_cache.view(kv_cache.shape[0], -1)
        keys_bytes = self.spec.block_size * self.spec.head_dim
        keys = pages[:, :keys_bytes].view(-1, self.spec.block_size, self.spec.head_dim)
        return keys, pages[:, keys_bytes:].view(-1, self.spec.block_size, SCALE_BYTES)

    def logits(self, query, kv_cache, metadata: SparseMetadata, weights) -> torch.Tensor:
        spec, rows = self.spec, query.shape[0]
        width = metadata.block_table.shape[1] * spec.block_size
        # The query in e4m3 with a power-of-two scale a token and head, folded into the weights
        # (relu(s·x) = s·relu(x) for s > 0): the kernel applies only each key's scale.
        q_scales = token_scales(query.reshape(rows * spec.num_heads, spec.head_dim), spec.kv_cache_dtype)
        q_fp8 = to_cache(query.reshape(rows * spec.num_heads, spec.head_dim), q_scales[:, None], spec.kv_cache_dtype)
        scaled = (weights[:rows].float() * q_scales.view(rows, spec.num_heads)).contiguous()  # a bank's: wider
        # Each row a request of one query: its context its position + 1, its request's block-table
        # row; a padding row (past the step's tokens) has context 0 and a row of zeros, so that it
        # reads nothing (an empty request's row may hold -1s).
        real = self.rows[:rows] < metadata.num_tokens
        context = torch.where(real, metadata.token_position[:rows] + 1, 0).to(torch.int32).view(rows, 1)
        request = torch.where(real, metadata.token_request[:rows], 0).clamp_(max=metadata.block_table.shape[0] - 1)
        table = torch.where(real[:, None], metadata.block_table[request.long()], 0).to(torch.int32).contiguous()
        dg = self.deep_gemm
        schedule = dg.get_paged_mqa_logits_metadata(context, spec.block_size, dg.get_num_sms())
        logits = dg.fp8_paged_mqa_logits(
            q_fp8.view(rows, 1, spec.num_heads, spec.head_dim),
            kv_cache.view(kv_cache.shape[0], spec.block_size, 1, spec.head_dim + SCALE_BYTES),
            scaled,
            context,
            table,
            schedule,
            width,
            clean_logits=False,  # it asserts with a 2-D context; the mask is below
        )
        seen = torch.arange(width, device=query.device)[None, :] < context
        return torch.where(seen, logits, float("-inf"))
