"""`python -m energyattn`: the `energyattn` command line."""

import sys

if __name__ == "__main__":
    # First: Ctrl-C is one line and status 130 from here on, never a traceback through JAX
    # or a crash inside XLA (see energyattn/_cli/interrupt.py).
    from ._cli.interrupt import install

    install()

    from ._cli import main

    sys.exit(main())
