"""Backends that break the gate rather than the numbers: they exit quietly, change the harness's
state, write into its events channel, leave processes behind, or misbehave while being imported.
Each is torch_naive with one such behaviour (and, where it matters, a wrong answer the gate must
not let through)."""
