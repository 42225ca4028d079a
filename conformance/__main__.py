"""The ``conformance`` command (also ``python -m conformance ...`` where the package is on
PYTHONPATH but not installed: a bare GPU machine, a checkout).

Light on purpose: a Ctrl-C or SIGTERM during the seconds torch takes to import is held, then
handled as the command would handle it later (``conformance.run.interrupts``)."""

import sys


def main() -> int:
    from conformance.run.interrupts import hold_signals

    hold_signals()
    from conformance.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
