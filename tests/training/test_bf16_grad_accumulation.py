"""bf16 gradients as Megatron reduces them: with ``--bf16`` the grad buffers are fp32, so the grads
of a step with 8 micro-batches per DP rank are the fp32 sum of the micro-batches' bf16 grads, on
every data-parallel rung (DDP, ZeRO-1/2/3) at DP 2; ``--grad-reduce-in-bf16`` sums them in bf16.

Each rank returns the fp32 grads its optimizer steps its masters with (``master.grad``: the whole
parameter under DDP, this rank's pieces under ZeRO) and the step's grad norm; the oracle runs the
same bf16 model in one process, takes each micro-batch's bf16 grad (the loss divided by the 8
micro-batches, as the schedules do) and sums them in float64, divides by DP and sums the two ranks.
The fp32 buffers match it to fp32 rounding (relative 1e-5, the house's fp32 bar: 16 summands of
rounding 6e-8); bf16 buffers lose more than 1e-3 (each of the 8 + 1 adds rounds to 8 bits of
mantissa). The norm is the oracle's to 1e-5.

The run itself: ``pretrain --bf16`` logs which dtype its grads use in one start-up line, and its
``--ckpt-format torch`` distributed-optimizer files key their buffer by (bf16, fp32) as Megatron's
of the same run, (bf16, bf16) under ``--grad-reduce-in-bf16``.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint.megatron.distopt import DISTRIB_OPTIM_FILE
from megalite.checkpoint.megatron.legacy import load_megatron_file
from megalite.core.distributed import STRATEGIES
from megalite.training.arguments import parse_args
from megalite.training.components import wrap_and_build_optimizer
from megalite.training.pretrain import pretrain
from tests.core import zero_cases as zc
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import LogCapture, config

DP, MICRO = 2, 8  # DP ranks, micro-batches per DP rank
ROWS = 2  # rows per micro-batch
BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 32 --lr 1e-3 --train-iters 2 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 127"
).split()
ENV = {"WORLD_SIZE": str(DP), "RANK": "0", "LOCAL_RANK": "0"}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's DP x MICRO micro-batches, rank r's are [r * MICRO, (r + 1) * MICRO)."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, zc.VOCAB, (DP * MICRO * ROWS, zc.SEQ), generator=g)
    targets = (tokens * 3 + 1) % zc.VOCAB
    return list(zip(tokens.chunk(DP * MICRO), targets.chunk(DP * MICRO)))


def _grads_case(strategy: str, fp32_grads: bool) -> tuple[dict, float]:
    """This rank's master grads after one step, name -> [(first element, fp32 values)], and the
    step's grad norm."""
    ps = mesh()
    module = zc.tiny(torch.bfloat16)
    units = [module.emb, module.fc1, module.norm, module.fc2]
    model, opt = wrap_and_build_optimizer(
        module,
        ps,
        strategy=strategy,
        accumulate_allreduce_grads_in_fp32=fp32_grads,
        bucket_size=zc.BUCKET,
        units=units,
        unit_extras={},
        lr=0.0,
        weight_decay=0.0,
        clip_grad=0.0,
    )
    rank = dist.get_rank()
    model.zero_grad_buffer()
    opt.zero_grad()
    zc.backward_micro_batches(model, opt, _batches()[rank * MICRO : (rank + 1) * MICRO])
    model.finish_grad_sync()
    _, norm, _ = opt.step()
    names = {p: n for n, p in module.named_parameters()}
    out: dict[str, list[tuple[int, torch.Tensor]]] = {}
    if opt.is_sharded:
        for pc in opt.pieces:
            out.setdefault(names[pc.param], []).append((pc.lo, pc.master.grad.clone()))
    else:
        for p, master in zip(opt.model_params, opt.master_params):
            out[names[p]] = [(0, master.grad.reshape(-1).clone())]
    return out, float(norm)


