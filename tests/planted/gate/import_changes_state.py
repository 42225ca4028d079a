"""A backend module that changes a harness setting when it is imported (TF32 matmuls, for its own
kernels' sake): its own first case is the ERROR, never another backend's that happens to run
first in the same process."""

import torch

from backends.torch_naive import TorchNaiveBackend

torch.set_float32_matmul_precision("medium")


class Backend(TorchNaiveBackend):
    name = "planted_import_changes_state"
