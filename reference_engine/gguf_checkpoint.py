"""Load a Llama-architecture GGUF file (llama.cpp's format) into the engine's ``LlamaModel``.

Read with the ``gguf`` package: metadata ``llama.*`` (block_count, embedding_length,
feed_forward_length, attention.head_count[_kv], rope.freq_base, attention.layer_norm_rms_epsilon,
context_length) and tensors ``token_embd``, ``blk.N.{attn_norm, attn_q, attn_k, attn_v,
attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}``, ``output_norm`` and ``output`` (tied to the
embedding when absent). Quantized tensors are dequantized to fp32, then cast to the run's dtype.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` head by head so that its rope
rotates adjacent pairs (x[2i], x[2i+1]); this model rotates the two halves of a head (the Hugging
Face convention), so the permutation is undone here (``unpermute_rope_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reference_engine.checkpoint import CheckpointError, load_strict
from reference_engine.model import LlamaModel, ModelConfig

INSTALL_HINT = "pip install 'specdec-conformance[real-model]'"


@dataclass
class GGUFFile:
    """A GGUF file's metadata (plain Python values) and its tensors, dequantized to fp32 on demand."""

    path: Path
    metadata: dict[str, Any]
    _tensors: dict[str, Any]  # name -> gguf.ReaderTensor (still quantized)

    @staticmethod
    def open(path: str | Path) -> "GGUFFile":
        path = Path(path)
        try:
            import gguf  # noqa: PLC0415 - optional dependency
        except ImportError:
            raise CheckpointError(f"reading {path.name} needs the gguf package: {INSTALL_HINT}") from None
        if not path.is_file():
            raise CheckpointError(f"{path}: no such file")
        try:
            reader = gguf.GGUFReader(path)
        except (ValueError, OSError) as error:
            raise CheckpointError(f"{path}: not a readable GGUF file ({error})") from None
        metadata = {}
        for key, value in reader.fields.items():
            try:
                metadata[key] = value.contents()
            except (ValueError, IndexError):  # a field type this gguf version cannot decode: not one we read
                continue
        return GGUFFile(path, metadata, {tensor.name: tensor for tensor in reader.tensors})

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise CheckpointError(f"{self.path.name}: no metadata key {key}")
        return self.metadata[key]

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized to fp32, in PyTorch's order ([out, in] for a weight)."""
        import gguf  # noqa: PLC0415 - optional dependency

        if name not in self._tensors:
            raise CheckpointError(f"{self.path.name}: missing tensor {name}")
        tensor = self._tensors[name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists dimensions fastest first
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
            shape
        )  # a copy: the file is mapped read-only


def read_gguf_config(file: GGUFFile) -> ModelConfig:
    architecture = file.require("general.architecture")
    if architecture != "llama":
        raise CheckpointError(f"{file.path.name}: architecture {architecture!r}; only 'llama' GGUF files load")
    heads = int(file.require("llama.attention.head_count"))
    hidden = int(file.require("llama.embedding_length"))
    head_dim = int(file.metadata.get("llama.rope.dimension_count", hidden // heads))
    if head_dim != hidden // heads:
        raise CheckpointError(
            f"{file.path.name}: partial rotary embedding ({head_dim} of {hidden // heads} dims) is not supported"
        )
    return ModelConfig(
        vocab_size=len(file.require("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        num_layers=int(file.require("llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(file.metadata.get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(file.require("llama.feed_forward_length")),
        rope_theta=float(file.metadata.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(file.require("llama.attention.layer_norm_rms_epsilon")),
        max_model_len=int(file.metadata.get("llama.context_length", 4096)),
        logit_scale=1.0,
    )


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of a Q or K projection ([heads * head_dim, in]): within each
    head, GGUF row 2i is the Hugging Face row i and row 2i+1 is row i + head_dim / 2."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def load_gguf_model(source: str | Path | GGUFFile, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    file = source if isinstance(source, GGUFFile) else GGUFFile.open(source)
    config = read_gguf_config(file)
    embedding = file.tensor("token_embd.weight")
    state = {
        "embed.weight": embedding,
        "final_norm": file.tensor("output_norm.weight"),
        "lm_head.weight": file.tensor("output.weight") if file.has_tensor("output.weight") else embedding,
    }
    for index in range(config.num_layers):

        def get(name: str) -> torch.Tensor:
            return file.tensor(f"blk.{index}.{name}.weight")

        query = unpermute_rope_rows(get("attn_q"), config.num_heads)
        key = unpermute_rope_rows(get("attn_k"), config.num_kv_heads)
        state.update(
            {
                f"layers.{index}.input_norm": get("attn_norm"),
                f"layers.{index}.qkv.weight": torch.cat([query, key, get("attn_v")]),
                f"layers.{index}.o_proj.weight": get("attn_output"),
                f"layers.{index}.post_norm": get("ffn_norm"),
                f"layers.{index}.gate_up.weight": torch.cat([get("ffn_gate"), get("ffn_up")]),
                f"layers.{index}.down.weight": get("ffn_down"),
            }
        )
    model = LlamaModel(config)
    load_strict(model, state, file.path)
    return model.to(device=device, dtype=dtype).eval()
