"""The conformance harness: cases, checks, the run and its reports.

Kept free of imports: the command (``conformance.__main__``) must hold signals before torch loads.
"""
