"""Data: scikit-learn's shipped 8x8 digits, MNIST files the user provides, patches, corruptions."""

from .._namespace import public_dir as _public_dir
from ._corruption import (
    add_gaussian_noise as add_gaussian_noise,
    add_rescaled_noise as add_rescaled_noise,
    flip_signs as flip_signs,
    mask_entries as mask_entries,
)
from ._digits import Digits as Digits, load_digits as load_digits
from ._mnist import Mnist as Mnist, load_mnist as load_mnist
from ._patches import (
    patchify as patchify,
    random_patch_mask as random_patch_mask,
    unpatchify as unpatchify,
)
from ._spin_tokens import (
    SpinPatchEmbedding as SpinPatchEmbedding,
    pixels_to_spins as pixels_to_spins,
    spins_to_pixels as spins_to_pixels,
)

# The API, as `dir()` lists it (`test_public_namespaces_list_only_their_api` checks it).
__all__ = [
    "Digits",
    "Mnist",
    "SpinPatchEmbedding",
    "add_gaussian_noise",
    "add_rescaled_noise",
    "flip_signs",
    "load_digits",
    "load_mnist",
    "mask_entries",
    "patchify",
    "pixels_to_spins",
    "random_patch_mask",
    "spins_to_pixels",
    "unpatchify",
]
__dir__ = _public_dir(__all__)
