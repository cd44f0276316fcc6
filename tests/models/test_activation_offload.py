"""Activation offload (``cpu_offloading``, ``cpu_offloading_num_layers`` N) in the GPT model:
which saved tensors move, counted from the tensors themselves.

- Placement: a meter of the test's own (saved-tensor hooks around the whole forward, each saved
  tensor attributed to the layer running, parameters' storages left out, a tensor counted once
  per layer)
  measures every layer's saved activations without offload. With offload, the bytes the model
  reports moved for each of the first N layers equal those, nothing moved for the other layers,
  and the meter, which sees only what autograd itself still holds, sees nothing of the first N
  layers and all of the rest. A saved activation of an offloaded layer (its first norm's output)
  is freed once forward is done; a later layer's is not. Loss and grads are bitwise equal.
- Full recompute: a recomputed layer moves exactly its checkpoint's tensor inputs (the hidden
  states and the rotary tables), counted from the tensors the layer was called with.
- Parameters (and views of them) never move: a linear layer moves its input, not its weight.
- Bad N: negative, or more than a chunk's layers, is refused in one line.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from megalite.core.activation_offload import ActivationOffload
from megalite.core.parallel_state import ParallelState
from megalite.models import GPTModel
from megalite.models.transformer import TransformerBlock
from tests.models.helpers import make_batch, make_config

LAYERS = 3


class _Meter:
    """Bytes autograd saves per layer (global layer number), while its hooks are the active ones."""

    def __init__(self, model: GPTModel):
        self.bytes: dict[int, int] = {}
        self.current: int | None = None
        # one storage view counted once per layer (the rotary tables are saved by every layer);
        # kept alive, so that no later tensor takes its address
        self.seen: dict[tuple, torch.Tensor] = {}
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for layer in model.decoder.layers:
            layer.register_forward_pre_hook(self._enter)
            layer.register_forward_hook(self._leave)

    def _enter(self, layer, _args):
        self.current = layer.layer_number

    def _leave(self, *_):
        self.current = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage().data_ptr()
        ident = (self.current, storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        ident += (t._version,)
        if self.current is not None and storage not in self.param_storages:
            if ident not in self.seen:
                self.seen[ident] = t
                self.bytes[self.current] = self.bytes.get(self.current, 0)
                self.bytes[self.current] += t.numel() * t.element_size()
        return t


def _forward_backward(family: str, n: int, **overrides):
    config = make_config(
        family, num_layers=LAYERS, cpu_offloading=n > 0, cpu_offloading_num_layers=n, **overrides
    )
    torch.manual_seed(0)
    model = GPTModel(config, ParallelState.single())
    meter = _Meter(model)
    norm_outputs = {}  # layer -> weakref to its first norm's output (saved by the QKV matmul)
    for layer in model.decoder.layers:
        layer.input_layernorm.register_forward_hook(
            lambda m, _a, out, k=layer.layer_number: norm_outputs.__setitem__(k, weakref.ref(out))
        )
    tokens, labels, weights = make_batch(config)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        loss = model(tokens, None, labels)
    alive = {k: ref() is not None for k, ref in norm_outputs.items()}
    (loss * weights).sum().backward()
    grads = [p.grad for p in model.parameters()]
    return model, meter, alive, loss.detach(), grads


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("n", [1, 2])
def test_only_the_first_n_layers_activations_move(family, n):
    _, plain, plain_alive, loss, grads = _forward_backward(family, 0)
    model, meter, alive, o_loss, o_grads = _forward_backward(family, n)
    offload = model.decoder.activation_offload
    assert set(plain.bytes) == set(range(LAYERS)) and all(plain.bytes.values())
    assert all(plain_alive.values())
    for layer in range(LAYERS):
        if layer < n:
            assert offload.moved_bytes[layer] == plain.bytes[layer], layer
            assert layer not in meter.bytes, layer  # autograd holds none of its originals
            assert not alive[layer], layer  # the original is freed after forward
        else:
            assert layer not in offload.moved_bytes, layer
            assert meter.bytes[layer] == plain.bytes[layer], layer
            assert alive[layer], layer
    assert torch.equal(o_loss, loss)
    assert all(torch.equal(a, b) for a, b in zip(o_grads, grads))


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_full_recompute_moves_the_checkpointed_inputs(method):
    inputs = {}

    def record(layer, args):
        size = sum(a.numel() * a.element_size() for a in args if torch.is_tensor(a))
        inputs.setdefault(layer.layer_number, size)  # the forward call, not the recomputation

    per = 1 if method == "uniform" else 2  # either way layers 0 and 1 are recomputed
    recompute = dict(
        recompute_granularity="full", recompute_method=method, recompute_num_layers=per
    )
    config = make_config("llama", num_layers=LAYERS, **recompute)
    torch.manual_seed(0)
    plain = GPTModel(config, ParallelState.single())
    config = make_config(
        "llama", num_layers=LAYERS, cpu_offloading=True, cpu_offloading_num_layers=2, **recompute
    )
    torch.manual_seed(0)
    model = GPTModel(config, ParallelState.single())
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(record)
    tokens, labels, weights = make_batch(config)
    results = []
    for m in (plain, model):
        loss = m(tokens, None, labels)
        (loss * weights).sum().backward()
        results.append((loss.detach(), [p.grad for p in m.parameters()]))
    moved = model.decoder.activation_offload.moved_bytes
    assert moved == {0: inputs[0], 1: inputs[1]}, (moved, inputs)
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_parameters_and_their_views_stay():
    torch.manual_seed(0)
    linear = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    offload = ActivationOffload()
    with offload.region(key=0, params=linear.parameters()):
        y = torch.tanh(linear(x))  # addmm saves x and weight.t(); tanh saves its output
    assert offload.moved_tensors == {0: 2}
    assert offload.moved_bytes == {0: (3 * 8 + 3 * 4) * 4}
    y.sum().backward()
    ref = x.detach().clone().requires_grad_()
    torch.tanh(linear(ref)).sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_bad_num_layers_are_refused():
    with pytest.raises(ValueError, match="cpu_offloading_num_layers must be an integer >= 0"):
        make_config("gpt2", cpu_offloading=True, cpu_offloading_num_layers=-1).validate()
    with pytest.raises(ValueError, match="exceeds the 2 layers of a model chunk"):
        make_config(
            "gpt2", num_layers=4, cpu_offloading=True, cpu_offloading_num_layers=3
        ).validate(pp_size=2)
    config = make_config("gpt2", num_layers=4, cpu_offloading=True, cpu_offloading_num_layers=2)
    with pytest.raises(ValueError, match=r"exceeds the 1 layers \[2, 3\) of this model chunk"):
        TransformerBlock(
            config, ParallelState.single(), layer_range=(2, 3), post_process=False, rng_tracker=None
        )
