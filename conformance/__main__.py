"""`python -m conformance ...`: the `conformance` command where the package is on PYTHONPATH but
not installed (a bare GPU machine, a checkout)."""
import sys

from conformance.cli import main

sys.exit(main())
