"""The `energyattn` command line; the library never imports it."""

from .app import main as main
