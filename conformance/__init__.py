"""The conformance harness: cases, checks, the run and its reports."""
import importlib.util as _importlib_util
import os as _os

from host_syncs.frames import treat_as_infrastructure as _treat_as_infrastructure

# A sync seen while the harness drives a backend is the backend's: never blame the harness, nor
# the contract's helpers that copy on the caller's behalf (CommonAttentionMetadata.seq_lens_cpu).
_treat_as_infrastructure(_os.path.dirname(_os.path.abspath(__file__)), _importlib_util.find_spec("backends.base").origin)
