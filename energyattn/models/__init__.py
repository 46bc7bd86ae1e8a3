"""Task models with data, training and evaluation (unbatched; vmap for batches)."""

from ._attractor import (
    AttractorImageModel as AttractorImageModel,
    corrupt_image as corrupt_image,
    reconstruction_curves as reconstruction_curves,
    train_attractor as train_attractor,
)
from ._classifier import (
    AttentionClassifier as AttentionClassifier,
    MeanFieldClassifier as MeanFieldClassifier,
    evaluate_classifier as evaluate_classifier,
    train_classifier as train_classifier,
)
from ._ebt import (
    CausalBlock as CausalBlock,
    CausalTransformer as CausalTransformer,
    EBTContext as EBTContext,
    EnergyBasedTransformer as EnergyBasedTransformer,
    ReplayBuffer as ReplayBuffer,
    Thought as Thought,
    causal_attention as causal_attention,
    complete as complete,
    lowest_per_position as lowest_per_position,
    next_token_error as next_token_error,
    thinking_steps_for_training as thinking_steps_for_training,
    train_ebt as train_ebt,
    train_next_token as train_next_token,
)
from ._ham import (
    FeedforwardClassifier as FeedforwardClassifier,
    HAMClassifier as HAMClassifier,
    evaluate_ham_classifier as evaluate_ham_classifier,
)
from ._image_et import (
    ImageEnergyTransformer as ImageEnergyTransformer,
    load_image_et as load_image_et,
    masked_patch_mse as masked_patch_mse,
    save_image_et as save_image_et,
)
from ._training import (
    TrainResult as TrainResult,
    evaluate_inpainting as evaluate_inpainting,
    load_checkpoint as load_checkpoint,
    make_optimizer as make_optimizer,
    save_checkpoint as save_checkpoint,
    train_inpainting as train_inpainting,
)
from ._vit import (
    PatchTransformer as PatchTransformer,
    TransformerBlock as TransformerBlock,
    train_reconstruction as train_reconstruction,
)
