"""A backend module whose import never returns (a lock held by a process that died)."""

import time

from backends.torch_naive import TorchNaiveBackend

time.sleep(3600)


class Backend(TorchNaiveBackend):
    name = "planted_import_hang"
