"""Ctrl-C in the `energyattn` command: one line and exit status 130, never a traceback, a
crash or a hang.

Python turns SIGINT into a `KeyboardInterrupt` wherever the main thread happens to be:
inside `import jax` (a long traceback, an `ImportError` or an abort), inside XLA's
compilation (the process then dies with SIGSEGV as it unwinds and exits) or inside a `try`
that swallows it (the run then trains on). So the command takes SIGINT away from Python as
soon as it starts (`install`: from `startup`, the first import of `energyattn/__init__.py`
when the process is the command, else from `energyattn/__main__.py`):

- SIGINT is blocked in the main thread, so in every thread started after it (JAX's and
  XLA's included: a thread inherits the signal mask of the thread that starts it), and one
  watcher thread waits for it with `signal.sigwait`. The watcher runs even while the main
  thread is inside a long C++ call such as a compilation.
- By default, Ctrl-C ends the process at once: the watcher flushes stdout and stderr, prints
  one line (the command's `interrupted` line once `describe` has given it, else a line
  saying that the command was starting) and calls `os._exit(130)`, which never unwinds the
  main thread through XLA nor runs the interpreter's teardown.
- While training steps run (inside `training()`, from the end of the first step on, so not
  while that step compiles), the first Ctrl-C only asks the run to stop, and says so on
  stderr: after the current step, where no XLA call is in progress, `step_done` returns
  `True` and the `TrainOptions.callback` that `common.training_options` adds raises
  `StopTraining`. The trainer returns what it has, the command evaluates and saves it as
  after a time limit (a later `training()` of the same command raises `KeyboardInterrupt`
  instead of training another model), and `app.main` then prints the command's line
  (`report`) and returns 130. A second Ctrl-C ends the process at once.

A plain signal handler makes the same decisions in the main thread where SIGINT reaches it
anyway: on platforms without `pthread_sigmask` (Windows), and when a thread started before
`install` (by an import) takes the signal. It runs when the main thread next runs Python,
so after a compilation rather than during it.

This module imports nothing but the standard library: `install` runs before JAX is imported.
Nothing here does anything in a process that never calls `install` (the tests, a user's
`main(argv)`), except the flag `between_steps` checks, which only a Ctrl-C seen by an
installed handler sets.
"""

import contextlib
import itertools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

#: The exit status of a command stopped by Ctrl-C (128 + SIGINT, as shells report it).
STATUS = 130

_lock = threading.RLock()  # reentrant: the fallback handler runs in the main thread
_installed = False
_blocked = False  # SIGINT is blocked in the main thread (and the watcher waits for it)
_stepping = False  # inside `training()`, after a step: Ctrl-C may wait for the next step
_stop = False  # a Ctrl-C asked the training to stop at the next step
_said = False  # the command's line was printed
_describe: Callable[[], str] | None = None


def started_as_command() -> bool:
    """Whether this process is the `energyattn` command: `python -m energyattn ...` (while
    the package is imported, `sys.argv[0]` is `"-m"`) or the installed `energyattn` script."""
    argv = getattr(sys, "orig_argv", [])
    module = next((after for flag, after in itertools.pairwise(argv) if flag == "-m"), None)
    if sys.argv[:1] == ["-m"]:
        return module == "energyattn"
    return bool(sys.argv) and Path(sys.argv[0]).stem == "energyattn"


def install_if_command() -> None:
    """`install` when this process is the `energyattn` command (`started_as_command`): for
    the first lines of the package, so that Ctrl-C is handled before JAX is imported."""
    if started_as_command():
        install()


def install() -> None:
    """Handle SIGINT as this module describes, from now on, in this process. Call it from
    the main thread, before other threads start; calling it again does nothing."""
    global _installed, _blocked
    with _lock:
        if _installed or threading.current_thread() is not threading.main_thread():
            return
        _installed = True
    signal.signal(signal.SIGINT, lambda signum, frame: _on_ctrl_c())
    if hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigwait"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        _blocked = True
        threading.Thread(target=_watch, name="energyattn-ctrl-c", daemon=True).start()


def _watch() -> None:
    while True:
        signal.sigwait({signal.SIGINT})
        _on_ctrl_c()


def _on_ctrl_c() -> None:
    """A Ctrl-C: the first one between training steps asks the training to stop; any other
    ends the process now."""
    global _stop
    with _lock:
        if _stepping and not _stop:
            _stop = True
            _write(
                "energyattn: Ctrl-C: stopping after this training step, then saving what was "
                "trained (Ctrl-C again to quit at once)"
            )
            return
    exit_now()


def describe(line: Callable[[], str]) -> None:
    """Give the line printed when Ctrl-C stops the running command (`line()` is called
    then: it may say how far the command got); a new command starts with no Ctrl-C seen."""
    global _describe, _stepping, _stop, _said
    with _lock:
        _describe, _stepping, _stop, _said = line, False, False, False


def _line() -> str:
    if _describe is not None:
        try:
            return _describe()
        except Exception:  # never fail to exit
            pass
    return "energyattn: interrupted while starting; nothing was written"


def report() -> None:
    """Print the command's line on stderr (once: `exit_now` then prints nothing)."""
    global _said
    with _lock:
        if _said:
            return
        _said = True
    _write(_line())


def _write(line: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream, or the main thread inside a write
            pass
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        os.write(2, (line + "\n").encode(errors="replace"))


def exit_now() -> None:
    """Print the command's line (unless already printed), flush and end the process with
    status 130 without unwinding the main thread (`os._exit`); within a second even if the
    output blocks (a full pipe)."""
    deadline = threading.Timer(1.0, os._exit, args=(STATUS,))
    deadline.daemon = True
    deadline.start()
    try:
        report()
    finally:
        os._exit(STATUS)


def step_done() -> bool:
    """Called after each training step (by the command's `TrainOptions.callback`): `True`
    when a Ctrl-C asked the training to stop (the caller then ends it); else the next Ctrl-C
    may wait for the next step."""
    global _stepping
    with _lock:
        if _stop:
            return True
        _stepping = True
        return False


def stop_requested() -> bool:
    """Whether a Ctrl-C asked the running command's training to stop."""
    with _lock:
        return _stop


@contextlib.contextmanager
def training() -> Iterator[None]:
    """Around one trainer call whose options' callback ends the training when `step_done`
    says so: Ctrl-C during its steps stops it after the current step; outside (its
    compilation, what follows it) Ctrl-C exits at once. Entered after a Ctrl-C stopped an
    earlier training of the command, it raises `KeyboardInterrupt`: nothing more is trained."""
    global _stepping
    if stop_requested():
        raise KeyboardInterrupt
    try:
        yield
    finally:
        with _lock:
            _stepping = False


@contextlib.contextmanager
def for_children() -> Iterator[None]:
    """Around starting a child process: it gets SIGINT unblocked (a child inherits the
    signal mask of the thread that starts it), so Ctrl-C reaches it as usual."""
    if not _blocked:
        yield
        return
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
