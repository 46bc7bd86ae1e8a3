"""Imported first by `energyattn/__init__.py`: in the `energyattn` command (`python -m
energyattn`, or the installed script), Ctrl-C is handled as `interrupt` describes from here
on, before JAX is imported. Elsewhere it does nothing."""

from .interrupt import install_if_command

install_if_command()
