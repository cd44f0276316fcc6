"""Megatron's ``--rampup-batch-size`` / ``--step-batch-size-schedule`` (Megatron's micro-batch
calculators) and ``--decoupled-lr`` / ``--decoupled-min-lr``, against values computed by hand
from Megatron's formulas:

    ramp START INC SAMPLES, global G:  per = SAMPLES / ((G - START) / INC)
        batch(c) = G if c > SAMPLES else START + INC * int(c / per)      (c: consumed samples)
    lr(c) in samples: c <= W: max_lr * c / W; c > D: min_lr;
        linear: min_lr + (max_lr - min_lr) * (1 - (c - W) / (D - W))
    decoupled: the word embedding / output weight use (decoupled_lr, decoupled_min_lr).
"""

from __future__ import annotations

import pytest
import torch

from megalite.core.parallel_state import ParallelState
from megalite.training.arguments import parse_args
from megalite.training.config import ConfigError, with_tokenizer
from megalite.training.forward_step import make_forward_step
from megalite.training.microbatches import BatchSizeCalculator, parse_step_schedule
from megalite.training.pretrain import build_run
from tests.harness import run_distributed

# G = 12, ramp 4 -> 12 by 4 over 16 samples: per = 16 / 2 = 8 samples per increment.
# consumed before each iteration: 0, 4, 8, 16, 28, 40 -> batches 4, 4, 8, 12, 12, 12 (52 samples)
RAMP = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 12 --rampup-batch-size 4 4 16 --train-samples 52 "
    "--lr 1e-3 --min-lr 1e-4 --lr-decay-style linear --lr-warmup-samples 8 "
    "--lr-decay-samples 40 --mock-data --tokenizer-type NullTokenizer --vocab-size 127 "
    "--hidden-dropout 0 --attention-dropout 0 --log-interval 1000 --eval-iters 0 --seed 7 "
    "--untie-embeddings-and-output-weights"
).split()
CONSUMED = [0, 4, 8, 16, 28, 40]
BATCHES = [4, 4, 8, 12, 12, 12]
LRS = [0.0, 5e-4, 1e-3, 7.75e-4, 4.375e-4, 1e-4]  # by hand, the formula above
# --decoupled-lr 2e-3 --decoupled-min-lr 2e-4: 2e-4 + 1.8e-3 * (1 - r)
DECOUPLED_LRS = [0.0, 1e-3, 2e-3, 1.55e-3, 8.75e-4, 2e-4]


def _cfg(*extra: str, world_size: int = 1, rank: int = 0):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size)} if world_size > 1 else {}
    return with_tokenizer(parse_args([*RAMP, *extra], env=env))


class _Counting:
    """A train iterator that records how many micro-batches each step drew, and their tokens."""

    def __init__(self, it):
        self.it, self.drawn = it, []

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.it)
        self.drawn.append(batch["tokens"].clone())
        return batch


def _run(cfg, ps, *, steps_per_record=None, load=False):
    run = build_run(cfg, ps, torch.device("cpu"), seed_rng=False, resume=load)
    trainer = run.trainer
    it = _Counting(run.train_iter[0])
    record = []
    step = trainer.step

    def recording_step(fwd, data):
        before = len(it.drawn)
        lrs = [g["lr"] for g in trainer.optimizer.param_groups]
        out = step(fwd, data)
        record.append((trainer.result.consumed_train_samples, len(it.drawn) - before, lrs))
        return out

    trainer.step = recording_step
    result = trainer.train(make_forward_step(torch.device("cpu")), [it])
    return trainer, result, record, it.drawn


