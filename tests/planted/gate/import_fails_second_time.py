"""A backend whose import fails in exactly one process: the second to import it on this machine
(a marker file in ``FLAKY_IMPORT_DIR`` counts them). The first is the probe; in a pooled run one
unit's child then cannot load it while the others can: that unit's cases must say so, and no
other case may be lost."""

import os
from pathlib import Path

from backends.torch_naive import TorchNaiveBackend

_count = Path(os.environ["FLAKY_IMPORT_DIR"]) / "imports"
with _count.open("a") as handle:  # one line per import, appended atomically
    handle.write(f"{os.getpid()}\n")
if len(_count.read_text().splitlines()) == 2:
    raise RuntimeError("the license server did not answer")


class Backend(TorchNaiveBackend):
    name = "flaky_import"
