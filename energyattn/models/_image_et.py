"""Masked-image inpainting with an Energy Transformer: the model, its loss, its saved files,
its training and its evaluation against the mean-patch baseline."""

import collections
import json
import zipfile
from pathlib import Path
from typing import Any, Literal, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, PyTree

from .._checks import (
    check_finite,
    check_image_shape,
    default_dtype,
    keyword_arguments,
    positive_int,
    shape_str,
)
from .._custom_types import Scalar
from .._io import atomic_output, check_output_file
from .._solver import Solution
from ..data import patchify, random_patch_mask, unpatchify
from ..nn import EnergyTransformer
from ._training import TrainOptions, TrainResult, fit


class ImageEnergyTransformer(eqx.Module):
    r"""An Energy Transformer that inpaints masked image patches.

    $$x^{(0)} = \big[\mathrm{CLS};\; \mathrm{MASK}\ \text{or}\ P W_{\mathrm{emb}} + b_{\mathrm{emb}}
      \big] + \mathrm{POS}, \qquad x^{(T)} = \text{$T$ steps of }
      x \leftarrow x - \alpha\,\partial_g E(g)\big|_{g=\mathrm{LN}(x)},$$

    $$\hat P = \mathrm{LN}(x^{(T)}_{1:})\, W_{\mathrm{unemb}} + b_{\mathrm{unemb}}.$$

    The image (channels first) is cut into `patch_size` patches $P$; each patch is embedded
    linearly, masked patches are replaced by the learned MASK token, a CLS token is prepended
    and learned position embeddings are added. The tokens then descend the
    [`EnergyTransformer`][energyattn.nn.EnergyTransformer]'s energy for $T$ steps (default
    $\alpha = 0.1$, $T = 12$) and are decoded back into patches, and the patches into an image.

    **Arguments:**

    - `image_shape`: `(channels, height, width)` of the images (default `(1, 8, 8)`, the
      shipped digits).
    - `patch_size`: side of the square patches (default 2); must divide height and width.
    - `dim`, `num_heads`, `head_dim`, `num_memories`, `beta`, `include_self`, `memory`,
      `step_size`, `num_steps`: of the [`EnergyTransformer`][energyattn.nn.EnergyTransformer].
    - `dtype`: parameter dtype; `key`: a JAX PRNG key.

    ??? cite "Source"

        B. Hoover et al., *Energy Transformer* (NeurIPS 2023); the tutorial's
        "Image-compatible ET".
    """

    embed_weight: Float[Array, "patch_dim dim"]
    embed_bias: Float[Array, " dim"]
    unembed_weight: Float[Array, "dim patch_dim"]
    unembed_bias: Float[Array, " patch_dim"]
    cls_token: Float[Array, " dim"]
    mask_token: Float[Array, " dim"]
    pos_embed: Float[Array, "tokens dim"]
    transformer: EnergyTransformer
    image_shape: tuple[int, int, int] = eqx.field(static=True)
    patch_size: int = eqx.field(static=True)

    @keyword_arguments("ea.models.ImageEnergyTransformer")
    def __init__(
        self,
        image_shape: tuple[int, int, int] = (1, 8, 8),
        patch_size: int = 2,
        *,
        dim: int = 32,
        num_heads: int = 4,
        head_dim: int = 8,
        num_memories: int = 128,
        beta: float | None = None,
        include_self: bool = False,
        memory: Literal["relu", "softmax"] = "relu",
        step_size: float = 0.1,
        num_steps: int = 12,
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        self.image_shape, self.patch_size = check_image_shape(image_shape, patch_size)
        dim = positive_int("dim", dim)
        dtype = default_dtype(dtype)
        channels, height, width = self.image_shape
        patch_dim = channels * self.patch_size**2
        num_patches = (height // self.patch_size) * (width // self.patch_size)
        k_emb, k_unemb, k_cls, k_mask, k_pos, k_et = jr.split(key, 6)
        self.embed_weight = patch_dim**-0.5 * jr.normal(k_emb, (patch_dim, dim), dtype)
        self.embed_bias = jnp.zeros(dim, dtype)
        self.unembed_weight = dim**-0.5 * jr.normal(k_unemb, (dim, patch_dim), dtype)
        self.unembed_bias = jnp.zeros(patch_dim, dtype)
        self.cls_token = 0.02 * jr.normal(k_cls, (dim,), dtype)
        self.mask_token = 0.02 * jr.normal(k_mask, (dim,), dtype)
        self.pos_embed = 0.02 * jr.normal(k_pos, (num_patches + 1, dim), dtype)
        self.transformer = EnergyTransformer(
            dim,
            num_heads=num_heads,
            head_dim=head_dim,
            num_memories=num_memories,
            beta=beta,
            include_self=include_self,
            memory=memory,
            step_size=step_size,
            num_steps=num_steps,
            dtype=dtype,
            key=k_et,
        )

    @property
    def num_patches(self) -> int:
        """Number of patches (tokens without the CLS token)."""
        _, height, width = self.image_shape
        return (height // self.patch_size) * (width // self.patch_size)

    def _check_image(self, image: Any) -> Array:
        channels, height, width = self.image_shape
        if tuple(jnp.shape(image)) != self.image_shape:
            raise ValueError(
                f"image must have shape (channels={channels}, height={height}, width={width}), "
                f"got {shape_str(jnp.shape(image))}"
            )
        return check_finite("image", image)

    def _check_mask(self, mask: Any) -> Array:
        if tuple(jnp.shape(mask)) != (self.num_patches,):
            raise ValueError(
                f"mask must have shape (patches={self.num_patches},), one entry per patch, got "
                f"{shape_str(jnp.shape(mask))}"
            )
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ValueError(f"mask must be boolean (True = masked patch), got dtype {mask.dtype}")
        return mask

    def patchify(
        self, image: Float[ArrayLike, "channels height width"]
    ) -> Float[Array, "patches patch_dim"]:
        """The image's patches, shape `(num_patches, channels * patch_size**2)`."""
        return patchify(self._check_image(image), self.patch_size)

    def unpatchify(
        self, patches: Float[ArrayLike, "patches patch_dim"]
    ) -> Float[Array, "channels height width"]:
        """Inverse of [`patchify`][energyattn.models.ImageEnergyTransformer.patchify]."""
        return unpatchify(patches, self.image_shape, self.patch_size)

    def encode(
        self, image: Float[ArrayLike, "channels height width"]
    ) -> Float[Array, "patches dim"]:
        """Embed the patches linearly: one token per patch, shape `(num_patches, dim)`."""
        return self.patchify(image) @ self.embed_weight + self.embed_bias

    def decode(
        self, tokens: Float[ArrayLike, "patches dim"]
    ) -> Float[Array, "channels height width"]:
        """Read patch tokens out through the layer norm and the linear unembedding."""
        g = self.transformer.layer_norm(tokens)
        return self.unpatchify(g @ self.unembed_weight + self.unembed_bias)

    def prepare(
        self, tokens: Float[ArrayLike, "patches dim"], mask: Bool[ArrayLike, " patches"]
    ) -> Float[Array, "tokens dim"]:
        """Replace masked tokens by the MASK token, prepend CLS, add position embeddings."""
        mask = self._check_mask(mask)
        tokens = jnp.where(mask[:, None], self.mask_token, jnp.asarray(tokens))
        return jnp.concatenate([self.cls_token[None], tokens]) + self.pos_embed

    @overload
    def __call__(
        self,
        image: Float[ArrayLike, "channels height width"],
        mask: Bool[ArrayLike, " patches"],
        *,
        step_size: float | None = None,
        num_steps: int | None = None,
        return_solution: Literal[False] = False,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "channels height width"]: ...

    @overload
    def __call__(
        self,
        image: Float[ArrayLike, "channels height width"],
        mask: Bool[ArrayLike, " patches"],
        *,
        step_size: float | None = None,
        num_steps: int | None = None,
        return_solution: Literal[True],
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "channels height width"], Solution]: ...

    def __call__(
        self,
        image: Float[ArrayLike, "channels height width"],
        mask: Bool[ArrayLike, " patches"],
        *,
        step_size: float | None = None,
        num_steps: int | None = None,
        return_solution: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> (
        Float[Array, "channels height width"]
        | tuple[Float[Array, "channels height width"], Solution]
    ):
        """Reconstruct an image whose masked patches are hidden from the model.

        **Arguments:**

        - `image`: shape `(channels, height, width)`.
        - `mask`: boolean `(num_patches,)`, `True` for the patches to hide (see
          [`random_patch_mask`][energyattn.data.random_patch_mask]).
        - `step_size`, `num_steps`: override the transformer's $\\alpha$ and $T$.
        - `return_solution`: also return the descent's [`Solution`][energyattn.Solution]
          (energies per step in `energies`, the tokens of every step in `trajectory`).
        - `key`: unused; accepted for Equinox compatibility.

        **Returns:**

        The reconstructed image, same shape as `image` (every patch is decoded; the masked
        ones are the inpainting); with `return_solution=True` also the descent.
        """
        tokens = self.prepare(self.encode(image), mask)
        descent = self.transformer.recall(
            tokens, step_size=step_size, num_steps=num_steps, return_trajectory=return_solution
        )
        reconstruction = self.decode(descent.value[1:])
        return (reconstruction, descent) if return_solution else reconstruction


def masked_patch_mse(
    model: ImageEnergyTransformer,
    image: Float[ArrayLike, "channels height width"],
    mask: Bool[ArrayLike, " patches"],
) -> Scalar:
    r"""Mean squared error of the reconstruction on the masked patches only.

    $$\ell = \frac{1}{|S|\,Z} \sum_{n \in S} \lVert \hat P_n - P_n \rVert^2,
      \qquad S = \{n : \mathrm{mask}_n\},\; Z = \text{pixels per patch}$$

    (0 when nothing is masked). Average it over a batch with `jax.vmap`.
    """
    mask = model._check_mask(mask)
    return masked_patch_error(model.patchify(model(image, mask)), model.patchify(image), mask)


def masked_patch_error(
    predicted: Float[Array, "patches patch_dim"],
    target: Float[Array, "patches patch_dim"],
    mask: Bool[Array, " patches"],
) -> Scalar:
    """Mean squared error over the pixels of the masked patches (0 when none is masked)."""
    per_patch = jnp.mean(jnp.square(predicted - target), axis=-1)
    return jnp.sum(jnp.where(mask, per_patch, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


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


# --------------------------------------------------------------------------- training


def _inpainting_loss(
    params: PyTree, static: PyTree, step_key: PRNGKeyArray, data: Any, config: tuple
) -> Array:
    (images,) = data
    batch_size, num_masked = config
    model = eqx.combine(params, static)
    pick_key, mask_key = jr.split(step_key)
    chosen = jr.choice(pick_key, images.shape[0], (batch_size,), replace=False)
    masks = jax.vmap(lambda k: random_patch_mask(k, model.num_patches, num_masked))(
        jr.split(mask_key, batch_size)
    )
    losses = jax.vmap(masked_patch_mse, in_axes=(None, 0, 0))(model, images[chosen], masks)
    return jnp.mean(losses)


def train_inpainting(
    model: ImageEnergyTransformer,
    images: Float[ArrayLike, "n channels height width"],
    *,
    key: PRNGKeyArray,
    train_steps: int,
    num_masked: int,
    batch_size: int = 64,
    options: TrainOptions = TrainOptions(),
) -> TrainResult:
    r"""Train an image Energy Transformer to inpaint randomly masked patches.

    $$\min_\theta\; \mathbb E_{\text{image},\,S}\;
      \frac{1}{|S|Z}\sum_{n\in S}\lVert \hat P_n(\theta) - P_n\rVert^2$$

    Each step draws `batch_size` training images and, for each, a random set $S$ of
    `num_masked` patches; the loss ([`masked_patch_mse`][energyattn.models.masked_patch_mse])
    is vmapped over the batch and differentiated through the unrolled descent.

    **Arguments:**

    - `model`: the initial model.
    - `images`: training images, shape `(n, channels, height, width)`.
    - `key`: a JAX PRNG key (batches and masks).
    - `train_steps`: total optimisation steps (the schedule's length); any number `>= 1`.
    - `num_masked`: patches masked per image.
    - `batch_size`: images per step.
    - `options`: the optimiser, checkpoints, time limit, progress and callback, a
      [`TrainOptions`][energyattn.models.TrainOptions] (learning rate `3e-3` unless set).

    **Returns:**

    A [`TrainResult`][energyattn.models.TrainResult].
    """
    images = jnp.asarray(images)
    if images.ndim != 4 or images.shape[1:] != model.image_shape:
        channels, height, width = model.image_shape
        raise ValueError(
            f"images must have shape (n, channels={channels}, height={height}, width={width}), "
            f"got {shape_str(images.shape)}"
        )
    batch_size = positive_int("batch_size", batch_size)
    if batch_size > images.shape[0]:
        raise ValueError(f"batch_size={batch_size} exceeds the {images.shape[0]} training images")
    random_patch_mask(key, model.num_patches, num_masked)  # validates num_masked early
    return fit(
        model,
        _inpainting_loss,
        (images,),
        (batch_size, num_masked),
        key=key,
        train_steps=train_steps,
        options=options,
        default_learning_rate=3e-3,
    )


def evaluate_inpainting(
    model: ImageEnergyTransformer,
    images: Float[ArrayLike, "n channels height width"],
    *,
    num_masked: int,
    key: PRNGKeyArray,
    mean_image: Float[ArrayLike, "channels height width"],
    batch_size: int = 256,
) -> dict[str, float]:
    r"""Masked-patch MSE of the model and of the mean-patch baseline on the same masks.

    The baseline fills each masked patch with the mean training patch *at that position*
    (the patch of `mean_image`, usually the training set's mean image), the best prediction
    that ignores the visible patches.

    **Arguments:**

    - `model`: the model to evaluate.
    - `images`: held-out images, shape `(n, channels, height, width)`.
    - `num_masked`: patches masked per image.
    - `key`: a JAX PRNG key for the masks (image `i` uses `fold_in(key, i)`).
    - `mean_image`: the baseline's prediction for every image.
    - `batch_size`: images per compiled call (memory only; results do not depend on it).

    **Returns:**

    `{"mse": ..., "baseline_mse": ..., "ratio": mse / baseline_mse}` as Python floats.
    """
    images = jnp.asarray(images)
    if images.ndim != 4 or images.shape[1:] != model.image_shape:
        raise ValueError(
            f"images must have shape (n, *{model.image_shape}), got {shape_str(images.shape)}"
        )
    mean_patches = model.patchify(mean_image)

    @eqx.filter_jit
    def errors(model: ImageEnergyTransformer, batch: Array, indices: Array) -> tuple:
        masks = jax.vmap(
            lambda i: random_patch_mask(jr.fold_in(key, i), model.num_patches, num_masked)
        )(indices)
        ours = jax.vmap(masked_patch_mse, in_axes=(None, 0, 0))(model, batch, masks)

        def baseline(image: Array, mask: Array) -> Array:
            return masked_patch_error(mean_patches, model.patchify(image), mask)

        return ours, jax.vmap(baseline)(batch, masks)

    ours, base = [], []
    # Every call has the same shape, so `errors` compiles once: the last batch is padded
    # (with blank images whose errors are dropped).
    size = max(1, min(batch_size, images.shape[0]))
    for start in range(0, images.shape[0], size):
        batch = images[start : start + size]
        count = batch.shape[0]
        batch = jnp.pad(batch, ((0, size - count), (0, 0), (0, 0), (0, 0)))
        a, b = errors(model, batch, jnp.arange(start, start + size))
        ours.append(np.asarray(a)[:count])
        base.append(np.asarray(b)[:count])
    mse = float(np.mean(np.concatenate(ours)))
    baseline_mse = float(np.mean(np.concatenate(base)))
    return {"mse": mse, "baseline_mse": baseline_mse, "ratio": mse / baseline_mse}
