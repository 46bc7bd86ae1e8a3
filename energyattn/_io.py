"""Output files: check where they go before any expensive work, and write them atomically;
training checkpoints.

Shared by the library's `save_*` / `train_*` functions and by the command line. Every check
runs in well under a second and raises an `OSError` subclass whose message names the path, so
a run that would fail at its end (after minutes of training) fails at its start instead.
Writes go to a temporary file in the destination's folder that replaces the destination only
when complete (`os.replace` is atomic on POSIX and Windows): an interrupted run never leaves a
truncated checkpoint, figure or metrics file behind. Checkpoints (`save_checkpoint`,
`load_checkpoint`, public as `ea.models.*`) are pytrees of arrays written that way and read
back against the structure, shapes and dtypes they must have.
"""

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._checks import shape_str


def probe_writable(folder: Path, what: str, path: Path) -> None:
    """A `PermissionError` naming the `what` at `path` unless a file can be made in `folder`
    (probed with a temporary file, removed)."""
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
    probe_writable(path, what, path)
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
    probe_writable(folder, what, path)
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


def save_checkpoint(path: str | Path, tree: PyTree) -> None:
    """Write the arrays of a pytree (model, optimiser state, step, ...) to `path`.

    The format is `eqx.tree_serialise_leaves`'s, written to exactly `path` (no suffix is
    added). The path is checked first: its folder must exist and be writable and `path` must
    not be a folder, else an `OSError` naming it is raised before anything is written. The
    file is replaced atomically, so an interrupted save leaves the previous checkpoint intact.

    ```python
    import tempfile
    from pathlib import Path

    import jax.numpy as jnp
    import energyattn as ea

    tree = {"w": jnp.ones((2, 3)), "step": jnp.asarray(7)}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.eqx"
        ea.models.save_checkpoint(path, tree)
        back = ea.models.load_checkpoint(path, tree)
    assert int(back["step"]) == 7
    ```
    """
    path = check_output_file(path, what="checkpoint")
    for keypath, leaf in jtu.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and np.dtype(dtype).kind not in "biufc":
            raise ValueError(
                f"cannot save {_leaf_name(keypath)} in a checkpoint: an array of dtype "
                f"{np.dtype(dtype)}; a checkpoint holds numbers (bool, int, float, complex)"
            )
    with atomic_output(path) as partial:
        with open(partial, "wb") as file:
            eqx.tree_serialise_leaves(file, tree)
        # Read back before it replaces the old file: a checkpoint that cannot be loaded never
        # replaces one that can.
        try:
            with open(partial, "rb") as file:
                eqx.tree_deserialise_leaves(file, tree)
        except Exception as error:
            raise ValueError(
                f"the checkpoint written for {str(path)!r} could not be read back ({error}); "
                "the previous file, if any, is left as it was"
            ) from None


def _leaf_name(keypath: tuple) -> str:
    # `model.layers[0].weight` rather than keystr's `['model'].layers[0].weight`.
    parts = []
    for key in keypath:
        name = key.name if isinstance(key, jtu.GetAttrKey) else None
        if isinstance(key, jtu.DictKey) and isinstance(key.key, str) and key.key.isidentifier():
            name = key.key
        if name is None:
            parts.append(jtu.keystr((key,)))
        else:
            parts.append(f".{name}" if parts else name)
    return "".join(parts) or "the root"


def _describe(shape: tuple, dtype: Any) -> str:
    return f"shape {shape_str(shape)} and dtype {np.dtype(dtype).name}"


def load_checkpoint(path: str | Path, like: PyTree) -> PyTree:
    """Read a checkpoint written by [`save_checkpoint`][energyattn.models.save_checkpoint] into
    a pytree with the structure, shapes and dtypes of `like`.

    Every leaf is checked against `like` before anything is accepted.

    **Raises:**

    - `ValueError` naming `path` and the first field (its pytree path, e.g.
      `model.transformer.w_query`) whose shape or dtype differs, when the checkpoint was
      written for another configuration;
    - `ValueError` saying the checkpoint is truncated or not a checkpoint, when the file ends
      early or holds something else;
    - `FileNotFoundError` when there is no file.
    """
    path = Path(path)
    flat, treedef = jtu.tree_flatten_with_path(like)
    leaves = []
    with open(path, "rb") as file:
        for index, (keypath, leaf) in enumerate(flat):
            if not eqx.is_array_like(leaf):
                leaves.append(leaf)  # not stored (the serialiser skips it)
                continue
            name = _leaf_name(keypath)
            try:
                stored = np.load(file, allow_pickle=False)
                if not isinstance(stored, np.ndarray):
                    raise ValueError("found an npz archive, not an array")
            except (ValueError, EOFError, OSError) as error:
                raise ValueError(
                    f"checkpoint {str(path)!r} is truncated or not a checkpoint: reading "
                    f"{name} (array {index + 1} of {len(flat)}) failed ({error})"
                ) from None
            want = leaf if isinstance(leaf, (jax.Array, np.ndarray)) else np.asarray(leaf)
            if stored.dtype.kind == "V" and stored.dtype.itemsize == want.dtype.itemsize:
                stored = stored.view(want.dtype)  # bfloat16 is stored as raw bytes
            # A Python scalar's dtype depends on the platform; only its kind must match.
            same_dtype = (
                stored.dtype == want.dtype if want is leaf else stored.dtype.kind == want.dtype.kind
            )
            if stored.shape != want.shape or not same_dtype:
                raise ValueError(
                    f"checkpoint {str(path)!r} does not fit this model: {name} has "
                    f"{_describe(stored.shape, stored.dtype)} in the checkpoint but "
                    f"{_describe(want.shape, want.dtype)} here; it was written for another "
                    "configuration (pass another checkpoint path, or delete it, to start afresh)"
                )
            if isinstance(leaf, jax.Array):
                leaves.append(jnp.asarray(stored))
            elif isinstance(leaf, np.ndarray):
                leaves.append(stored)
            else:  # a Python or NumPy scalar
                leaves.append(type(leaf)(stored.item()))
        if file.read(1):
            raise ValueError(
                f"checkpoint {str(path)!r} does not fit this model: it holds more arrays than "
                f"the {len(flat)} expected; it was written for another configuration (pass "
                "another checkpoint path, or delete it, to start afresh)"
            )
    return jtu.tree_unflatten(treedef, leaves)
