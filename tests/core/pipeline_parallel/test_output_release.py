"""The executor releases a sent output by keeping only its autograd edge (``release_output``).

Megatron-style freeing swaps ``output.data`` for an empty tensor once the output is sent. When the
chunk's last op saved its own output for backward (``tanh``, ``sigmoid``) and saved-tensor hooks
hand backward the tensor object itself (identity hooks, as activation offloading or counting
does), backward then reads the empty tensor: wrong grads, silently (it broadcasts). Checked here:

- the control: the swap under identity hooks gives wrong grads, the edge gives the right ones;
- a residual-ending chunk (megalite's layers) still frees its output's storage once released;
- PP 2, chunks ending in ``tanh`` / ``sigmoid`` (the loss stage too), 1f1b and zbv, with and
  without identity saved-tensor hooks: every grad and loss = the unpipelined oracle (1e-5). The
  release happens once a send is known done: on gloo a send reports done only after a ``wait``,
  which the executor does right after posting without overlap (``--no-overlap-p2p-communication``,
  run here for every case: the old swap fails it) and at the end of the step with overlap (one
  case, overlapped, as a check that the release does not break it).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from megalite.core.pipeline_parallel.forward_backward import forward_backward_pipelining
from megalite.core.pipeline_parallel.generators import layout_of
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.outputs import release_output, run_freed_backward
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.core.tensor_parallel.layers import RowParallelLinear
from tests.harness import run_distributed
from tests.mesh import mesh

S, B, H, P, M = 4, 2, 16, 2, 5


def _identity_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


class Chunk(nn.Module):
    """One stage: a row-parallel linear (I / W split) ending in an op that saves its output."""

    def __init__(self, first, last_op):
        super().__init__()
        self.first, self.input_tensor, self.last_op = first, None, last_op
        self.lin = RowParallelLinear(H, H, tp_group=None)

    def set_input_tensor(self, t):
        self.input_tensor = t

    def forward(self, x):
        h = x if self.first else self.input_tensor
        return self.last_op(self.lin(h)[0])


def _forward_step(data_iterator, model):
    out = model(next(data_iterator))
    return out, lambda o: ((o * o).mean(), {"loss": (o * o).mean().detach()})


def test_edge_backward_is_right_where_the_data_swap_is_not():
    torch.manual_seed(0)
    x, w, g = torch.randn(4, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True), None
    g = torch.randn(4, 3)
    want = torch.autograd.grad(torch.tanh(x @ w), (x, w), g)
    results = {}
    for how in ("swap", "edge"):
        x.grad = w.grad = None
        with _identity_hooks():
            y = torch.tanh(x @ w)
        if how == "swap":  # the old freeing: the saved output becomes an empty tensor
            y.data = torch.empty(1)
            out = y
        else:
            out = release_output(y)
            del y
        run_freed_backward(tensors=(out,), grad_tensors=(g,))
        results[how] = torch.allclose(x.grad, want[0]) and torch.allclose(w.grad, want[1])
    assert results == {"swap": False, "edge": True}


def test_release_frees_a_residual_outputs_storage():
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    y = x + lin(x)  # the add saves nothing: nothing but the executor holds y
    alive = weakref.ref(y)
    edge = release_output(y)
    del y
    assert alive() is None, "the released output is still referenced"
    run_freed_backward(tensors=(edge,), grad_tensors=(torch.ones(3, 8),))
    assert x.grad is not None and lin.weight.grad is not None
    assert release_output(None) is None
    plain = torch.randn(2)  # no autograd node: kept as it is
    assert release_output(plain) is plain


def _oracle(full, data, m):
    for c in full:
        c.zero_grad(set_to_none=True)
    losses = []
    for x in data:
        h = x
        for c in full:
            c.input_tensor = h
            h = c(h)
        loss = (h * h).mean()
        (loss / m).backward()
        losses.append(loss.detach())
    return losses, [[p.grad.clone() for p in c.parameters()] for c in full]


def _case():
    ps = mesh(1, P)
    r = ps.pp_rank
    p2ps = {
        overlap: P2PCommunicator(
            prev_rank=ps.prev_rank,
            next_rank=ps.next_rank,
            tensor_shape=(S, B, H),
            dtype=torch.float32,
            device=torch.device("cpu"),
            group=ps.pp_group,
            pp_ranks=ps.pp_ranks,
            overlap=overlap,
        )
        for overlap in (False, True)
    }
    torch.manual_seed(1)
    data = [torch.randn(S, B, H) for _ in range(M)]
    bad = []
    for schedule, v in (("1f1b", 1), ("zbv", 2)):
        layout = layout_of(schedule, P, v)
        for name, op in (("tanh", torch.tanh), ("sigmoid", torch.sigmoid)):
            torch.manual_seed(0)
            full = [Chunk(s == 0, op) for s in range(layout.num_stages)]
            want_losses, want_grads = _oracle(full, data, M)
            runs = [(False, False), (True, False)]
            if (schedule, name) == ("1f1b", "tanh"):
                runs.append((True, True))
            for hooked, overlap in runs:
                p2p = p2ps[overlap]
                chunks = [full[layout.stage(r, c)] for c in range(v)]
                for c in chunks:
                    c.zero_grad(set_to_none=True)
                with _identity_hooks() if hooked else contextlib.nullcontext():
                    losses = forward_backward_pipelining(
                        schedule=schedule,
                        forward_step_func=_forward_step,
                        model=[ModelChunk(chunk, index=c) for c, chunk in enumerate(chunks)],
                        data_iterator=[iter(data)] * v,
                        num_microbatches=M,
                        p2p=p2p,
                        pp_rank=r,
                        pp_size=P,
                    )
                case = f"{schedule} {name} hooks={hooked} overlap={overlap} rank {r}"
                for c in range(v):
                    s = layout.stage(r, c)
                    for got, want in zip(chunks[c].parameters(), want_grads[s]):
                        if not torch.allclose(got.grad, want, rtol=1e-5, atol=1e-7):
                            bad.append(f"{case} stage {s}: grad differs")
                if r == P - 1:
                    got = torch.stack([d["loss"] for d in losses])
                    if not torch.allclose(got, torch.stack(want_losses), rtol=1e-5):
                        bad.append(f"{case}: losses differ")
    ps.destroy()
    return bad


def test_outputs_saved_by_their_last_op_train_right_with_and_without_hooks():
    for bad in run_distributed(_case, P):
        assert not bad, bad
