"""DeepSeek's fp8_ds_mla cache entry in plain PyTorch (``backends.base``: "DeepSeek's fp8_ds_mla
cache"), as vLLM lays a token out: the latent as e4m3 bytes, a float32 scale per block of it, then
the rope part in the compute dtype (656 bytes for 512 + 64 in bf16). For torch_naive and for
checking a kernel; the harness quantizes apart from this (``conformance.cases.kv_quantization``).
"""

from __future__ import annotations

import torch

from backends.paged_write import write_paged_rows

E4M3 = torch.float8_e4m3fn
DS_MLA_SCALE_BLOCK = 128  # latent values one scale covers (vLLM's fp8_ds_mla: four a 512-value latent)


class DsMlaLayout:
    """One token's packed entry, the two ways across it, and a paged pool of such entries (a
    backend's cache over fp8_ds_mla: [num_blocks, block_size, row_bytes] of uint8)."""

    def __init__(self, spec) -> None:
        self.latent, self.rope, self.block = spec.kv_lora_rank, spec.rope_dim, spec.kv_scale_block
        self.blocks = self.latent // self.block
        self.rope_dtype = spec.dtype
        self.row_bytes = self.latent + 4 * self.blocks + self.rope * spec.dtype.itemsize

    def pack(self, entry: torch.Tensor) -> torch.Tensor:
        """``entry`` [n, latent + rope] in the compute dtype → uint8 [n, row_bytes]."""
        latent = entry[:, : self.latent].float().reshape(entry.shape[0], self.blocks, self.block)
        largest = torch.finfo(E4M3).max
        amax = latent.abs().amax(dim=-1)  # [n, blocks]
        # Divided by a tensor: CUDA divides a tensor by a Python number as a product with its
        # reciprocal, which rounds some quotients one float32 step off vLLM's division.
        scales = (amax / torch.full_like(amax, largest)).clamp(min=torch.finfo(torch.float32).tiny)
        stored = (latent / scales[..., None]).clamp(-largest, largest).to(E4M3).reshape(entry.shape[0], self.latent)
        rope = entry[:, self.latent :].to(self.rope_dtype).contiguous()
        parts = [stored.view(torch.uint8), scales.contiguous().view(torch.uint8), rope.view(torch.uint8)]
        return torch.cat([part.reshape(entry.shape[0], -1) for part in parts], dim=1)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [n, row_bytes] → the entry as the attention reads it, float32 [n, latent + rope]."""
        n = rows.shape[0]
        stored = rows[:, : self.latent].contiguous().view(E4M3).float().reshape(n, self.blocks, self.block)
        scale_bytes = rows[:, self.latent : self.latent + 4 * self.blocks].contiguous()
        scales = scale_bytes.view(torch.float32).reshape(n, self.blocks)
        rope = rows[:, self.latent + 4 * self.blocks :].contiguous().view(self.rope_dtype).float()
        return torch.cat([(stored * scales[..., None]).reshape(n, self.latent), rope], dim=1)

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.row_bytes)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.cache_shape(num_blocks, block_size), dtype=torch.uint8, device=device)

    def write(self, kv_cache: torch.Tensor, entry: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Each row of ``entry`` packed (vectorised on its device, no host read) into its slot
        (slot -1: nothing)."""
        write_paged_rows(kv_cache, self.pack(entry), slot_mapping, kv_cache.shape[1])

    def read(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The entries of ``slot_mapping``'s slots, dequantized (float32)."""
        return self.unpack(kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping])
