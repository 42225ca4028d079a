"""A backend whose import fails in exactly one process: the N-th to import it on this machine
(``FLAKY_IMPORT_FAILS_AT``, default 2; a file in ``FLAKY_IMPORT_DIR`` counts them). In a pooled run
one unit's child then cannot load it while the others can, whichever answers first: that unit's
cases must say so, and no other case may be lost."""

import os
from pathlib import Path

from backends.torch_naive import TorchNaiveBackend

_count = Path(os.environ["FLAKY_IMPORT_DIR"]) / "imports"
with _count.open("a") as handle:  # one line per import, appended atomically
    handle.write(f"{os.getpid()}\n")
if len(_count.read_text().splitlines()) == int(os.environ.get("FLAKY_IMPORT_FAILS_AT", "2")):
    raise RuntimeError("the license server did not answer")


class Backend(TorchNaiveBackend):
    name = "flaky_import"
