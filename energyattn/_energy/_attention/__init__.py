"""The attention log-sum-exp, one room per concept: which implementation runs (`_policy`),
the naive path (`_naive`), the blockwise passes (`_blocks`), where they run (`_passes`: one
device, `_ring`: over devices, `_cudnn`: the fused kernel), their derivatives
(`_derivatives`) and the entry points (`_logsumexp`)."""

from ._logsumexp import (
    attention_logsumexp as attention_logsumexp,
    lse_rows as lse_rows,
    ring_lse as ring_lse,
    split_mask as split_mask,
)
from ._naive import masked_logsumexp as masked_logsumexp
from ._passes import naive_on_cpu as naive_on_cpu
from ._policy import (
    BLOCKWISE_THRESHOLD as BLOCKWISE_THRESHOLD,
    BlockSize as BlockSize,
    BlockSizes as BlockSizes,
    Implementation as Implementation,
    as_block_sizes as as_block_sizes,
    check_block_size as check_block_size,
    check_implementation as check_implementation,
    select_implementation as select_implementation,
)
