"""The router alone: the expert-bias update (aux-loss-free balancing) against a hand-computed one,
the aux loss against its formula, and the one-line errors of impossible MoE options."""

from __future__ import annotations

import pytest
import torch

from megalite.core.moe import TopKRouter, set_aux_loss_scale, update_expert_bias
from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.init import init_normal
from tests.core.moe.cases import build_layer, moe_config


def _router(**overrides) -> TopKRouter:
    return TopKRouter(
        moe_config(**overrides),
        seq_group=None,
        cp_size=1,
        init_method=init_normal(0.3, seed=3, key="router"),
    )


def test_expert_bias_update_equals_hand_computed():
    router = _router(
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_bias_update_rate=0.05,
        aux_loss_coeff=0.0,
    )
    bias0 = torch.tensor([0.3, -0.1, 0.0, 0.2, -0.3, 0.1, 0.0, 0.05])
    router.expert_bias.copy_(bias0)
    xs = [torch.randn(12, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for x in xs:  # two micro-batches of one step
        router(x, 2)
    # by hand: top-2 of sigmoid(x W^T) + bias per token, counted over both micro-batches
    counts = torch.zeros(8)
    for x in xs:
        chosen = torch.topk(torch.sigmoid(x @ router.weight.detach().t()) + bias0, 2).indices
        counts += torch.bincount(chosen.reshape(-1), minlength=8).float()
    assert counts.sum() == 48 and counts.max() > counts.min()
    update_expert_bias(router, group=None)
    expected = bias0 + 0.05 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(router.expert_bias, expected, rtol=0, atol=1e-7)
    assert router.local_tokens_per_expert.sum() == 0  # the counts restart each step


def test_aux_and_z_loss_equal_their_formulas():
    router = _router(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(0))
    router(x, 2)
    logits = x @ router.weight.detach().t()
    probs = torch.softmax(logits, -1)
    chosen = torch.topk(logits, 2).indices
    f = torch.bincount(chosen.reshape(-1), minlength=8).float() / (2 * 12)
    aux = 0.1 * 8 * (f * probs.mean(0)).sum()
    z = 0.01 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(router.stats[0], aux, rtol=1e-6, atol=0)
    torch.testing.assert_close(router.stats[1], z, rtol=1e-6, atol=0)


def test_global_aux_loss_uses_the_running_mean_of_the_steps_counts():
    """Megatron's ``global_aux_loss``: micro-step j's f_i is the mean over micro-steps 1..j of the
    tokens per expert; P_i its own tokens' mean score; the grad reaches the router weight at the
    aux-loss scale. Restarted by ``set_aux_loss_scale`` (a new step)."""
    router = _router(
        router_load_balancing_type="global_aux_loss", aux_loss_coeff=0.1, z_loss_coeff=0.0
    )
    xs = [torch.randn(12, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for _ in range(2):  # two steps: the second starts from zero counts again
        set_aux_loss_scale(router, 0.5)
        router.stats.zero_()
        router.weight.grad = None
        counts, expected, grad = torch.zeros(8), [], torch.zeros(8, 16)
        for j, x in enumerate(xs):
            probs, _ = router(x, 2)
            probs.sum().backward()  # the routing probs' own grad, plus the aux loss's
            w = router.weight.detach().clone().requires_grad_()
            logits = x @ w.t()
            counts += torch.bincount(torch.topk(logits, 2).indices.reshape(-1), minlength=8)
            f = counts / (j + 1) / (2 * 12)
            aux = 0.1 * 8 * (f * torch.softmax(logits, -1).mean(0)).sum()
            top, idx = torch.topk(logits, 2)
            (0.5 * aux + torch.softmax(top, -1).sum()).backward()
            expected.append(aux.detach())
            grad += w.grad
        torch.testing.assert_close(router.stats[0], sum(expected), rtol=1e-6, atol=0)
        torch.testing.assert_close(router.weight.grad, grad, rtol=1e-5, atol=1e-7)
        assert router.global_micro_steps == 3


@pytest.mark.parametrize(
    "overrides, ep, message",
    [
        (dict(), 3, "num_experts 8 is not divisible by expert_model_parallel_size 3"),
        (dict(ffn_hidden_size=6), 1, "moe_ffn_hidden_size 6 is not divisible by expert_tensor"),
        (dict(router_topk=9), 1, "moe_router_topk 9 must be in [1, num_experts 8]"),
        (dict(router_enable_expert_bias=True), 1, "needs moe_router_score_function sigmoid"),
        (dict(pad_expert_input_to_capacity=True), 1, "needs moe_expert_capacity_factor"),
        (
            dict(
                expert_capacity_factor=1.0,
                pad_expert_input_to_capacity=True,
                token_dispatcher_type="allgather",
            ),
            1,
            "needs moe_token_dispatcher_type alltoall",
        ),
        (dict(router_load_balancing_type="none"), 1, "with load balancing type none"),
    ],
)
def test_impossible_moe_options_are_refused_in_one_line(overrides, ep, message):
    config = moe_config(**overrides)
    with pytest.raises(ValueError) as err:
        config.validate(ep_size=ep, etp_size=4 if "ffn_hidden_size" in overrides else 1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_single_process_layer_runs_every_config_in_eval():
    layer = build_layer(moe_config(token_dispatcher_type="allgather"), ParallelState.single())
    layer.eval()
    with torch.no_grad():
        out = layer(torch.randn(6, 2, 16))
    assert out.shape == (6, 2, 16) and layer.router.stats.sum() == 0  # eval counts nothing
