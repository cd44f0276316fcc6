"""Megatron's RNG states across the two frameworks.

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
import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint.megatron import LegacyReader, open_reader
from megalite.checkpoint.megatron.distopt import (
    bucket_size_from_args,
    flat_layout,
    shared_embedding_name,
)
from megalite.checkpoint.megatron.legacy import load_megatron_file, parameter_names
from megalite.core.parallel_state import ParallelState
from megalite.core.tensor_parallel.random import TP_RNG, model_parallel_seed
from megalite.training import checkpoint_io
from megalite.training.config import ConfigError
from megalite.training.pretrain import pretrain
from tests.checkpoint.megatron.test_formats import FIXTURES, FORMATS, SOURCES, _load
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, config

N = 2
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
# the distributed-optimizer fixture's grad-buffer settings (tools/make_megatron_fixtures.py)
DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "540"]


def _resumed(extra: list[str], save: str, *, world: int = 1, rank: int = 0) -> dict:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)} if world > 1 else {}
    flags = [
        *FAMILIES["gpt2"],
        *extra,
        *DROPOUT,
        "--train-iters",
        str(2 * N),
        "--save",
        save,
        "--save-interval",
        str(N),
    ]
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
        results = run_distributed(_tp2_case, 2, root, timeout=600)
    for r in results:
        assert r["resumed"] == r["straight"][N:], r


def _generator_states(trainer) -> dict:
    return {
        "torch": torch.get_rng_state(),
        "tracker": trainer.rng_tracker.get_states()[TP_RNG],
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
    }


def _fixture_case(save: str) -> dict:
    """At the fixtures' TP 2 x PP 2: restore their RNG states; and load the distributed-optimizer
    fixture with its bucket flags, then write it back in Megatron's ``torch`` format (``save``)."""
    ps = mesh(2, 2)
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
        trainer, _, _ = _load(
            SOURCES["torch+distrib_optim"],
            ps,
            *layout,
            *DISTOPT,
            "--save",
            save,
            "--ckpt-format",
            "torch",
            world_size=4,
            rank=dist.get_rank(),
        )
        checkpoint_io.save_checkpoint(trainer)
    finally:
        ps.destroy()
    return out


