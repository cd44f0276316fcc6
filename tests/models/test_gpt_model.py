"""GPTModel in one process: vocabulary-padding independence, Megatron's initialisation, pipeline
stages that compose to the whole model, tied embeddings, return shapes and misuse errors."""

from __future__ import annotations

import math

import pytest
import torch

from megalite.core.parallel_state import ParallelState
from megalite.models import GPTModel
from tests.models.helpers import VOCAB, make_batch, make_config, rel_err

SINGLE = ParallelState.single()


def _loss_and_grads(model, config):
    tokens, labels, weights = make_batch(config)
    loss = model(tokens, None, labels)
    (loss * weights).sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_vocab_padding_does_not_change_the_function(family):
    """make_vocab_size_divisible_by 1 (no padding) vs 128 (28 padding rows): identical loss and
    grads on the real rows; the padding rows get no grad (they take no probability mass). Exact up
    to 1e-6 relative (the output GEMM has a different number of columns, which may change BLAS
    blocking but not the dot products' order in practice)."""
    c1 = make_config(family, make_vocab_size_divisible_by=1)
    c128 = make_config(family, make_vocab_size_divisible_by=128)
    m1, m128 = GPTModel(c1, SINGLE), GPTModel(c128, SINGLE)
    loss1, g1 = _loss_and_grads(m1, c1)
    loss128, g128 = _loss_and_grads(m128, c128)
    assert rel_err(loss128, loss1) <= 1e-6
    for name, grad in g1.items():
        assert rel_err(g128[name][: grad.shape[0]], grad) <= 1e-6, name
        if grad.shape[0] == VOCAB and g128[name].shape[0] == 128:
            assert g128[name][VOCAB:].abs().max() == 0, f"{name}: padding rows got a grad"
            assert m128.state_dict()[name][VOCAB:].abs().max() == 0, f"{name}: padding initialised"


