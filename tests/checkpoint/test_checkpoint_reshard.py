"""Resharding: a checkpoint saved under one (TP, PP, DP) layout continues under another.

1. The logical form's TP rules against the documented slicing
   (``tests.models.helpers.shard_of_full``, written from DESIGN §5, not from the layers):
   splitting a full tensor gives the documented shard, and merging the documented shards gives
   the full tensor back, bitwise, for both families at TP 2 and 4 (vocabulary padding, per-group
   QKV, SwiGLU's strided fc1, row-parallel inputs). The rules also agree with the layers' own
   ``partition_dim`` / ``partition_stride`` attributes at TP 2.
2. What a save writes for the plain optimizer (views of its state; fp32 masters shared with the
   model) equals the optimizer's own ``full_state_dict``, bitwise.
3. Training: a 4-layer model trained at TP2 x PP2 x DP2 saves at iteration 2 and goes on to 4 (the
   unresharded continuation). From that checkpoint, TP1 x PP4 x DP2 (8 ranks) and TP1 x PP1 x DP1
   (one process) run iterations 3-4: losses within 1e-5 relative of the unresharded ones (fp32;
   only the order of sums differs between layouts, ~1e-7). GPT-2 with the plain optimizer, Llama
   with ZeRO-1 (its per-DP-rank files are turned into the full form and re-cut for DP 2 and the
   plain optimizer of one process). The control: continuing without the optimizer state
   (``--no-load-optim``) moves the losses by more than 10x the tolerance.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from megalite.checkpoint.saving import optimizer_full_state
from megalite.checkpoint.tp_shards import merge_tp, split_tp, tp_split
from megalite.core.parallel_state import ParallelState
from megalite.models import GPTModel
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_config, shard_of_full
from tests.training.common import FAMILIES, assert_close_rel, config, trainer_and_data

REL = 1e-5
SINGLE = ParallelState.single()
FOUR_LAYERS = ["--num-layers", "4", "--train-iters", "4"]


def test_tp_rules_match_the_documented_sharding():
    for family in ("gpt2", "llama"):
        cfg = make_config(family)
        full_model = GPTModel(cfg, ParallelState.single())
        for name, full in full_model.state_dict().items():
            split = tp_split(name, swiglu=cfg.swiglu)
            logical = full[: cfg.vocab_size] if split.vocab else full
            for tp in (2, 4):
                shards = [shard_of_full(name, full, cfg, tp_size=tp, tp_rank=r) for r in range(tp)]
                padded = cfg.padded_vocab_size(tp)
                for r in range(tp):
                    mine = split_tp(logical, split, tp_size=tp, tp_rank=r, padded_vocab_size=padded)
                    assert torch.equal(mine, shards[r]), (family, name, tp, r)
                merged = merge_tp(shards, split, vocab_size=cfg.vocab_size)
                assert torch.equal(merged, logical), (family, name, tp)


def test_saved_optimizer_views_equal_the_optimizers_full_state():
    """What a save writes for the plain optimizer (views, fp32 masters shared with the model)
    equals its own ``full_state_dict`` (copies), fp32 and bf16, after two steps."""
    for precision in ([], ["--bf16"]):
        trainer, data = trainer_and_data(config(*precision, "--train-iters", "2"), SINGLE)
        trainer.train(make_forward_step(torch.device("cpu")), data)
        views = optimizer_full_state(trainer.optimizer)
        copies = trainer.optimizer.full_state_dict()
        assert views["step"] == copies["step"] == 2 and views["scaler"] == copies["scaler"]
        assert views["params"].keys() == copies["params"].keys()
        for name, entry in copies["params"].items():
            for key, value in entry.items():
                assert torch.equal(views["params"][name][key], value), (precision, name, key)


def _attributes_case() -> list[str]:
    """At TP 2 (on 2 ranks), every parameter's attributes against ``tp_split``."""
    ps = mesh(2, 1)
    bad = []
    try:
        for family in ("gpt2", "llama"):
            cfg = make_config(family)
            for name, p in GPTModel(cfg, ps).named_parameters():
                split = tp_split(name, swiglu=cfg.swiglu)
                dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
                stride = getattr(p, "partition_stride", 1) if dim is not None else 1
                if (dim, stride) != (split.dim, split.stride):
                    bad.append(f"{family} {name}: layer {(dim, stride)}, rule {split}")
    finally:
        ps.destroy()
    return bad


def test_tp_rules_match_the_layers_attributes():
    assert run_distributed(_attributes_case, 2) == [[], []]


def _train_case(root: str, cases: list[tuple[str, list[str]]]) -> dict:
    """Save at TP2 x PP2 x DP2 (iterations 1-4, saving at 2), continue at TP1 x PP4 x DP2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    out = {}
    for name, extra in cases:
        save = os.path.join(root, name)
        flags = [*extra, *FOUR_LAYERS, "--save", save, "--save-interval", "2"]
        tp2pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
        straight = pretrain(config(*flags, *tp2pp2, world_size=world, rank=rank), env=env)
        pp4 = [
            *extra,
            *FOUR_LAYERS,
            "--pipeline-model-parallel-size",
            "4",
            "--load",
            save,
            "--ckpt-step",
            "2",
        ]
        resharded = pretrain(config(*pp4, world_size=world, rank=rank), env=env)
        out[name] = (straight.losses, resharded.losses, resharded.iteration)
    return out


def test_save_tp2_pp2_dp2_continue_at_tp1_pp4_dp2_and_tp1_pp1_dp1():
    cases = [
        ("gpt2_plain", FAMILIES["gpt2"]),
        ("llama_zero1", [*FAMILIES["llama"], "--use-distributed-optimizer"]),
    ]
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_train_case, 8, root, cases, timeout=600)
        for name, extra in cases:
            # the last stage's ranks of both layouts hold the losses; take one of each
            straight, _, _ = results[7][name]
            _, resharded, iteration = results[7][name]
            unresharded = straight[2:]
            assert len(straight) == 4 and iteration == 4
            assert_close_rel(resharded, unresharded, REL, f"{name} at TP1 x PP4 x DP2")
            plain = [f for f in extra if f != "--use-distributed-optimizer"]  # ZeRO -> plain
            single_flags = [
                *plain,
                *FOUR_LAYERS,
                "--load",
                os.path.join(root, name),
                "--ckpt-step",
                "2",
            ]
            single = pretrain(config(*single_flags), env={}).losses
            assert_close_rel(single, unresharded, REL, f"{name} at TP1 x PP1 x DP1")
        fresh = pretrain(config(*single_flags, "--no-load-optim"), env={}).losses
        gap = max(abs(a - b) / abs(b) for a, b in zip(fresh, unresharded))
        assert gap > 10 * REL, f"the optimizer state makes no difference ({gap}): vacuous test"
