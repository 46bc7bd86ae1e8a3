"""Task models with data, training and evaluation (unbatched; vmap for batches)."""

from .._io import load_checkpoint as load_checkpoint, save_checkpoint as save_checkpoint
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
from ._image_et import (
    ImageEnergyTransformer as ImageEnergyTransformer,
    evaluate_inpainting as evaluate_inpainting,
    load_image_et as load_image_et,
    masked_patch_mse as masked_patch_mse,
    save_image_et as save_image_et,
    train_inpainting as train_inpainting,
)
from ._replay import ReplayBuffer as ReplayBuffer
from ._training import (
    TrainOptions as TrainOptions,
    TrainResult as TrainResult,
    make_optimizer as make_optimizer,
)
from ._vit import (
    PatchTransformer as PatchTransformer,
    TransformerBlock as TransformerBlock,
    train_reconstruction as train_reconstruction,
)