def test_megatron_initialisation():
    config = make_config("gpt2", num_layers=4, hidden_size=64, vocab_size=1000, seq_length=64)
    params = dict(GPTModel(config, SINGLE).named_parameters())
    std, scaled = 0.02, 0.02 / math.sqrt(2 * 4)
    for name, p in params.items():
        w = p.detach()
        if name.endswith("layernorm.weight"):
            assert torch.equal(w, torch.ones_like(w)), name
        elif name.endswith("bias"):
            assert torch.equal(w, torch.zeros_like(w)), name
        else:
            if "word_embeddings" in name:
                w = w[:1000]
            want = scaled if ("linear_proj" in name or "linear_fc2" in name) else std
            # >= 4096 samples: the sample std is within ~3% of the true one (5 sigma < 6%)
            assert abs(w.std().item() / want - 1) < 0.06, (name, w.std().item(), want)
            assert abs(w.mean().item()) < 5 * want / math.sqrt(w.numel()), name
    # keyed by name: two layers' weights differ, and another seed changes every weight
    q0 = params["decoder.layers.0.self_attention.linear_qkv.weight"]
    q1 = params["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert not torch.equal(q0, q1)
    other = dict(GPTModel(make_config("gpt2", seed=7), SINGLE).named_parameters())
    small = dict(GPTModel(make_config("gpt2"), SINGLE).named_parameters())
    assert not torch.equal(
        other["embedding.word_embeddings.weight"], small["embedding.word_embeddings.weight"]
    )


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pipeline_stages_compose_to_the_whole_model(family):
    """Stage 0 (embedding + layer 0) feeding stage 1 (layer 1 + output) computes the full model's
    loss; each stage's weights equal the full model's (init keyed by global layer number); the
    tied output weight on the last stage is a copy of the word embedding, and the sum of the two
    copies' grads is the full model's embedding grad (what the embedding-group all-reduce does)."""
    config = make_config(family)
    full = GPTModel(config, SINGLE)
    first = GPTModel(config, SINGLE, post_process=False, layer_range=(0, 1))
    last = GPTModel(config, SINGLE, pre_process=False, layer_range=(1, 2))
    full_params = dict(full.named_parameters())
    for name, p in first.named_parameters():
        assert torch.equal(p, full_params[name]), name
    for name, p in last.named_parameters():
        global_name = name.replace("decoder.layers.0.", "decoder.layers.1.")
        if name == "output_layer.weight" and full.tied:
            global_name = "embedding.word_embeddings.weight"
        assert torch.equal(p, full_params[global_name]), name

    tokens, labels, weights = make_batch(config)
    hidden = first(tokens, None)  # [s, b, h]
    assert hidden.shape == (config.seq_length, tokens.shape[0], config.hidden_size)
    received = hidden.detach().requires_grad_()
    last.set_input_tensor(received)
    loss = last(None, None, labels)
    (loss * weights).sum().backward()
    hidden.backward(received.grad)
    full_loss, full_grads = _loss_and_grads(full, config)
    assert rel_err(loss.detach(), full_loss) <= 1e-6

    emb = first.embedding.word_embeddings.weight
    if full.tied:
        assert first.shared_embedding_or_output_weight() is emb
        assert last.shared_embedding_or_output_weight() is last.output_layer.weight
        summed = emb.grad + last.output_layer.weight.grad
        assert rel_err(summed, full_grads["embedding.word_embeddings.weight"]) <= 1e-6
    else:
        assert first.shared_embedding_or_output_weight() is None
        assert rel_err(emb.grad, full_grads["embedding.word_embeddings.weight"]) <= 1e-6
    layer1 = last.decoder.layers[0].mlp.linear_fc1.weight.grad
    assert rel_err(layer1, full_grads["decoder.layers.1.mlp.linear_fc1.weight"]) <= 1e-6
    middle = GPTModel(config, SINGLE, pre_process=False, post_process=False, layer_range=(1, 2))
    assert middle.shared_embedding_or_output_weight() is None


def test_outputs_and_explicit_positions():
    config = make_config("gpt2", make_vocab_size_divisible_by=64)
    model = GPTModel(config, SINGLE)
    tokens, labels, _ = make_batch(config)
    logits = model(tokens, None)
    assert logits.shape == (2, config.seq_length, 128)
    loss = model(tokens, None, labels)
    assert loss.shape == (2, config.seq_length) and loss.dtype == torch.float32
    ref = torch.nn.functional.cross_entropy(
        logits[..., :VOCAB].reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
    )
    assert rel_err(loss.reshape(-1), ref) <= 1e-6
    positions = torch.arange(config.seq_length).expand(2, -1)
    assert torch.equal(model(tokens, positions, labels), loss)
    shifted = model(tokens, positions.flip(-1), labels)  # positions matter
    assert not torch.allclose(shifted, loss)


def test_misuse_errors():
    config = make_config("gpt2", sequence_parallel=True, hidden_dropout=0.1)
    model = GPTModel(config, SINGLE)  # no tracker: fine until dropout runs on SP shards
    tokens, labels, _ = make_batch(config)
    with pytest.raises(RuntimeError, match="RNG tracker"):
        model.train()(tokens, None, labels)
    model.eval()(tokens, None, labels)  # eval: no dropout, no tracker needed
    stage = GPTModel(make_config("gpt2"), SINGLE, pre_process=False, layer_range=(1, 2))
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        stage(None, None)
    with pytest.raises(ValueError, match="layer_range"):
        GPTModel(make_config("gpt2"), SINGLE, layer_range=(1, 3))


# the bf16 cases also run with the fused kernels forced on (scripts/test.sh)
@pytest.mark.parametrize(
    "dtype,tol",
    [pytest.param(torch.bfloat16, 5e-3, marks=pytest.mark.kernels_on), (torch.float16, 1e-3)],
)
@pytest.mark.parametrize("backend", ["sdpa", "unfused"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_low_precision_params_compute_the_fp32_function(family, backend, dtype, tol):
    """bf16 / fp16 parameters and activations (the loss in fp32): the per-token loss stays within
    the format's rounding of the fp32 model's (bf16 keeps 8 mantissa bits, ~4e-3 per op, fp16 11;
    the errors average out over the loss: observed ~5e-4 and ~8e-5), and every grad is in dtype."""
    c32 = make_config(family, attention_backend=backend, init_method_std=0.05)
    c16 = make_config(family, attention_backend=backend, init_method_std=0.05, params_dtype=dtype)
    tokens, labels, _ = make_batch(c32)
    ref = GPTModel(c32, SINGLE)(tokens, None, labels)
    model = GPTModel(c16, SINGLE)
    loss = model(tokens, None, labels)
    assert loss.dtype == torch.float32 and rel_err(loss, ref) <= tol
    loss.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in model.parameters())
