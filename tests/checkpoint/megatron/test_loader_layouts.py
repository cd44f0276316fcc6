"""megalite's Megatron-format files of a TP 2 x PP 2 run through megatron-core's own loader at
TP 2 x PP 2 x DP 2: skipped where Megatron-LM is not importable (CI: it is not a package;
megatron-core alone reads megalite's bf16 files in ``test_megatron_core_reads_bf16``); run with

    PYTHONPATH=$PWD:/tmp/mcore/site:/tmp/mlm016 /tmp/venv-mcore/bin/python -m pytest -q \\
        tests/checkpoint/megatron/test_loader_layouts.py

megalite loads the distributed-optimizer fixture at TP 2 x PP 2 with its bucket flags and saves
it in both formats; Megatron (8 CPU processes, ``tools/make_megatron_fixtures.py --layout``) loads
the ``torch`` files with ``--use-distributed-optimizer`` (``distrib_optim.pt``), the
``torch_dist`` files with and without it. Each must give the source model's logits (1e-5) and,
with the distributed optimizer, hold exactly the Adam state megalite wrote (Megatron's own
``get_parameter_state_dp_zero`` of every (TP, PP) rank = megalite's ``distrib_optim.pt``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch.distributed as dist

from megalite.training import checkpoint_io
from tests import paths
from tests.checkpoint.megatron.test_formats import FIXTURES, SOURCES, _load, _megatron_importable
from tests.harness import run_distributed
from tests.mesh import mesh

BUCKETS = ["--overlap-grad-reduce", "--ddp-bucket-size", "540"]
TOOL = str(paths.ROOT / "tools" / "make_megatron_fixtures.py")


def _save_tp2_pp2(root: str) -> None:
    ps = mesh(2, 2)
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    try:
        trainer, _, _ = _load(
            SOURCES["torch+distrib_optim"],
            ps,
            *layout,
            "--use-distributed-optimizer",
            *BUCKETS,
            "--train-iters",
            "10",
            world_size=4,
            rank=dist.get_rank(),
        )
        for fmt in ("torch", "torch_dist"):
            trainer.cfg.training.ckpt_format = fmt
            checkpoint_io.save_checkpoint(trainer, save_dir=os.path.join(root, fmt))
    finally:
        ps.destroy()


@pytest.mark.skipif(not _megatron_importable(), reason="megatron-core/Megatron-LM not importable")
def test_megalite_tp2_pp2_files_load_in_megatrons_loader_at_dp2(tmp_path):
    root = str(tmp_path)
    run_distributed(_save_tp2_pp2, 4, root, timeout=600)
    for fmt in ("torch", "torch_dist"):
        shutil.copy(os.path.join(FIXTURES, "reference.pt"), os.path.join(root, fmt))
    # the files of a --use-distributed-optimizer run are Megatron's distributed-optimizer form, read
    # by a Megatron run with it (as Megatron's own); the plain form: test_megatron_checkpoints.py
    runs = [
        ("torch_dist", ["--distributed-optimizer"], "2"),
        ("torch", ["--distributed-optimizer"], "2"),
    ]
    for fmt, flags, dp in runs:
        proc = subprocess.run(
            [
                sys.executable,
                "-W",
                "ignore",
                TOOL,
                "--check-load",
                os.path.join(root, fmt),
                "--ckpt-format",
                fmt,
                *flags,
                "--layout",
                "2",
                "2",
                dp,
                "--bucket-flags",
                " ".join(BUCKETS) if flags else "",
                "--distopt-ref",
                os.path.join(root, "torch"),
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
        print(proc.stdout[-3000:])
        assert proc.returncode == 0, (fmt, flags, proc.stdout[-3000:] + proc.stderr[-3000:])
        assert "-> ok" in proc.stdout and "max rel err" in proc.stdout, proc.stdout[-2000:]
        if flags:
            assert proc.stdout.count("= megalite's: yes") == 4, proc.stdout[-2000:]