def test_batch_schedule_by_hand():
    bs = BatchSizeCalculator(global_batch_size=12, micro_batch_size=2, dp_size=1, rampup=(4, 4, 16))
    assert [bs.global_batch_size(c) for c in CONSUMED] == BATCHES
    assert bs.train_iters(52) == 6 and bs.consumed_after(6) == 52
    assert bs.train_iters(51) == 5  # the partial last batch is dropped (Megatron)
    # Megatron's example: 16 -> 1024 by 16 over 300000 samples: 63 increments of 4761.9 samples
    big = BatchSizeCalculator(
        global_batch_size=1024, micro_batch_size=2, dp_size=8, rampup=(16, 16, 300000)
    )
    assert [big.global_batch_size(c) for c in (4761, 4762, 300000, 300001)] == [16, 32, 1024, 1024]
    assert big.num_microbatches(4762) == 2
    steps = parse_step_schedule("0:4 64:8, 1K:12", seq_length=16)  # tokens -> samples
    assert steps == [(0, 4), (4, 8), (62, 12)]
    sb = BatchSizeCalculator(global_batch_size=12, micro_batch_size=2, dp_size=2, steps=steps)
    assert [sb.global_batch_size(c) for c in (0, 3, 4, 61, 62)] == [4, 4, 8, 8, 12]
    assert sb.train_iters(20) == 3 and sb.train_iters(21) == 4  # 4 + 8 + 8 = 20; then 28
    assert parse_step_schedule("0:8 1.5K:16", seq_length=10) == [(0, 8), (150, 16)]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--rampup-batch-size", "3", "3", "16"], ["--rampup-batch-size", "batch size 3"]),
        (["--rampup-batch-size", "4", "3", "16"], ["minus the start 4 = 8", "increment 3"]),
        (["--rampup-batch-size", "4", "4", "16", "--train-iters", "5"], ["exactly one"]),
        (
            ["--step-batch-size-schedule", "0:4 64:8"],
            ["--global-batch-size 12", "last batch size 8"],
        ),
        (["--step-batch-size-schedule", "0:5 64:12"], ["batch size 5", "micro-batch-size 2"]),
        (["--step-batch-size-schedule", "64:4"], ["first threshold must be 0"]),
        (["--decoupled-min-lr", "1e-5"], ["--decoupled-lr"]),
    ],
)
def test_batch_schedule_errors_are_one_line(extra, words):
    i = RAMP.index("--rampup-batch-size")
    argv = RAMP[:i] + RAMP[i + 4 :] + extra
    with pytest.raises(ConfigError) as e:
        with_tokenizer(parse_args(argv))
    text = str(e.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_ramp_needs_sample_based_training():
    argv = [a if a != "--train-samples" else "--train-iters" for a in RAMP]
    argv[argv.index("--train-iters") + 1] = "6"
    argv = [a for a in argv if a not in ("--lr-warmup-samples", "--lr-decay-samples", "8", "40")]
    with pytest.raises(ConfigError, match="needs sample-based training"):
        parse_args(argv)


def test_ramp_schedule_data_lr_decoupled_and_resume(tmp_path):
    """One process: batches, micro-batches per step, consumed samples, the sample-based LR (both
    rates), the data order, the decoupled groups, and a resume mid-ramp."""
    ckpt = str(tmp_path / "ckpt")
    extra = ["--decoupled-lr", "2e-3", "--decoupled-min-lr", "2e-4", "--save", ckpt]
    cfg = _cfg(*extra)
    assert cfg.training.train_iters == 6
    ps = ParallelState.single()
    trainer, result, record, drawn = _run(cfg, ps)
    assert [c for c, _, _ in record] == CONSUMED  # before each step
    assert [n for _, n, _ in record] == [b // 2 for b in BATCHES]  # micro-batches of 2
    assert result.consumed_train_samples == 52
    groups = trainer.optimizer.param_groups
    decoupled = [i for i, g in enumerate(groups) if "max_lr" in g]
    assert len(decoupled) == 1 and groups[decoupled[0]]["max_lr"] == 2e-3
    for i, (_, _, lrs) in enumerate(record):
        for j, lr in enumerate(lrs):
            want = DECOUPLED_LRS[i] if j in decoupled else LRS[i]
            assert lr == pytest.approx(want, rel=1e-12, abs=1e-15), (i, j, lr, want)
    # the data: the 52 samples in order, as Megatron's sampler takes them
    tokens = torch.cat(drawn)
    assert tokens.shape[0] == 52
    fresh = build_run(cfg, ps, torch.device("cpu"), seed_rng=False, resume=False)
    flat = torch.cat([next(fresh.train_iter[0])["tokens"] for _ in range(26)])
    assert torch.equal(tokens, flat)
    # decoupled parameters: the word embedding and the output layer, not the position embedding
    model = trainer.model[0].grad_wrapper
    in_group = {id(p) for p in trainer.optimizer.model_params[-2:]}
    chosen = {n for n, p in model.named_parameters() if id(p) in in_group}
    assert {n.split("module.")[-1] for n in chosen} == {
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    }, chosen
    # resume mid-ramp: the checkpoint saved where the micro-batch count changed (iteration 3)
    cfg_b = _cfg(*extra[:-2], "--load", ckpt, "--ckpt-step", "3")
    trainer_b, result_b, record_b, _ = _run(cfg_b, ps, load=True)
    assert [c for c, _, _ in record_b] == [c for c, _, _ in record][3:]
    assert [lrs for _, _, lrs in record_b] == [lrs for _, _, lrs in record][3:]
    assert result_b.losses == pytest.approx(result.losses[3:], rel=1e-6)
    del trainer_b
    # tied embeddings: the one word embedding only
    i = RAMP.index("--untie-embeddings-and-output-weights")
    tied = with_tokenizer(parse_args([*RAMP[:i], *RAMP[i + 1 :], "--decoupled-lr", "2e-3"]))
    opt = build_run(tied, ps, torch.device("cpu"), seed_rng=False, resume=False).trainer.optimizer
    assert [len(g["params"]) for g in opt.param_groups if "max_lr" in g] == [1]


def test_ramp_and_decoupled_lr_on_every_rung_match_one_process():
    """DP 2 on each rung (DDP, ZeRO-1/2/3) = the one-process run (losses 1e-5 rel): the ramp's
    micro-batches split over DP and the decoupled groups carried by the sharded optimizers."""
    oracle_cfg = _cfg("--decoupled-lr", "2e-3")
    _, oracle, oracle_record, _ = _run(oracle_cfg, ParallelState.single())
    results = run_distributed(_rungs_case, 2, timeout=600)
    for strategy, (losses, lrs) in results[-1].items():
        assert losses == pytest.approx(oracle.losses, rel=1e-5), strategy
        assert lrs == [x for _, _, x in oracle_record], strategy


def _rungs_case() -> dict:
    import torch.distributed as dist

    from tests.mesh import mesh

    out = {}
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        flags = ("--decoupled-lr", "2e-3", "--data-parallel-sharding-strategy", strategy)
        cfg = _cfg(*flags, world_size=2, rank=dist.get_rank())
        ps = mesh(1, 1, device=torch.device("cpu"))
        try:
            _, result, record, _ = _run(cfg, ps)
        finally:
            ps.destroy()
        out[strategy] = (result.losses, [lrs for _, _, lrs in record])
    return out