def _oracle() -> dict[str, torch.Tensor]:
    """The micro-batches' bf16 grads summed in float64, the DP mean: name -> flat [numel]."""
    model = zc.tiny(torch.bfloat16)
    total = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}
    for tokens, targets in _batches():
        model.zero_grad()
        (zc.loss_of(model, tokens, targets) / MICRO).backward()
        for n, p in model.named_parameters():
            assert p.grad.dtype == torch.bfloat16
            total[n] += p.grad.reshape(-1).double() / DP
    return total


def _relative_error(results, oracle, *, copies: int) -> float:
    """Max over parameters of max |got - oracle| / max |oracle|; every element held by
    ``copies`` ranks (DP under DDP, its one owner under ZeRO)."""
    worst = 0.0
    for n, want in oracle.items():
        seen = torch.zeros(want.numel(), dtype=torch.int64)
        err = 0.0
        for rank_grads in results:
            for lo, got in rank_grads.get(n, []):
                assert got.dtype == torch.float32
                seen[lo : lo + got.numel()] += 1
                err = max(err, (got.double() - want[lo : lo + got.numel()]).abs().max().item())
        assert torch.all(seen == copies), n
        worst = max(worst, err / want.abs().max().item())
    return worst


def _saved_buffer_key(save: str) -> tuple:
    path = os.path.join(save, "iter_0000001", "mp_rank_00", DISTRIB_OPTIM_FILE)
    keys = [k for k in load_megatron_file(path)[0]]
    assert len(keys) == 1
    return keys[0]


@pytest.mark.parametrize(
    "flags,line,key",
    [
        ((), "bf16 params: gradients accumulated and reduced over DP in fp32", torch.float32),
        (
            ("--grad-reduce-in-bf16",),
            "bf16 params: gradients accumulated and reduced over DP in bf16",
            torch.bfloat16,
        ),
    ],
)
def test_the_run_says_which_and_its_megatron_files_record_it(flags, line, key):
    with tempfile.TemporaryDirectory() as save, LogCapture() as logs:
        extra = "--train-iters 1 --use-distributed-optimizer --ckpt-format torch".split()
        pretrain(config("--bf16", *flags, *extra, "--save", save, "--save-interval", "1"))
        assert _saved_buffer_key(save) == (torch.bfloat16, key)
    assert sum(x.startswith(line) for x in logs.lines) == 1, logs.lines


def _fp32_grads(*flags: str) -> bool:
    cfg = parse_args([*BASE, "--bf16", *flags], env=ENV)
    return cfg.parallel.accumulate_allreduce_grads_in_fp32


def test_bf16_flags_choose_the_grad_dtype_as_megatron():
    assert _fp32_grads() is True  # Megatron's rule: fp32 accumulation and reduction
    assert _fp32_grads("--grad-reduce-in-bf16") is False
    assert _fp32_grads("--accumulate-allreduce-grads-in-fp32") is True
    fp16 = parse_args([*BASE, "--fp16"], env=ENV)
    assert fp16.parallel.accumulate_allreduce_grads_in_fp32 is False  # as Megatron's fp16


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_grads_of_8_micro_batches_equal_the_fp32_oracle(strategy):
    oracle = _oracle()
    fp32 = run_distributed(_grads_case, DP, strategy, _fp32_grads())
    bf16 = run_distributed(_grads_case, DP, strategy, _fp32_grads("--grad-reduce-in-bf16"))
    copies = DP if strategy == "no_shard" else 1
    assert _relative_error([g for g, _ in fp32], oracle, copies=copies) < 1e-5
    assert _relative_error([g for g, _ in bf16], oracle, copies=copies) > 1e-3
    # the grad norm (over DP under ZeRO) is the oracle's, on every rank
    norm = torch.cat(list(oracle.values())).norm().item()
    assert all(abs(n - norm) <= 1e-5 * norm for _, n in fp32), ([n for _, n in fp32], norm)
