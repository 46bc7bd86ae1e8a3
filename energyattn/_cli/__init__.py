"""The `energyattn` command line; the library never imports it. Importing this package
imports nothing else: `main` loads the commands when it runs."""

from .entry import main as main