def _tp0_replicas(src: str, shard: str, key: str, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` with the ranges of the TP-replicated parameters (the norms) taken from TP rank 0's
    file: megalite holds one copy of them, and the fixture's synthetic gradients let Megatron's
    copies drift apart across TP ranks (by ~2e-3); every other element is compared as written."""
    tp0 = "mp_rank_00_" + shard.rsplit("_", 1)[1]
    if shard == tp0:
        return flat
    raw = load_megatron_file(os.path.join(src, shard, "model_optim_rng.pt"))
    pp_rank = int(shard.rsplit("_", 1)[1])
    params = [(n, raw["model"][n].numel()) for n in parameter_names(raw["model"])]
    bucket = bucket_size_from_args(
        raw["args"], pp_rank=pp_rank, stage_numel=sum(k for _, k in params)
    )
    spans, _ = flat_layout(
        params, bucket_size=bucket, shared=shared_embedding_name(raw["args"], pp_rank, 2)
    )
    theirs0 = next(iter(load_megatron_file(os.path.join(src, tp0, "distrib_optim.pt"))[0].values()))
    out = flat.clone()
    for name, (start, end) in spans.items():
        if "layernorm" in name:
            out[start:end] = theirs0[key][start:end]
    return out


def test_megatron_fixtures_at_their_layout_rng_and_distrib_optim(tmp_path):
    """Megatron's RNG states restored per (TP, PP) rank; megalite's ``distrib_optim.pt`` of the
    TP 2 x PP 2 distributed-optimizer fixture (540-element buckets, --overlap-grad-reduce) equals
    the file Megatron wrote, flat tensor for flat tensor: the bucket, alignment and PP rules."""
    save = str(tmp_path / "distopt")
    results = run_distributed(_fixture_case, 4, save, timeout=600)
    src = os.path.join(FIXTURES, SOURCES["torch+distrib_optim"], "iter_0000002")
    for shard in ("mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"):
        theirs = load_megatron_file(os.path.join(src, shard, "distrib_optim.pt"))
        mine = load_megatron_file(os.path.join(save, "iter_0000002", shard, "distrib_optim.pt"))
        assert set(mine) == set(theirs) and list(mine[0]) == list(theirs[0]), shard
        t, m = next(iter(theirs[0].values())), next(iter(mine[0].values()))
        assert set(m) == set(t) and int(m["numel_unpadded"]) == int(t["numel_unpadded"]), shard
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(m[key], _tp0_replicas(src, shard, key, t[key])), (shard, key)
        args = vars(
            load_megatron_file(os.path.join(save, "iter_0000002", shard, "model_optim_rng.pt"))[
                "args"
            ]
        )
        assert (args["overlap_grad_reduce"], args["ddp_bucket_size"]) == (True, 540), shard
        assert args["ddp_num_buckets"] is None and args["use_distributed_optimizer"]
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
    assert loaded.rng_state is None and loaded.reseed == trainer.cfg.model.seed + 2
    lines = [r.getMessage() for r in caplog.records if "RNG states not restored" in r.getMessage()]
    assert len(lines) == 1 and "TP 1 x PP 1" in lines[0] and "\n" not in lines[0], lines


def test_ddp_num_buckets_is_recorded_for_megatrons_bucket_layout(tmp_path):
    """--ddp-num-buckets: megalite's buckets are this rank's parameters // N (as Megatron's), the
    count is written into ``args`` beside --overlap-grad-reduce (what Megatron's loader rebuilds
    the grad buffer from), and ``distrib_optim.pt`` is laid out in those buckets: it reads back
    (the reader checks its length against that layout) equal to the plain optimizer's state."""
    single = ParallelState.single()
    flags = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-num-buckets", "3"]
    trainer, _, _ = _load(
        FORMATS["torch"], single, *flags, "--save", str(tmp_path / "n3"), "--ckpt-format", "torch"
    )
    module = trainer.model[0].module
    numel = sum(p.numel() for p in module.parameters())
    assert trainer.cfg.parallel.bucket_size(1, stage_numel=numel) == numel // 3
    checkpoint_io.save_checkpoint(trainer)
    shard = tmp_path / "n3" / "iter_0000002" / "mp_rank_00"
    args = vars(load_megatron_file(str(shard / "model_optim_rng.pt"))["args"])
    assert (args["ddp_num_buckets"], args["ddp_bucket_size"]) == (3, None)
    assert args["overlap_grad_reduce"] and args["use_distributed_optimizer"]
    buckets = trainer.model[0].grad_wrapper.grad_buffers[0].buckets
    assert len(buckets) == 3  # megalite's own buckets too
    got = LegacyReader(str(tmp_path / "n3" / "iter_0000002")).optimizer_state(0, 0)
    plain = LegacyReader(os.path.join(FIXTURES, FORMATS["torch"], "iter_0000002"))
    for name, state in got["params"].items():  # Megatron's Adam state, through the buckets
        want = plain.optimizer_tensors(name)
        for key, tensor in state.items():
            assert torch.equal(tensor, want[key]), (name, key)
    # the torch_dist files of this distributed-optimizer run: Megatron's fully_reshardable form
    # (fp32 masters beside the moments; what the real loader reads, test_megatron_loader_layouts)
    trainer.cfg.training.ckpt_format = "torch_dist"
    checkpoint_io.save_checkpoint(trainer, save_dir=str(tmp_path / "dist"))
    iter_dir = tmp_path / "dist" / "iter_0000002"
    common = load_megatron_file(str(iter_dir / "common.pt"))
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert {g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]} == {2}
    assert vars(common["args"])["use_distributed_optimizer"]
    dist_reader = open_reader(str(iter_dir), "torch_dist")
    index = dist_reader._index
    moments = {k.split(".", 3)[3] for k in index if k.startswith("optimizer.state.exp_avg.")}
    assert moments and moments == {
        k.split(".", 3)[3] for k in index if k.startswith("optimizer.state.param.")
    }
    assert dist_reader.optimizer_header()["step"] == 2
    for name in got["params"]:
        back = dist_reader.optimizer_tensors(name)
        for key, tensor in plain.optimizer_tensors(name).items():
            assert torch.equal(back[key], tensor), (name, key)
    with pytest.raises(ConfigError, match="--ddp-num-buckets 2: .* --ddp-bucket-size"):
        config(*FAMILIES["gpt2"], "--ddp-num-buckets", "2", "--ddp-bucket-size", "100")
