"""A backend module whose import changes the working directory (a library that chdirs to its
own data directory): results must still land where the command said."""

import os
import tempfile

from backends.torch_naive import TorchNaiveBackend

os.chdir(tempfile.gettempdir())


class Backend(TorchNaiveBackend):
    name = "planted_import_chdir"
