"""Adapters over flashinfer-python. Each imports flashinfer lazily (in ``__init__``), so a machine
without it lists the backend as unavailable with the install command instead of failing."""

INSTALL_HINT = "pip install 'specdec-conformance[flashinfer]'"
WORKSPACE_BYTES = 128 * 2**20
