"""Flags -> config, and the refusals: every bad combination is one line ``error: ...``, exit status
2, no traceback, before any process group exists (the world size comes from the environment)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from megalite.training.arguments import parse_args
from megalite.training.config import ConfigError
from tests.paths import ROOT
from tests.training.common import BASE, FAMILIES, LogCapture


def _entry():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", ROOT / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replace(argv: list[str], flag: str, value: str | None) -> list[str]:
    """``argv`` with ``flag``'s value replaced (or the flag removed when value is None)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag:
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out + ([flag, value] if value is not None else [])


BAD = [
    # (world size, argv, a piece of the expected message)
    (1, [*BASE, "--foo-bar", "3"], "unknown flag --foo-bar"),
    (1, [*BASE, "--lr-warm", "3"], "unknown flag --lr-warm"),  # no abbreviations
    (1, _replace(BASE, "--num-layers", None), "missing required flag(s): --num-layers"),
    (1, [*BASE, "--fp16", "--bf16"], "--fp16 and --bf16 are mutually exclusive"),
    (4, [*BASE, "--tensor-model-parallel-size", "2", "--global-batch-size", "6"],
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2"),
    (3, [*BASE, "--tensor-model-parallel-size", "3"],
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    (4, [*_replace(BASE, "--num-attention-heads", "8"), *FAMILIES["llama"], "--global-batch-size",
         "2", "--micro-batch-size", "2", "--tensor-model-parallel-size", "4"],
     "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (4, [*_replace(BASE, "--seq-length", "18"), "--tensor-model-parallel-size", "4",
         "--sequence-parallel", "--global-batch-size", "2", "--micro-batch-size", "2"],
     "--seq-length 18 is not divisible by --tensor-model-parallel-size 4 under --sequence-par"),
    (2, [*_replace(BASE, "--num-layers", "3"), "--pipeline-model-parallel-size", "2"],
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (3, [*BASE, "--tensor-model-parallel-size", "2"], "world size 3 is not divisible by"),
    (1, [*BASE, "--lr-warmup-iters", "9"], "--lr-warmup-iters 9 exceeds --lr-decay-iters 5"),
    (1, [*BASE, "--overlap-grad-reduce"], "--overlap-grad-reduce is implemented for --use-distrib"),
    (2, [*BASE, "--decoder-first-pipeline-num-layers", "1"],
     "--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size > 1"),
    (4, [*_replace(BASE, "--num-layers", "5"), "--pipeline-model-parallel-size", "4",
         "--decoder-first-pipeline-num-layers", "3"],
     "--num-layers 5 minus the first/last stage layers (3) leaves 2, which does not split"),
    (1, [*BASE, "--save-interval", "10"], "--save-interval 10 needs --save DIR"),
    (1, [*BASE, "--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-opt"),
    (1, _replace(BASE, "--num-layers", "two"), "argument --num-layers: invalid int value: 'two'"),
    (1, _replace(BASE, "--vocab-size", None), "NullTokenizer needs --vocab-size"),
    (1, [*BASE, "--train-samples", "80"], "exactly one of --train-iters and --train-samples"),
    (1, [*BASE, "--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    (1, [*BASE, "--recompute-granularity", "full"], "needs --recompute-method uniform or block"),
]  # fmt: skip


def _env(world: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    if world > 1:
        env.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0")
    return env


@pytest.mark.parametrize("world, argv, message", BAD, ids=[m[:40] for *_, m in BAD])
def test_bad_flags_one_line_exit_2(world, argv, message, monkeypatch, capsys):
    monkeypatch.setattr(os, "environ", _env(world))
    code = _entry().main(list(argv))
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert message in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out


def test_entry_point_process_exits_2_with_one_line():
    """The real process: exit status 2, one stderr line, no traceback."""
    env = _env(1)
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *BASE, "--fp16", "--bf16", "--nope"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: unknown flag --nope; see pretrain_gpt.py --help for the flags megalite implements"
    )


def test_flags_map_onto_the_configs():
    argv = [*BASE, *FAMILIES["llama"], "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    argv += ["--bf16", "--attention-backend", "flash", "--recompute-activations"]
    argv += ["--lr-warmup-fraction", "0.2", "--ddp-bucket-size", "1000", "--no-fused-kernels"]
    cfg = parse_args(argv, env={"RANK": "1", "WORLD_SIZE": "4"})
    m = cfg.model
    assert (m.position_embedding_type, m.normalization, m.swiglu) == ("rope", "RMSNorm", True)
    assert (m.num_query_groups, m.add_bias_linear, m.untie_embeddings_and_output_weights) == (
        2,
        False,
        True,
    )
    assert (m.norm_epsilon, m.ffn_hidden_size, m.vocab_size) == (1e-6, 64, 128)  # 127 + eod
    assert m.attention_backend == "sdpa" and m.recompute_granularity == "selective"
    assert m.params_dtype == torch.bfloat16 and m.sequence_parallel and not m.use_fused_kernels
    assert cfg.parallel.data_parallel_size == 2 and cfg.check_world(4, 2) == 2
    assert cfg.parallel.bucket_size() == 1000
    assert cfg.optimizer.warmup_iters(cfg.optimizer.lr_decay_iters) == 1  # 0.2 x 5
    assert cfg.data.mock_data and cfg.model.seq_length == 16 and cfg.tokenizer.eod == 127
    # defaults: global batch = micro x dp; --train-samples -> iterations; SP with TP 1 warned off
    with LogCapture() as logs:
        defaults = _replace(_replace(BASE, "--global-batch-size", None), "--train-iters", None)
        argv = [*defaults, *"--train-samples 40 --sequence-parallel".split()]
        cfg = parse_args(argv, env={"RANK": "0", "WORLD_SIZE": "2"})
    assert cfg.training.global_batch_size == 4 and cfg.training.train_iters == 10
    assert not cfg.model.sequence_parallel
    assert any("--sequence-parallel has no effect" in line for line in logs.lines)


def test_parse_errors_are_config_errors():
    with pytest.raises(ConfigError, match="^unknown flag --x;"):
        parse_args([*BASE, "--x"], env={})
    with pytest.raises(ConfigError, match=r"^unknown flag --y \(also --z\);"):
        parse_args([*BASE, "--y=3", "--z", "-1"], env={})
