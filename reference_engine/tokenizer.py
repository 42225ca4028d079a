"""A GGUF file's tokenizer through Hugging Face's ``tokenizers`` (byte-level BPE), and its chat
template through Jinja, as ``transformers`` renders one.

Only the GPT-2-style BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are built. The split
before BPE follows ``tokenizer.ggml.pre``: ``smollm`` (and the StarCoder family it shares a rule
with in llama.cpp) isolates every digit, then applies GPT-2's regex; ``gpt2`` applies the regex
alone. Control tokens (``token_type`` 3: ``<|im_start|>``, ``<|im_end|>``, ...) are special tokens:
written in a prompt they encode to their one id, and ``decode`` drops them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reference_engine.checkpoint import CheckpointError
from reference_engine.gguf_checkpoint import INSTALL_HINT, GGUFFile

CONTROL_TOKEN = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
# llama.cpp's names for the splits before BPE that are built here; any other is refused rather
# than tokenized with the wrong split.
DIGIT_SPLITTING_PRE_TOKENIZERS = ("smollm", "starcoder", "refact", "codeshell")
GPT2_PRE_TOKENIZERS = ("gpt2", "default")


@dataclass
class Tokenizer:
    backend: Any  # tokenizers.Tokenizer
    eos_token_id: int
    chat_template: str | None

    @staticmethod
    def from_gguf(file: GGUFFile) -> "Tokenizer":
        try:
            from tokenizers import AddedToken, decoders, models, pre_tokenizers  # noqa: PLC0415 - optional dependency
            from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415
        except ImportError:
            raise CheckpointError(f"the GGUF tokenizer needs the tokenizers package: {INSTALL_HINT}") from None
        kind = file.require("tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(f"{file.path.name}: tokenizer model {kind!r}; only byte-level BPE ('gpt2') is built")
        tokens = list(file.require("tokenizer.ggml.tokens"))
        merges = [tuple(merge.split(" ", 1)) for merge in file.require("tokenizer.ggml.merges")]
        backend = HFTokenizer(models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=merges))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        pre = file.metadata.get("tokenizer.ggml.pre", "gpt2")
        if pre not in DIGIT_SPLITTING_PRE_TOKENIZERS + GPT2_PRE_TOKENIZERS:
            raise CheckpointError(
                f"{file.path.name}: pre-tokenizer {pre!r} is not built here "
                f"(known: {', '.join(DIGIT_SPLITTING_PRE_TOKENIZERS + GPT2_PRE_TOKENIZERS)})"
            )
        backend.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if pre in DIGIT_SPLITTING_PRE_TOKENIZERS
            else byte_level
        )
        backend.decoder = decoders.ByteLevel()
        types = file.metadata.get("tokenizer.ggml.token_type", [])
        backend.add_special_tokens(
            [
                AddedToken(tokens[index], special=True, normalized=False)
                for index, kind in enumerate(types)
                if kind == CONTROL_TOKEN
            ]
        )
        return Tokenizer(
            backend, int(file.require("tokenizer.ggml.eos_token_id")), file.metadata.get("tokenizer.chat_template")
        )

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for a conversation, ending where the assistant's reply starts."""
        if not self.chat_template:
            raise CheckpointError("this model has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415 - transformers renders templates so

        template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=True)

    def user_turn(self, message: str) -> list[int]:
        """The token ids of one user message in the chat template, ready for the assistant's reply."""
        return self.encode(self.chat([{"role": "user", "content": message}]))
