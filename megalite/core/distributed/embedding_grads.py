"""Keep the tied word embedding identical on the first and last pipeline stage.

With tied input/output embeddings and PP > 1, the first stage holds the word embedding and the last
stage a copy used by the output layer (identical at init: the same keyed initialiser). Each copy
gets only its own part of the gradient, so after backward the two are summed over the embedding
group (first and last stage of the same TP/DP coordinate); both then take the same optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.core.tensor_parallel.mappings import group_size


def all_reduce_embedding_grads(weight: torch.nn.Parameter | None, embedding_group) -> None:
    """Sum the grad of the shared embedding weight (``main_grad`` if it has one) over the group.

    Call on every rank after backward; ranks outside the group, or with no shared weight, pass
    None / a None group and return at once.
    """
    if weight is None or embedding_group is None or group_size(embedding_group) == 1:
        return
    grad = weight.main_grad if hasattr(weight, "main_grad") else weight.grad
    if grad is None:
        grad = torch.zeros_like(weight)
        weight.grad = grad
    dist.all_reduce(grad, group=embedding_group)
