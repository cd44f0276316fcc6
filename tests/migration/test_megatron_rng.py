"""Megatron's RNG states across the two frameworks (issue 18).

1. A megalite run saved in Megatron's formats (``--ckpt-format torch`` / ``torch_dist``) and
   resumed continues bit-identically (``==``) to the uninterrupted run with dropout on: the Python,
   numpy, torch and tensor-parallel generator states go through Megatron's ``rng_state`` and back
   (single process, and TP 2 where the tracker's per-TP-rank state matters). The negative control
   (``--no-load-rng``) shows the comparison sees a missing RNG state.
2. A Megatron fixture loaded at its own layout (TP 2 x PP 2) restores every generator to the state
   in the file of its (TP, PP) rank; at another layout it re-seeds (``--seed`` + iteration).
"""

from __future__ import annotations

import os
import random
import tempfile

import numpy as np
import torch
import torch.distributed as dist

from megalite.checkpoint.megatron import open_reader
from megalite.core.parallel_state import ParallelState, initialize_model_parallel
from megalite.core.tensor_parallel.random import TP_RNG, model_parallel_seed
from megalite.training import checkpoint_io
from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.migration.test_megatron_checkpoints import FIXTURES, FORMATS, _load
from tests.training.common import FAMILIES, config

N = 2
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _resumed(extra: list[str], save: str, *, world: int = 1, rank: int = 0) -> dict:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)} if world > 1 else {}
    flags = [*FAMILIES["gpt2"], *extra, *DROPOUT, "--train-iters", str(2 * N), "--save", save,
             "--save-interval", str(N)]  # fmt: skip
    straight = pretrain(config(*flags, world_size=world, rank=rank), env=env).losses
    resume = [*flags, "--load", save, "--ckpt-step", str(N)]
    resumed = pretrain(config(*resume, world_size=world, rank=rank), env=env).losses
    out = {"straight": straight, "resumed": resumed}
    if world == 1:  # the negative control
        no_rng = config(*resume, "--no-load-rng", world_size=world, rank=rank)
        out["no_rng"] = pretrain(no_rng, env=env).losses
    return out


def test_megalite_resumes_bitwise_from_its_megatron_format_files():
    for fmt in ("torch", "torch_dist"):
        with tempfile.TemporaryDirectory() as save:
            r = _resumed(["--ckpt-format", fmt], save)
            legacy = os.path.join(save, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
            assert os.path.isfile(legacy) == (fmt == "torch")
            assert len(r["resumed"]) == N and r["resumed"] == r["straight"][N:], (fmt, r)
            assert r["no_rng"] != r["straight"][N:], "dropout does not depend on the RNG"


def _tp2_case(root: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tp2 = ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch_dist"]
    return _resumed(tp2, os.path.join(root, "tp2"), world=world, rank=rank)


def test_tp2_resume_from_megatron_format_restores_the_tracker():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_tp2_case, 2, root, timeout=300)
    for r in results:
        assert r["resumed"] == r["straight"][N:], r


def _generator_states(trainer) -> dict:
    return {
        "torch": torch.get_rng_state(),
        "tracker": trainer.rng_tracker.get_states()[TP_RNG],
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
    }


def _fixture_case() -> dict:
    ps = initialize_model_parallel(2, 2)
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    out = {}
    try:
        for fmt, name in FORMATS.items():
            trainer, _, loaded = _load(name, ps, *layout, world_size=4, rank=dist.get_rank())
            # something else everywhere, so that a restore that does nothing shows
            trainer.rng_tracker = model_parallel_seed(99, tp_rank=ps.tp_rank, pp_rank=ps.pp_rank)
            torch.manual_seed(99)
            out[fmt + ":before"] = _generator_states(trainer)
            checkpoint_io.restore_rng(trainer, loaded)
            out[fmt] = (ps.tp_rank, ps.pp_rank, _generator_states(trainer))
    finally:
        ps.destroy()
    return out


def test_megatron_fixture_rng_states_are_restored_at_its_layout():
    results = run_distributed(_fixture_case, 4, timeout=300)
    for fmt, name in FORMATS.items():
        reader = open_reader(os.path.join(FIXTURES, name, "iter_0000002"), fmt)
        seen = set()
        for r in results:
            tp_rank, pp_rank, got = r[fmt]
            seen.add((tp_rank, pp_rank))
            entry = reader.rng_states(tp_rank, pp_rank)[0]
            where = (fmt, tp_rank, pp_rank)
            assert torch.equal(got["torch"], entry["torch_rng_state"]), where
            tracker = entry["rng_tracker_states"]["model-parallel-rng"]
            assert torch.equal(got["tracker"], tracker), where
            py = entry["random_rng_state"]
            assert got["python"] == (py[0], tuple(py[1]), py[2]), where
            assert np.array_equal(got["numpy"], entry["np_rng_state"][1]), where
        assert seen == {(t, p) for t in range(2) for p in range(2)}
        # what the generators held before the restore differs from the file: not vacuous
        for r in results:
            tp_rank, pp_rank, _ = r[fmt]
            entry = reader.rng_states(tp_rank, pp_rank)[0]
            before = r[fmt + ":before"]
            assert not torch.equal(before["torch"], entry["torch_rng_state"])
            assert not torch.equal(
                before["tracker"], entry["rng_tracker_states"]["model-parallel-rng"]
            )


def test_megatron_rng_at_another_layout_reseeds_in_one_line(caplog):
    trainer, _, loaded = _load(FORMATS["torch"], ParallelState.single())
    assert loaded.rng_state is None and loaded.reseed == trainer.cfg.training.seed + 2
    lines = [r.getMessage() for r in caplog.records if "RNG states not restored" in r.getMessage()]
    assert len(lines) == 1 and "TP 1 x PP 1" in lines[0] and "\n" not in lines[0], lines
