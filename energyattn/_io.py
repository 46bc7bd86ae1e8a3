"""Output files: check where they go before any expensive work, and write them atomically.

Shared by the library's `save_*` / `train_*` functions and by the command line. Every check
runs in well under a second and raises an `OSError` subclass whose message names the path, so
a run that would fail at its end (after minutes of training) fails at its start instead.
Writes go to a temporary file in the destination's folder that replaces the destination only
when complete (`os.replace` is atomic on POSIX and Windows): an interrupted run never leaves a
truncated checkpoint, figure or metrics file behind.
"""

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _probe_writable(folder: Path, what: str, path: Path) -> None:
    try:
        handle, probe = tempfile.mkstemp(prefix=".energyattn-probe-", dir=folder)
    except OSError as error:
        raise PermissionError(
            f"cannot write the {what} {str(path)!r}: its folder {str(folder)!r} is not "
            f"writable ({error.strerror or error})"
        ) from None
    os.close(handle)
    os.unlink(probe)


def check_output_dir(path: str | os.PathLike, *, what: str = "output folder") -> Path:
    """Create the folder `path` if needed and check that files can be written into it.

    Raises `NotADirectoryError` when `path` (or one of its parents) is a file and
    `PermissionError` when the folder cannot be created or written, naming `path`."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"the {what} {str(path)!r} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(
            f"cannot create the {what} {str(path)!r}: a part of the path is a file"
        ) from None
    except OSError as error:
        raise PermissionError(
            f"cannot create the {what} {str(path)!r} ({error.strerror or error})"
        ) from None
    _probe_writable(path, what, path)
    return path


def check_output_file(
    path: str | os.PathLike, *, what: str = "output file", create_folder: bool = False
) -> Path:
    """Check that the file `path` can be written (replacing it if it exists).

    Its folder must exist (or is created when `create_folder=True`) and be writable, and
    `path` must not be a folder. Raises `FileNotFoundError`, `IsADirectoryError`,
    `NotADirectoryError` or `PermissionError` naming `path`."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"the {what} {str(path)!r} is a folder, not a file")
    folder = path.parent
    if create_folder:
        check_output_dir(folder, what=f"folder of the {what}")
    elif not folder.exists():
        raise FileNotFoundError(
            f"cannot write the {what} {str(path)!r}: its folder {str(folder)!r} does not exist"
        )
    elif not folder.is_dir():
        raise NotADirectoryError(
            f"cannot write the {what} {str(path)!r}: {str(folder)!r} is not a folder"
        )
    _probe_writable(folder, what, path)
    return path


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` (same suffix, so writers that infer the format
    or append an extension behave as for `path`); when the block ends without an exception
    the temporary file replaces `path`, otherwise it is removed."""
    path = Path(path)
    handle, name = tempfile.mkstemp(
        prefix=f".{path.stem}.", suffix=f".partial{path.suffix}", dir=path.parent
    )
    os.close(handle)
    partial = Path(name)
    try:
        yield partial
        # mkstemp makes the file private (0600); the result gets the mode any new file of
        # the user gets (0644 under umask 022).
        os.chmod(partial, 0o666 & ~_umask())
        os.replace(partial, path)
    finally:
        if partial.exists():
            partial.unlink()


def _umask() -> int:
    """The process's file-creation mask (reading it means setting it; it is set back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically; return the path."""
    path = Path(path)
    with atomic_output(path) as partial:
        partial.write_text(text)
    return path
