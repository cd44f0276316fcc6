"""Dropout masks on a TP2 x DP2 mesh: where they must differ and where they must agree.

- Attention dropout acts on this rank's heads: masks differ across TP ranks (else the heads of rank
  0 and rank 1 would share one pattern) and agree across DP ranks (replicas of one model).
- Hidden and embedding dropout act on the full hidden state without sequence parallel: masks agree
  across TP ranks (the activations are replicated; differing masks would make the replicas diverge)
  and across DP ranks.
- Under sequence parallel each TP rank holds a different shard: those masks differ across TP ranks
  and agree across DP ranks.
Masks are read with forward hooks on the Dropout modules (exact comparisons: they are booleans).
"""

from __future__ import annotations

import torch

from megalite.core.tensor_parallel.random import RNGStatesTracker, model_parallel_seed
from megalite.models import GPTModel
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config


def _masks_case(sp: bool) -> dict[str, list[torch.Tensor]]:
    ps = mesh(2)  # world 4: ranks (tp, dp) = 0:(0,0) 1:(1,0) 2:(0,1) 3:(1,1)
    tracker = model_parallel_seed(1234, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank)
    config = make_config(
        "gpt2",
        hidden_dropout=0.5,
        attention_dropout=0.5,
        attention_backend="unfused",
        use_fused_kernels=False,
        sequence_parallel=sp,
    )
    model = GPTModel(config, ps, rng_tracker=tracker).train()
    masks: dict[str, list[torch.Tensor]] = {"attention": [], "hidden": [], "embedding": []}

    def hook(kind):
        # dropped = zeroed where the input was not zero (attention: the causal zeros excluded)
        return lambda mod, inputs, output: masks[kind].append((output == 0) & (inputs[0] != 0))

    model.embedding.embedding_dropout.register_forward_hook(hook("embedding"))
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.attention_dropout.register_forward_hook(
            hook("attention")
        )
        layer.hidden_dropout.register_forward_hook(hook("hidden"))
    tokens, labels, _ = make_batch(config)
    model(tokens, None, labels).sum().backward()
    return masks


def _causal_count(mask: torch.Tensor) -> int:
    """Entries on or below the diagonal of [b, n, s, s] attention probabilities."""
    s = mask.shape[-1]
    return mask[..., 0, 0].numel() * s * (s + 1) // 2


def _assert_masks(per_rank, kind: str, *, tp_agree: bool) -> None:
    m = [r[kind] for r in per_rank]
    assert len(m[0]) > 0 and all(len(x) == len(m[0]) for x in m)
    for i in range(len(m[0])):
        eligible = _causal_count(m[0][i]) if kind == "attention" else m[0][i].numel()
        rate = m[0][i].sum().item() / eligible
        assert 0.3 < rate < 0.7, f"{kind}: dropout p=0.5 not applied (rate {rate:.2f})"
        for a, b in ((0, 2), (1, 3)):  # DP peers hold the same TP rank
            assert torch.equal(m[a][i], m[b][i]), f"{kind} mask {i}: DP ranks {a},{b} differ"
        same_tp = m[0][i].shape == m[1][i].shape and torch.equal(m[0][i], m[1][i])
        assert same_tp == tp_agree, f"{kind} mask {i}: TP ranks agree={same_tp}, want {tp_agree}"


def test_dropout_masks_across_tp_and_dp():
    per_rank = run_distributed(_masks_case, 4, False)
    _assert_masks(per_rank, "attention", tp_agree=False)
    _assert_masks(per_rank, "hidden", tp_agree=True)
    _assert_masks(per_rank, "embedding", tp_agree=True)


def test_dropout_masks_under_sequence_parallel():
    per_rank = run_distributed(_masks_case, 4, True)
    _assert_masks(per_rank, "attention", tp_agree=False)
    _assert_masks(per_rank, "hidden", tp_agree=False)
    _assert_masks(per_rank, "embedding", tp_agree=False)


def test_tracker_fork_property():
    """The tracker's stream is independent of the default generator and advances across forks."""
    with torch.random.fork_rng():
        tracker = RNGStatesTracker()
        tracker.add("tensor-parallel", 7)
        torch.manual_seed(0)
        with tracker.fork():
            a = torch.rand(4)
        default_after = torch.rand(4)
        torch.manual_seed(0)
        assert torch.equal(default_after, torch.rand(4))  # the fork consumed nothing by default
        with tracker.fork():
            b = torch.rand(4)
        assert not torch.equal(a, b)  # the tracker's state advanced
