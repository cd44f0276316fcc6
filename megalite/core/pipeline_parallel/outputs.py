"""What backward keeps of an activation once it is sent: its autograd edge, not the tensor.

    kept = release_output(output)        # after the send: the edge (or the output, if it has none)
    run_freed_backward(tensors=(kept,), grad_tensors=(grad,))   # later: the backward from it

The executor (``executor.py``) releases each sent output this way once its send is done, so a
stage holds one ``[s, b, h]`` fewer per in-flight micro-batch; its B runs the backward from the
edge.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd import Variable
from torch.autograd.graph import GradientEdge, get_gradient_edge


def release_output(
    output: torch.Tensor | GradientEdge | None,
) -> torch.Tensor | GradientEdge | None:
    """After an activation is sent: what backward needs of it, without the tensor. The next stage
    has a copy, and backward only needs the output's autograd edge (its ``grad_fn`` and output
    index), so the tensor is dropped and its storage goes with the last reference -- one
    ``[s, b, h]`` per in-flight micro-batch, as Megatron's swap of ``output.data`` saves. Unlike
    that swap it stays right when the chunk's last op saved its own output for backward (a
    ``tanh``, a ``sigmoid``), with or without saved-tensor hooks: the saved copy keeps the storage
    alive instead of being replaced by an empty tensor. An output without an autograd node (no
    grad needed) is kept as it is."""
    if isinstance(output, torch.Tensor) and output.grad_fn is not None:
        return get_gradient_edge(output)
    return output


# ``run_freed_backward(tensors=(output,), grad_tensors=(grad,))``: the backward of outputs (or of
# the edges ``release_output`` kept of them) from their grads, the graph freed as it goes. The
# engine needs only each output's node. A C callable, so the executor's every B pays no Python
# frame for it.
run_freed_backward = functools.partial(
    Variable._execution_engine.run_backward,
    keep_graph=False,
    create_graph=False,
    inputs=(),
    allow_unreachable=True,
    accumulate_grad=True,
)
