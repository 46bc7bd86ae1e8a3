"""The `.npz` files of the image Energy Transformer: the public checkpoint's layout, read
and written (`load_image_et`, `save_image_et`), with the model's hyperparameters."""

import collections
import json
import zipfile
from pathlib import Path
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .._checks import (
    check_image_shape,
    default_dtype,
    shape_str,
)
from .._io import atomic_output, check_output_file
from ._image_et import ImageEnergyTransformer

# The layout of the public Energy Transformer checkpoint (a plain dict of arrays).
_NPZ_KEYS = (
    "Wq",
    "Wk",
    "Xi",
    "Wenc",
    "Benc",
    "Wdec",
    "Bdec",
    "LNORM_gamma",
    "LNORM_bias",
    "CLS_token",
    "MASK_token",
    "POS_embed",
)


#: The entry of a file written by `save_image_et` that holds the model's hyperparameters (a
#: JSON object as a string array; the public checkpoint has none).
_HYPERPARAMETERS = "hyperparameters"


def _read_npz(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    # The arrays of the checkpoint layout and the stored hyperparameters (empty when the file
    # has none); a clear `ValueError` naming the file for anything else (np.load would try to
    # unpickle a text file).
    try:
        file = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
        if isinstance(error, FileNotFoundError | IsADirectoryError | PermissionError):
            raise
        raise ValueError(
            f"{str(path)!r} is not an .npz file of Energy Transformer weights ({error})"
        ) from None
    if not isinstance(file, np.lib.npyio.NpzFile):
        raise ValueError(
            f"{str(path)!r} is not an .npz file of Energy Transformer weights (it holds a "
            "single array); expected the arrays " + ", ".join(_NPZ_KEYS)
        )
    with file:
        missing = [k for k in _NPZ_KEYS if k not in file.files]
        if missing:
            raise ValueError(
                f"{str(path)!r} is missing the arrays {missing}; expected {list(_NPZ_KEYS)}"
            )
        try:
            arrays = {k: np.asarray(file[k]) for k in _NPZ_KEYS}
            stored = np.asarray(file[_HYPERPARAMETERS]) if _HYPERPARAMETERS in file.files else None
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
            raise ValueError(f"{str(path)!r} is truncated or damaged ({error})") from None
    for name, array in arrays.items():
        if array.dtype.kind not in "fiu":
            raise ValueError(
                f"{str(path)!r}: {name} must hold real numbers, got dtype {array.dtype}"
            )
    hyperparameters: dict[str, Any] = {}
    if stored is not None:
        try:
            loaded = json.loads(str(stored.item())) if stored.dtype.kind == "U" else None
        except (ValueError, TypeError):
            loaded = None
        if not isinstance(loaded, dict):
            raise ValueError(
                f"{str(path)!r}: {_HYPERPARAMETERS} must be a JSON object (as save_image_et "
                f"writes it), got {str(stored)[:80]!r}"
            )
        hyperparameters = loaded
    return arrays, hyperparameters


def _token_dim(arrays: dict[str, np.ndarray]) -> int:
    """The token dimension D of an Energy Transformer checkpoint: the size that most of the
    axes which should be D agree on (ties go to `Wq`'s)."""
    axes = {"Wq": -1, "Wk": -1, "Xi": 0, "Wenc": -1, "Benc": 0, "Wdec": 0, "LNORM_bias": 0}
    axes |= {"CLS_token": 0, "MASK_token": 0, "POS_embed": -1}
    sizes = [arrays[name].shape[axis] for name, axis in axes.items() if arrays[name].ndim]
    counts = collections.Counter(sizes)
    first = arrays["Wq"].shape[-1]
    return max(counts, key=lambda size: (counts[size], size == first))


#: The settings of the released ImageNet model, for files that do not store theirs.
_RELEASED = dict(
    image_shape=(3, 224, 224), patch_size=16, include_self=True, step_size=0.1, num_steps=12
)


def load_image_et(
    path: str | Path,
    *,
    image_shape: tuple[int, int, int] | None = None,
    patch_size: int | None = None,
    include_self: bool | None = None,
    step_size: float | None = None,
    num_steps: int | None = None,
    dtype: Any = None,
) -> ImageEnergyTransformer:
    r"""Load Energy Transformer weights from an `.npz` file in the public checkpoint's layout,
    such as [`save_image_et`][energyattn.models.save_image_et] writes (the model of
    `energyattn demo` is its `model.npz`).

    The file holds one array per key ($H$ heads, $Y$ head dim, $D$ token dim, $M$ memories,
    $Z = C p^2$ pixels per patch, $N$ patches):

    | key | shape | meaning |
    |---|---|---|
    | `Wq`, `Wk` | `(H, Y, D)` | query / key projections $W^Q, W^K$ |
    | `Xi` | `(D, M)` | memories $\xi$, one per column (the model's `memories` is `Xi.T`) |
    | `Wenc`, `Benc` | `(Z, D)`, `(D,)` | patch embedding (`tokens = patches @ Wenc + Benc`) |
    | `Wdec`, `Bdec` | `(D, Z)`, `(Z,)` | unembedding |
    | `LNORM_gamma`, `LNORM_bias` | `()` (or `(1,)`), `(D,)` | energy layer norm $\gamma, \delta$ |
    | `CLS_token`, `MASK_token` | `(D,)` | the CLS and MASK tokens |
    | `POS_embed` | `(N + 1, D)` | position embeddings, CLS first |

    Patches are flattened in (channel, row, column) order and ordered row by row, as in
    [`patchify`][energyattn.data.patchify].

    A file written by `save_image_et` also stores the model's hyperparameters (image shape,
    patch size, $\beta$, `include_self`, `memory`, `step_size`, `num_steps`, as a JSON string
    under `hyperparameters`), so it loads with no settings to repeat:

    ```python
    import tempfile
    from pathlib import Path

    import jax.random as jr
    import energyattn as ea

    model = ea.models.ImageEnergyTransformer(
        (1, 8, 8), 2, dim=8, num_heads=2, head_dim=4, num_memories=16, num_steps=3, key=jr.key(0)
    )
    with tempfile.TemporaryDirectory() as folder:
        ea.models.save_image_et(Path(folder) / "model.npz", model)
        back = ea.models.load_image_et(Path(folder) / "model.npz")
    assert back.image_shape == (1, 8, 8) and back.transformer.num_steps == 3
    ```

    The public checkpoint stores none: the arguments' defaults are then the released
    model's (ImageNet, `(3, 224, 224)`, 16-pixel patches, trained with the self term in the
    attention sum, `include_self=True`), and the attention uses $\beta = 1/\sqrt{Y}$.

    `Xi` is read exactly as the public checkpoint's own loader reads it (`D, M = Xi.shape`),
    also when $M = D$. (Earlier versions of `save_image_et` wrote `(M, D)`; transpose the
    `Xi` of such a file once.)

    **Arguments:**

    - `path`: the `.npz` file.
    - `image_shape`, `patch_size`: the images the weights are for.
    - `include_self`, `step_size`, `num_steps`: dynamics settings.
    - `dtype`: convert the weights to this dtype (default float32, float64 under x64).

    Each setting left `None` is the file's, else the released model's; one given overrides
    the file's.

    **Returns:**

    An [`ImageEnergyTransformer`][energyattn.models.ImageEnergyTransformer].
    """
    arrays, stored = _read_npz(path)
    given: dict[str, Any] = dict(
        image_shape=image_shape,
        patch_size=patch_size,
        include_self=include_self,
        step_size=step_size,
        num_steps=num_steps,
    )
    settings = {
        name: value if value is not None else stored.get(name, _RELEASED[name])
        for name, value in given.items()
    }
    image_shape = tuple(settings["image_shape"])
    (channels, height, width), patch_size = check_image_shape(image_shape, settings["patch_size"])
    for name, axes in (("Wq", "heads, head_dim, dim"), ("Xi", "dim, memories")):
        if arrays[name].ndim != len(axes.split(", ")):
            raise ValueError(
                f"{str(path)!r}: {name} must have shape ({axes}), got "
                f"{shape_str(arrays[name].shape)}"
            )
    # D is the size most of the arrays agree on, so the one array that disagrees is named.
    dim = _token_dim(arrays)
    heads, head_dim = arrays["Wq"].shape[:2]
    if arrays["Xi"].shape[0] != dim:
        raise ValueError(
            f"{str(path)!r}: Xi must have shape (dim={dim}, memories), got "
            f"{shape_str(arrays['Xi'].shape)}"
        )
    memories = arrays["Xi"].T
    patch_dim = channels * patch_size**2
    num_patches = (height // patch_size) * (width // patch_size)
    gamma = arrays["LNORM_gamma"]
    if gamma.size != 1:
        raise ValueError(
            f"{str(path)!r}: LNORM_gamma must be a scalar, got shape {shape_str(gamma.shape)}"
        )
    expected = {
        "Wq": (heads, head_dim, dim),
        "Wk": (heads, head_dim, dim),
        "Wenc": (patch_dim, dim),
        "Benc": (dim,),
        "Wdec": (dim, patch_dim),
        "Bdec": (patch_dim,),
        "LNORM_bias": (dim,),
        "CLS_token": (dim,),
        "MASK_token": (dim,),
        "POS_embed": (num_patches + 1, dim),
    }
    for name, shape in expected.items():
        if arrays[name].shape != shape:
            raise ValueError(
                f"{str(path)!r}: {name} must have shape {shape_str(shape)} for "
                f"{shape_str(image_shape)} images in {patch_size}x{patch_size} patches with "
                f"dim={dim}, got "
                f"{shape_str(arrays[name].shape)}"
            )
    dtype = default_dtype(dtype)
    model = ImageEnergyTransformer(
        (channels, height, width),
        patch_size,
        dim=dim,
        num_heads=heads,
        head_dim=head_dim,
        num_memories=memories.shape[0],
        beta=stored.get("beta"),
        include_self=settings["include_self"],
        memory=stored.get("memory", "relu"),
        step_size=settings["step_size"],
        num_steps=settings["num_steps"],
        dtype=dtype,
        key=jr.key(0),
    )
    new = {
        "embed_weight": arrays["Wenc"],
        "embed_bias": arrays["Benc"],
        "unembed_weight": arrays["Wdec"],
        "unembed_bias": arrays["Bdec"],
        "cls_token": arrays["CLS_token"],
        "mask_token": arrays["MASK_token"],
        "pos_embed": arrays["POS_embed"],
    }
    model = eqx.tree_at(
        lambda m: [getattr(m, name) for name in new],
        model,
        [jnp.asarray(a, dtype) for a in new.values()],
    )
    return eqx.tree_at(
        lambda m: (
            m.transformer.w_query,
            m.transformer.w_key,
            m.transformer.memories,
            m.transformer.layer_norm.gamma,
            m.transformer.layer_norm.delta,
        ),
        model,
        (
            jnp.asarray(arrays["Wq"], dtype),
            jnp.asarray(arrays["Wk"], dtype),
            jnp.asarray(memories, dtype),
            jnp.asarray(gamma.reshape(()), dtype),
            jnp.asarray(arrays["LNORM_bias"], dtype),
        ),
    )


def save_image_et(path: str | Path, model: ImageEnergyTransformer) -> None:
    r"""Write a model's weights as an `.npz` file in the public Energy Transformer checkpoint's
    layout (`Xi` is the memories transposed, `(D, M)`), with its hyperparameters (a JSON
    string under `hyperparameters`), which [`load_image_et`][energyattn.models.load_image_et]
    reads back with no settings to repeat.

    The file is written to exactly `path` (no `.npz` is appended). The path is checked before
    anything is written (its folder must exist and be writable, `path` must not be a folder;
    else an `OSError` naming it), and the file is replaced atomically. A trainable $\beta$ is
    stored as its current value (it loads fixed).

    **Raises:** `TypeError` when `model` is not an
    [`ImageEnergyTransformer`][energyattn.models.ImageEnergyTransformer].
    """
    if not isinstance(model, ImageEnergyTransformer):
        raise TypeError(
            "save_image_et saves an energyattn.models.ImageEnergyTransformer, got "
            f"{type(model).__module__}.{type(model).__qualname__}"
        )
    path = check_output_file(path, what="model file")
    et = model.transformer
    if et.layer_norm.delta is None:
        raise ValueError("the npz layout stores a layer-norm bias; this model has use_bias=False")
    arrays = {
        "Wq": et.w_query,
        "Wk": et.w_key,
        "Xi": et.memories.T,
        "Wenc": model.embed_weight,
        "Benc": model.embed_bias,
        "Wdec": model.unembed_weight,
        "Bdec": model.unembed_bias,
        "LNORM_gamma": et.layer_norm.gamma,
        "LNORM_bias": et.layer_norm.delta,
        "CLS_token": model.cls_token,
        "MASK_token": model.mask_token,
        "POS_embed": model.pos_embed,
    }
    hyperparameters = {
        "image_shape": list(model.image_shape),
        "patch_size": model.patch_size,
        "beta": float(et.beta),
        "include_self": et.include_self,
        "memory": et.memory,
        "step_size": et.step_size,
        "num_steps": et.num_steps,
    }
    with atomic_output(path) as partial, open(partial, "wb") as file:
        # Any: NumPy's stubs check `**` arrays against savez's `allow_pickle: bool`.
        named: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
        named[_HYPERPARAMETERS] = np.asarray(json.dumps(hyperparameters))
        np.savez(file, **named)
