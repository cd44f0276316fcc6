"""Checkpoints with several model chunks per rank reshard between every pipeline layout.

One 4-rank world runs a chain of layouts on one model, each resuming from the previous one's
checkpoint and running the next iteration(s) of the same 6-iteration run:

  interleaved PP2 v2 DP2 ZeRO-1 (1-2) -> ZBV PP2 DP2 plain (3) -> 1F1B PP4 DP1 ZeRO-1 (4)
  -> DualPipeV PP2 DP2 ZeRO-1 (5) -> PP1 DP4 plain (6), and DualPipeV again from its own
  checkpoint (6: the same layout, read directly, ZeRO-1 files and RNG included).

So multi-chunk -> multi-chunk (loop to V), multi-chunk -> one chunk, one chunk -> multi-chunk,
ZeRO-1 <-> plain and an unchanged multi-chunk layout are all crossed, with the model (GPT-2, tied
embeddings: a V keeps the output layer on the embedding's rank) and the Adam state. The oracle is
the single-process run of the same flags: every iteration's loss equals it to 1e-5 relative (fp32;
only the order of sums differs). The weights of every checkpoint, read back as one CPU model by
``load_model`` (what the HF converter exports), equal the oracle's checkpoint of the same
iteration. The control: resuming the first hop without the optimizer state moves the losses of
its second iteration by more than 10x the tolerance.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megalite.inference import load_model
from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.training.common import FAMILIES, assert_close_rel, config

REL = 1e-5
RUN = [
    *"--num-layers 4 --micro-batch-size 1 --global-batch-size 8 --train-iters 6".split(),
]
ZERO1 = "--use-distributed-optimizer"
PP2, PP4 = ["--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "4"]
# (name, layout flags, load from, exit at): in chain order
CHAIN = [
    ("interleaved", [*PP2, "--num-virtual-stages-per-pipeline-rank", "2", ZERO1], None, 2),
    ("zbv", [*PP2, "--pipeline-schedule", "zbv"], "interleaved", 3),
    ("pp4", [*PP4, ZERO1], "zbv", 4),
    ("dualpipev", [*PP2, "--pipeline-schedule", "dualpipev", ZERO1], "pp4", 5),
    ("pp1", [ZERO1], "dualpipev", 6),
    ("dualpipev_again", [*PP2, "--pipeline-schedule", "dualpipev", ZERO1], "dualpipev", 6),
    ("no_optim", [*PP2, "--pipeline-schedule", "zbv", "--no-load-optim"], "interleaved", 4),
]


def _chain(root: str, family: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    out = {}
    for name, flags, load, exit_at in CHAIN:
        extra = [*FAMILIES[family], *RUN, *flags, "--save", os.path.join(root, name)]
        extra += ["--exit-interval", str(exit_at), "--save-interval", "1"]
        if load is not None:
            extra += ["--load", os.path.join(root, load)]
            if name == "dualpipev_again":
                extra += ["--ckpt-step", "5"]
        result = pretrain(config(*extra, world_size=world, rank=rank), env=env)
        out[name] = result.losses
    return out


@pytest.mark.parametrize("family", ["gpt2"])
def test_multi_chunk_checkpoints_reshard_between_layouts(family):
    with tempfile.TemporaryDirectory() as root:
        oracle_dir = os.path.join(root, "oracle")
        flags = [*FAMILIES[family], *RUN, "--save", oracle_dir, "--save-interval", "1"]
        oracle = pretrain(config(*flags), env={}).losses
        assert len(oracle) == 6 and oracle[-1] < oracle[0], "the oracle does not train"
        results = run_distributed(_chain, 4, root, family, timeout=600)
        first = {
            "interleaved": 0,
            "zbv": 2,
            "pp4": 3,
            "dualpipev": 4,
            "pp1": 5,
            "dualpipev_again": 5,
            "no_optim": 2,
        }
        for name, _, _, exit_at in CHAIN:
            reported = [r[name] for r in results if r[name]]
            assert reported, f"{name}: no rank reported losses"
            want = oracle[first[name] : exit_at]
            if name == "no_optim":
                gap = max(abs(a - b) / abs(b) for a, b in zip(reported[0], want))
                assert gap > 10 * REL, f"the optimizer state makes no difference ({gap})"
                continue
            for losses in reported:
                assert_close_rel(losses, want, REL, f"{family} {name}")
        for name, _, _, exit_at in CHAIN[:5]:
            for it in range(first[name] + 1, exit_at + 1):
                got = load_model(os.path.join(root, name), it).state_dict()
                want = load_model(oracle_dir, it).state_dict()
                for key, value in want.items():
                    torch.testing.assert_close(
                        got[key], value, rtol=REL, atol=1e-6, msg=f"{name}@{it} {key}"
                    )
