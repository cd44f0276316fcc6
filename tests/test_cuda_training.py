"""One-GPU training with nccl, in process: each family at each ZeRO rung, the offloaded optimizer,
MoE, the unfused kernels and a sliding window (flex attention), each run compared with the same
model trained on CPU in fp32.

Every case runs ``pretrain()`` (the job pretrain_gpt.py runs) on a world of one over nccl, in bf16
(megalite's mixed precision: fp32 masters), on mock data, and its per-iteration losses must match
the CPU fp32 run of the same flags (``build_run`` on a single-process mesh) within bf16 rounding:
``REL`` relative per iteration, while the oracle's loss itself falls by far more than that over the
run, so a step that updated nothing, or the wrong thing, is caught. ``scripts/gpu_check.sh`` runs
this file (``quick``); skipped without CUDA. ``DEVICE`` names the device the runs train on (a
check of this file on CPU sets it to "cpu": gloo instead of nccl, the same comparison).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from megalite.core.parallel_state import ParallelState
from megalite.training.arguments import parse_args
from megalite.training.config import with_tokenizer
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import build_run, pretrain

DEVICE = "cuda"
ITERS = 10
# bf16 params and activations vs fp32: over ten updates at lr 3e-3 the loss stays within REL of
# fp32's (measured on CPU: 8e-4 at most, all families) while it falls by more than FALLS (20%)
REL = 5e-3
FALLS = 0.1

BASE = (
    "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8 "
    f"--train-iters {ITERS} --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 1023 --hidden-dropout 0 --attention-dropout 0 "
    "--log-interval 1000 --eval-iters 0 --seed 1234"
).split()
LLAMA = (
    "--position-embedding-type rope --normalization RMSNorm --swiglu --ffn-hidden-size 256 "
    "--disable-bias-linear --group-query-attention --num-query-groups 2"
).split()
FAMILIES = {
    "gpt2": [],
    "llama": LLAMA,
    "moe": [*LLAMA, *"--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2".split()],
    # a sliding window: on CUDA through compiled flex attention (64-token blocks grouped by 128)
    "llama-window": [*LLAMA, "--window-size", "100,0"],
}
RUNGS = {
    "no_shard": [],
    "zero1": ["--use-distributed-optimizer"],
    "zero2": "--zero-stage 2 --overlap-grad-reduce".split(),
    "zero3": "--zero-stage 3 --overlap-grad-reduce".split(),
}
# name -> (family, flags besides the family's)
RUNS = {
    f"{family}-{rung}": (family, flags)
    for family in ("gpt2", "llama")
    for rung, flags in RUNGS.items()
}
RUNS["llama-zero1-offload"] = (
    "llama",
    "--use-distributed-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 0.5".split(),
)
RUNS["llama-zero3-infinity"] = (
    "llama",
    "--zero-stage 3 --optimizer-cpu-offload --param-cpu-offload".split(),
)
RUNS["moe-alltoall"] = ("moe", "--moe-token-dispatcher-type alltoall".split())
RUNS["moe-allgather-zero1"] = (
    "moe",
    "--moe-token-dispatcher-type allgather --use-distributed-optimizer".split(),
)
RUNS["gpt2-unfused"] = ("gpt2", ["--no-fused-kernels"])
RUNS["llama-window"] = ("llama-window", [])

needs_device = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"
)


def _config(*flags: str):
    return with_tokenizer(parse_args([*BASE, *flags], env={}))


@functools.cache
def cpu_fp32_losses(family: str) -> tuple[float, ...]:
    """The oracle: the family trained on CPU in fp32 on a single-process mesh."""
    cpu = torch.device("cpu")
    cfg = _config(*FAMILIES[family], "--device", "cpu")
    run = build_run(cfg, ParallelState.single(cpu), cpu, resume=False)
    return tuple(run.trainer.train(make_forward_step(cpu), run.train_iter).losses)


def device_losses(family: str, flags: list[str]) -> list[float]:
    """The run as pretrain_gpt.py would make it on one GPU: bf16, a world of one over nccl (the
    device's backend)."""
    cfg = _config(*FAMILIES[family], *flags, "--bf16", "--device", DEVICE)
    result = pretrain(cfg, env={})
    assert result.iteration == ITERS
    return result.losses


def test_every_run_is_a_valid_run_of_what_it_names():
    """Checked without a GPU too: the flags stay in step with the package (on CPU here)."""
    strategies = {}
    for name, (family, flags) in RUNS.items():
        cfg = _config(*FAMILIES[family], *flags, "--bf16", "--device", "cpu")
        assert cfg.training.train_iters == ITERS and cfg.model.params_dtype == torch.bfloat16
        assert (cfg.model.num_experts is not None) == (family == "moe"), name
        strategies[name] = cfg.parallel.sharding_strategy()
    rungs = {"no_shard": "no_shard", "zero1": "optim", "zero2": "optim_grads"}
    rungs["zero3"] = "optim_grads_params"
    for family in ("gpt2", "llama"):
        assert {strategies[f"{family}-{r}"] for r in rungs} == set(rungs.values())
        assert all(strategies[f"{family}-{r}"] == s for r, s in rungs.items())


@needs_device
@pytest.mark.parametrize("name", sorted(RUNS))
def test_one_device_run_matches_cpu_fp32(name: str):
    family, flags = RUNS[name]
    expected = cpu_fp32_losses(family)
    assert expected[-1] < (1 - FALLS) * expected[0], expected  # the oracle learns
    losses = device_losses(family, flags)
    assert len(losses) == ITERS and all(math.isfinite(x) for x in losses), losses
    for i, (a, e) in enumerate(zip(losses, expected), 1):
        assert abs(a - e) <= REL * abs(e), f"{name}: iteration {i}: {a} vs CPU fp32 {e}"
