"""Drafters: what proposes k tokens per decoding request, one module each, behind one interface
(``base.Drafter``); ``registry`` maps a configuration's spec to its class.

* ``none`` (``none``): no speculation.
* ``scripted`` (``scripted:PATTERN``): scripted from a reference run with a chosen acceptance
  pattern; for tests and controlled benchmarks.
* ``ngram`` (``ngram[:N]``): prompt lookup over the request's own tokens.
* ``layer_skip`` (``layer-skip[:N]``): the target's first N layers and its head.
* ``eagle`` (``eagle``): an EAGLE-style head over a cache of its own.

The last two draft through the attention backend (``attention.AttentionDrafter``).
"""
