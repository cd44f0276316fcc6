"""What backward keeps of an activation once it is sent: its autograd edge, not the tensor.

    kept = release_output(output)        # after the send: the edge (or the output, if it has none)
    backward_freed_output(kept, grad)    # later: the backward from that edge

The executor (``executor.py``) releases each sent output this way once its send is done, so a
stage holds one ``[s, b, h]`` fewer per in-flight micro-batch; its B runs the backward from the
edge (inlined there, one call fewer per action).
"""

from __future__ import annotations

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


def backward_freed_output(output: torch.Tensor | GradientEdge, grad: torch.Tensor) -> None:
    """``output.backward(grad)`` for an output (or the ``GradientEdge`` ``release_output`` kept of
    it); the engine itself only needs the node."""
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(),
        allow_unreachable=True,
        accumulate_grad=True,
    )
