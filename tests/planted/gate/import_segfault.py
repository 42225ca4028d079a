"""A backend module whose import kills the interpreter (a native extension built for another ABI)."""

import os
import signal

from backends.torch_naive import TorchNaiveBackend

os.kill(os.getpid(), signal.SIGSEGV)


class Backend(TorchNaiveBackend):
    name = "planted_import_segfault"
