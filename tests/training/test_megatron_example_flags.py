"""Megatron-LM's own example scripts through pretrain_gpt.py's flags.

The flag lists below are those of Megatron's ``examples/gpt3/train_gpt3_175b_distributed.sh``,
``examples/llama/train_llama3_8b_h100_fp8.sh`` (its bf16 variant, i.e. without the four
``--fp8-*`` flags its ``DTYPE=fp8`` adds, which need Transformer Engine; mock data) and the
functional test ``tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp2/model_config.yaml``,
in their order, with the sizes shrunk (layers, hidden, heads, sequence, batch, iterations), the data
replaced by ``--mock-data`` and a NullTokenizer, and paths made temporary. Every other flag is as
Megatron's (GPT-3's ``--step-batch-size-schedule`` shrunk to ``0:2,32:4``: 2 samples, then 4 from
32 tokens on). Each run: the flags megalite refuses are refused one at a time, each with one line
saying why it is not implemented (they are dropped and the parse retried); ``DROPPED`` lists them
with the reason, exactly, so an entry is removed when its flag lands; the flags that change nothing
are accepted with one warning line, and the run trains to its last iteration with finite losses.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from megalite.training.arguments import parse_args
from megalite.training.config import ConfigError, with_tokenizer
from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.paths import ROOT

GPT3_175B = """
--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16
--max-position-embeddings 16 --attention-backend auto
--micro-batch-size 1 --global-batch-size 4
--step-batch-size-schedule 0:2,32:4
--train-iters 3 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006
--clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6
--lr-warmup-fraction .001 --lr-decay-iters 430
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
--mock-data --tokenizer-type NullTokenizer --vocab-size 127 --split 949,50,1
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save {tmp}/ckpt --load {tmp}/ckpt
--eval-iters 1 --tensorboard-dir {tmp}/tb
"""
LLAMA3_8B = """
--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 16
--max-position-embeddings 16 --position-embedding-type rope --rotary-base 1000000
--rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm
--init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1
--global-batch-size 4 --train-samples 8 --lr-decay-samples 8 --lr-warmup-samples 2 --lr 0.00015
--min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine
--clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1
--exit-duration-in-mins 235 --tensor-model-parallel-size 1 --context-parallel-size 1
--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--mock-data --tokenizer-type NullTokenizer --vocab-size 127 --split 99,1,0
--data-cache-path {tmp}/cache --tiktoken-pattern v2
--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 1 --eval-interval 100 --save-interval 1000 --log-throughput
--profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist
--distributed-timeout-minutes 60 --save {tmp}/ckpt --load {tmp}/ckpt --tensorboard-dir {tmp}/tb
"""
# The flags each run still drops: flag -> the reason. At merge, remove an entry once its
# flag is implemented (the test fails until then: it checks this list is exact).
DROPPED: dict[str, dict[str, str]] = {
    "gpt3_175b": {},
    "llama3_8b": {},
    "gpt3_tp2_pp2": {},
}
GPT3_TP2_PP2 = """
--num-layers 4 --hidden-size 32 --num-attention-heads 4 --log-params-norm --log-num-zeros-in-grad
--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir {tmp}/tb
--micro-batch-size 1 --global-batch-size 4 --seq-length 16 --max-position-embeddings 16
--train-iters 2 --timing-log-level 0 --lr-decay-iters 320 --save {tmp}/ckpt --load {tmp}/ckpt
--mock-data --tokenizer-type NullTokenizer --vocab-size 127 --split 949,50,1
--distributed-backend gloo --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5
--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1
--save-interval 10000 --eval-interval 1000 --eval-iters 1 --transformer-impl transformer_engine
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --deterministic-mode
--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models
--ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable --dist-ckpt-strictness log_all
--data-cache-path {tmp}/cache --bf16 --attention-backend unfused --log-memory-to-tensorboard
--async-save --use-persistent-ckpt-worker
"""


def accepted_flags(argv: list[str], env: dict) -> tuple[list[str], list[str]]:
    """Drop refused flags one at a time (each: one line saying why); the rest parses."""
    refused = []
    while True:
        try:
            parse_args(argv, env=env)
            return argv, refused
        except ConfigError as e:
            text = str(e)
            assert "\n" not in text and "not implemented" in text, text
            if "unknown flag" in text:
                flag = text.split("unknown flag ", 1)[1].split(":", 1)[0]
            else:
                flag = text.split(" ", 1)[0]
            assert flag.startswith("--") and flag in argv, text
            i = argv.index(flag)
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            argv = argv[:i] + argv[i + 1 + has_value :]
            refused.append(flag)


def _flags(text: str, tmp: str) -> list[str]:
    return text.format(tmp=tmp).split()


@pytest.mark.parametrize("name", ["gpt3_175b", "llama3_8b"])
def test_example_script_flags_train(name, tmp_path, caplog):
    text = {"gpt3_175b": GPT3_175B, "llama3_8b": LLAMA3_8B}[name]
    argv, refused = accepted_flags(_flags(text, str(tmp_path)), env={})
    assert set(refused) == set(DROPPED[name]), (
        f"refused {refused}; DROPPED[{name!r}] lists {sorted(DROPPED[name])}: update it"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megalite"):
        cfg = with_tokenizer(parse_args(argv, env={}))
    ignored = [r for r in caplog.records if "Megatron flag(s) that change nothing" in r.message]
    assert len(ignored) == (1 if name == "llama3_8b" else 0), [r.message for r in ignored]
    # as a user runs it, in a fresh process (its DataLoader worker must not fork pytest's process)
    done = run_pretrain_gpt(argv)
    assert f"training done: {cfg.training.train_iters} iterations" in done.stdout + done.stderr
    if name == "llama3_8b":  # sample-based schedule: decay over 8 samples = 2 iterations
        assert cfg.optimizer.lr_decay_iters == 2 and cfg.optimizer.lr_warmup_iters == 0.5
        assert cfg.optimizer.decoupled_lr == 5.0e-4 and cfg.optimizer.decoupled_min_lr == 4.5e-5
    if name == "gpt3_175b":  # the step schedule: 2 samples, then 4 from 32 tokens = 2 samples on
        assert "global batch size 2 -> 4 at 2 consumed samples" in done.stdout + done.stderr


def run_pretrain_gpt(argv: list[str]) -> subprocess.CompletedProcess:
    """``python pretrain_gpt.py ARGV`` in a fresh process; exit 0 (it stops non-zero on a
    non-finite loss) or the test fails with the process's last lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    return done


def _functional_case(tmp: str) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    argv, refused = accepted_flags(_flags(GPT3_TP2_PP2, tmp), env=env)
    result = pretrain(with_tokenizer(parse_args(argv, env=env)), env=env)
    return refused, result.iteration, result.losses


def test_functional_config_tp2_pp2_trains_and_saves_megatrons_format(tmp_path):
    results = run_distributed(_functional_case, 4, str(tmp_path), timeout=600)
    refused, iteration, losses = results[-1]
    assert set(refused) == set(DROPPED["gpt3_tp2_pp2"]) and iteration == 2, refused
    assert losses and all(math.isfinite(x) for x in losses), losses
    # --ckpt-format torch_dist: Megatron's files, which megalite's loader detects
    from megalite.checkpoint.megatron import detect_format

    assert detect_format(os.path.join(str(tmp_path), "ckpt", "iter_0000002")) == "torch_dist"
