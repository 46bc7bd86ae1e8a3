"""Data: scikit-learn's shipped 8x8 digits, MNIST files the user provides, patches, corruptions."""

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
