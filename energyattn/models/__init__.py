"""Task models with data, training and evaluation (unbatched; vmap for batches)."""

from .._io import load_checkpoint as load_checkpoint, save_checkpoint as save_checkpoint
from .._namespace import public_dir as _public_dir
from ._attractor import (
    AttractorImageModel as AttractorImageModel,
    corrupt_image as corrupt_image,
    reconstruction_curves as reconstruction_curves,
    train_attractor as train_attractor,
)
from ._causal import (
    CausalBlock as CausalBlock,
    CausalTransformer as CausalTransformer,
    causal_attention as causal_attention,
    next_token_error as next_token_error,
    train_next_token as train_next_token,
)
from ._classifier import (
    AttentionClassifier as AttentionClassifier,
    MeanFieldClassifier as MeanFieldClassifier,
    evaluate_classifier as evaluate_classifier,
    train_classifier as train_classifier,
)
from ._ebt import (
    EBTContext as EBTContext,
    EnergyBasedTransformer as EnergyBasedTransformer,
    Thought as Thought,
    complete as complete,
    lowest_per_position as lowest_per_position,
    thinking_steps_for_training as thinking_steps_for_training,
    train_ebt as train_ebt,
)
from ._ham import (
    FeedforwardClassifier as FeedforwardClassifier,
    HAMClassifier as HAMClassifier,
    evaluate_ham_classifier as evaluate_ham_classifier,
)
from ._image_et import ImageEnergyTransformer as ImageEnergyTransformer
from ._image_et_io import load_image_et as load_image_et, save_image_et as save_image_et
from ._inpainting import (
    evaluate_inpainting as evaluate_inpainting,
    masked_patch_mse as masked_patch_mse,
    train_inpainting as train_inpainting,
)
from ._replay import ReplayBuffer as ReplayBuffer
from ._training import (
    StopTraining as StopTraining,
    TrainOptions as TrainOptions,
    TrainResult as TrainResult,
    make_optimizer as make_optimizer,
)
from ._vit import (
    PatchTransformer as PatchTransformer,
    TransformerBlock as TransformerBlock,
    train_reconstruction as train_reconstruction,
)

# The API, as `dir()` lists it (`test_public_namespaces_list_only_their_api` checks it).
__all__ = [
    "AttentionClassifier",
    "AttractorImageModel",
    "CausalBlock",
    "CausalTransformer",
    "EBTContext",
    "EnergyBasedTransformer",
    "FeedforwardClassifier",
    "HAMClassifier",
    "ImageEnergyTransformer",
    "MeanFieldClassifier",
    "PatchTransformer",
    "ReplayBuffer",
    "StopTraining",
    "Thought",
    "TrainOptions",
    "TrainResult",
    "TransformerBlock",
    "causal_attention",
    "complete",
    "corrupt_image",
    "evaluate_classifier",
    "evaluate_ham_classifier",
    "evaluate_inpainting",
    "load_checkpoint",
    "load_image_et",
    "lowest_per_position",
    "make_optimizer",
    "masked_patch_mse",
    "next_token_error",
    "reconstruction_curves",
    "save_checkpoint",
    "save_image_et",
    "thinking_steps_for_training",
    "train_attractor",
    "train_classifier",
    "train_ebt",
    "train_inpainting",
    "train_next_token",
    "train_reconstruction",
]
__dir__ = _public_dir(__all__)
