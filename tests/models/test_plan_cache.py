"""One ``PlanCache`` per chunk of layers: the windowed layers of a forward share their block
plans (built once per mask, not once per layer), with the logits and grads of plans built per
layer; document plans are rebuilt for another mask tensor, or the same one changed in place."""

from __future__ import annotations

import pytest
import torch

from megalite.core.parallel_state import ParallelState
from megalite.data.gpt_dataset import document_attention_mask
from megalite.models.gpt import GPTModel
from megalite.models.plan_cache import PlanCache
from tests.models.helpers import make_batch, make_config

LAYERS = 3


def _docs(b: int, s: int, shift: int) -> torch.Tensor:
    """Document ids # [b, s]: sample i starts a second document at ``shift + 5 i``."""
    doc = torch.zeros(b, s, dtype=torch.long)
    for i in range(b):
        doc[i, shift + 5 * i :] = 1
    return doc


# every layer windowed; or layers 0 and 2 windowed and all BigBird: two masks among the layers
MASKS = {
    "window": {},
    "window-bigbird": dict(
        window_attn_skip_freq=2, sparse_attention="bigbird", sparse_block_size=8
    ),
}


def _model(family: str, mask: str = "window") -> GPTModel:
    config = make_config(
        family,
        num_layers=LAYERS,
        seq_length=48,
        max_position_embeddings=48,
        window_size=(9, 0),
        attention_block_size=8,
        **MASKS[mask],
    )
    torch.manual_seed(0)
    return GPTModel(config, ParallelState.single())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_layers_share_one_plan_per_mask(family):
    model = _model(family)
    cache = model.decoder.plan_cache
    assert all(layer.self_attention.plan_cache is cache for layer in model.decoder.layers)
    tokens, _, _ = make_batch(model.config, batch=2)
    s = model.config.seq_length
    model(tokens, None)
    model(tokens, None)
    assert cache.built == 1  # no documents: one plan for every layer and every step
    mask = document_attention_mask(_docs(2, s, 3))
    model(tokens, None, attention_mask=mask)
    assert cache.built == 2  # the documents' plan, once for the three layers
    model(tokens, None, attention_mask=mask)
    assert cache.built == 2  # the same mask again
    model(tokens, None, attention_mask=document_attention_mask(_docs(2, s, 3)))
    assert cache.built == 3  # another tensor (equal values: not looked at)
    other = document_attention_mask(_docs(2, s, 4))
    model(tokens, None, attention_mask=other)
    other.copy_(document_attention_mask(_docs(2, s, 6)))  # changed in place
    model(tokens, None, attention_mask=other)
    assert cache.built == 5


def test_one_plan_per_distinct_mask_of_the_layers():
    model = _model("gpt2", "window-bigbird")
    specs = {layer.self_attention.mask_spec for layer in model.decoder.layers}
    assert len(specs) == 2
    tokens, _, _ = make_batch(model.config, batch=2)
    model(tokens, None, attention_mask=document_attention_mask(_docs(2, 48, 3)))
    assert model.decoder.plan_cache.built == 2


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_shared_plans_give_the_per_layer_results(family, mask):
    """Logits' loss and every grad equal to a model whose layers build their own plans."""

    def run(model):
        tokens, labels, _ = make_batch(model.config, batch=2)
        mask = document_attention_mask(_docs(2, model.config.seq_length, 3))
        loss = model(tokens, None, labels, attention_mask=mask).sum()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    shared_loss, shared_grads = run(_model(family, mask))
    model = _model(family, mask)
    own = [PlanCache() for _ in model.decoder.layers]  # a cache per layer, not one per chunk
    for layer, cache in zip(model.decoder.layers, own):
        layer.self_attention.plan_cache = cache
    own_loss, own_grads = run(model)
    assert all(c.built == 1 for c in own) and model.decoder.plan_cache.built == 0
    torch.testing.assert_close(own_loss, shared_loss, rtol=0, atol=0)
    for name, grad in shared_grads.items():
        torch.testing.assert_close(own_grads[name], grad, rtol=0, atol=0, msg=name)
