"""Checkpoints across Megatron-LM and megalite, both ways.

Fixtures (tests/fixtures/megatron_ckpt/, written by megatron-core's and Megatron-LM's own save
path, ``tools/make_megatron_fixtures.py``): a 4-layer Llama-style model at TP 2 x PP 2 after two
Adam steps, saved as iteration 2 in Megatron's ``torch`` (legacy) and ``torch_dist`` formats, the
same run at TP 2 x PP 2 x DP 2 with Megatron's distributed optimizer and 540-element grad-buffer
buckets saved in the ``torch`` format (``distrib_optim.pt`` beside each ``model_optim_rng.pt``),
and ``reference.pt``: the logits of fixed tokens computed by Megatron's GPTModel after Megatron's
own ``load_checkpoint`` of the torch_dist files at TP 1 x PP 1.

1. The three load into megalite at TP 1 x PP 1 (one process), TP 2 x PP 1, TP 1 x PP 2 and DP 2
   with megalite's distributed optimizer (two ranks): the logits equal the reference within 1e-5
   relative (fp32; the sums are ordered differently), the counters are Megatron's (iteration 2,
   8 samples), and the Adam state is Megatron's (the flat ``distrib_optim.pt`` ranges, read back
   by name, equal the plain optimizer's per-parameter state exactly).
2. Training continues: two more iterations from any of them at any of those layouts give the
   same losses (1e-5); the control run without the optimizer state (--no-load-optim) differs.
3. megalite's ``--ckpt-format torch`` / ``torch_dist`` files load back into megalite with the same
   logits, and, when megatron-core is importable, into Megatron's own ``load_checkpoint``
   (``tools/make_megatron_fixtures.py --check-load``) without --finetune.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.megatron import LegacyReader
from megalite.checkpoint.megatron.distopt import flat_layout, read_distrib_optim
from megalite.checkpoint.megatron.legacy import load_megatron_file
from megalite.core.parallel_state import ParallelState
from megalite.training import checkpoint_io
from megalite.training.forward_step import make_forward_step
from tests import paths
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import assert_close_rel, config, trainer_and_data

FIXTURES = str(paths.FIXTURES / "megatron_ckpt")
REL = 1e-5
MODEL = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --ffn-hidden-size 48 --seq-length 16 --max-position-embeddings 16 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --vocab-size 127 --make-vocab-size-divisible-by 16 "
    "--global-batch-size 4 --micro-batch-size 2 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 "
    "--train-iters 4 --weight-decay 0.1 --clip-grad 1.0"
).split()
FORMATS = {"torch": "legacy_tp2_pp2", "torch_dist": "dist_tp2_pp2"}
# the checkpoints Megatron wrote: both formats, and the torch format with its distributed optimizer
SOURCES = {**FORMATS, "torch+distrib_optim": "legacy_distopt_tp2_pp2_dp2"}


def _reference() -> dict:
    return torch.load(os.path.join(FIXTURES, "reference.pt"), weights_only=True)


def _logits(trainer, tokens: torch.Tensor, ps: ParallelState) -> torch.Tensor | None:
    """The full-vocabulary logits of the last stage (None elsewhere); PP by hand, no schedule."""
    module = trainer.model[0].module
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        hidden = None
        if not module.pre_process:
            shape = (tokens.shape[1], tokens.shape[0], module.config.hidden_size)
            hidden = torch.empty(shape, dtype=module.config.params_dtype)
            dist.recv(hidden, src=ps.ranks("pp")[ps.pp_rank - 1])
            module.set_input_tensor(hidden)
        out = module(tokens, positions)
        if not module.post_process:
            dist.send(out.contiguous(), dst=ps.ranks("pp")[ps.pp_rank + 1])
            return None
    if ps.tp_size > 1:
        parts = [torch.empty_like(out) for _ in range(ps.tp_size)]
        dist.all_gather(parts, out.contiguous(), group=ps.tp_group)
        out = torch.cat(parts, dim=-1)
    return out[..., : module.config.vocab_size]


def _load(fmt_dir: str, ps: ParallelState, *extra: str, world_size: int = 1, rank: int = 0):
    cfg = config(
        *MODEL, "--load", os.path.join(FIXTURES, fmt_dir), *extra, world_size=world_size, rank=rank
    )
    trainer, data = trainer_and_data(cfg, ps)
    loaded = checkpoint_io.load_checkpoint(trainer)
    return trainer, data, loaded


def _case(layouts_extra: list[str]) -> dict:
    """On this world: load each format, logits, then two more iterations."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flags = layouts_extra
    tp = int(flags[flags.index("--tensor-model-parallel-size") + 1])
    pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1])
    ps = mesh(tp, pp)
    out = {}
    try:
        ref = _reference()
        for fmt, name in SOURCES.items():
            trainer, data, loaded = _load(name, ps, *flags, world_size=world, rank=rank)
            logits = _logits(trainer, ref["tokens"], ps)
            result = trainer.train(make_forward_step(torch.device("cpu")), data)
            out[fmt] = (
                None if logits is None else logits.clone(),
                loaded.progress,
                result.losses,
            )
    finally:
        ps.destroy()
    return out


def _check_logits(logits: torch.Tensor, what: str) -> None:
    ref = _reference()["logits"]
    err = ((logits - ref).abs().max() / ref.abs().max()).item()
    assert err < REL, f"{what}: logits differ from Megatron's by {err:.2e} (relative)"


def test_megatron_checkpoints_load_at_any_layout_and_continue():
    single = ParallelState.single()
    losses = {}
    for fmt, name in SOURCES.items():
        trainer, data, loaded = _load(name, single)
        _check_logits(_logits(trainer, _reference()["tokens"], single), f"{fmt} at TP1 PP1")
        assert loaded.progress.iteration == 2 and loaded.progress.consumed_train_samples == 8
        assert trainer.scheduler.num_steps == 2
        losses[fmt] = trainer.train(make_forward_step(torch.device("cpu")), data).losses
        assert len(losses[fmt]) == 2, losses[fmt]
    for fmt in SOURCES:
        assert_close_rel(losses[fmt], losses["torch"], REL, f"{fmt} vs torch at TP1")
    fresh_trainer, fresh_data, _ = _load(FORMATS["torch"], single, "--no-load-optim")
    fresh = fresh_trainer.train(make_forward_step(torch.device("cpu")), fresh_data).losses
    gap = max(abs(a - b) / abs(b) for a, b in zip(fresh, losses["torch"]))
    assert gap > 10 * REL, f"the Megatron optimizer state makes no difference ({gap})"

    tp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"]
    pp2 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
    dp2 = [
        *"--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1".split(),
        "--use-distributed-optimizer",
    ]
    for flags, what in ((tp2, "TP2 PP1"), (pp2, "TP1 PP2"), (dp2, "DP2 ZeRO-1")):
        results = run_distributed(_case, 2, flags, timeout=600)
        for fmt in SOURCES:
            logits, progress, got = results[-1][fmt]
            _check_logits(logits, f"{fmt} at {what}")
            assert progress.iteration == 2 and progress.consumed_train_samples == 8
            assert_close_rel(got, losses["torch"], REL, f"{fmt} continued at {what}")


def test_distrib_optim_is_megatrons_adam_state_by_name():
    """The flat, bucketed ranges of ``distrib_optim.pt`` (stage 0 in 540-element buckets, one
    closing right after a norm; the other stage in one bucket) decode to exactly the per-parameter
    Adam state Megatron's plain optimizer saved for the same run; a reader that ignored a bucket
    rule would find other sizes, and is refused in one line, not left to misread."""
    plain = LegacyReader(os.path.join(FIXTURES, FORMATS["torch"], "iter_0000002"))
    flat = LegacyReader(os.path.join(FIXTURES, SOURCES["torch+distrib_optim"], "iter_0000002"))
    assert flat.distributed_optimizer and flat.has_optimizer()
    for t in range(2):
        for p in range(2):
            want, got = plain.optimizer_state(t, p), flat.optimizer_state(t, p)
            assert got["step"] == want["step"] == 2
            assert got["params"].keys() == want["params"].keys()
            for name, state in want["params"].items():
                for key, tensor in state.items():
                    assert torch.equal(got["params"][name][key], tensor), (t, p, name, key)
    model = plain.shard(0, 0)["model"]
    params = [(n, v.numel()) for n, v in model.items() if isinstance(v, torch.Tensor)]
    assert flat_layout(params, bucket_size=None)[1] != flat_layout(params, bucket_size=540)[1]
    raw = dict(flat._raw_shard(0, 0))
    raw["args"] = argparse.Namespace(**{**vars(raw["args"]), "overlap_grad_reduce": False})
    with pytest.raises(CheckpointError, match="grad buffer holds") as e:
        read_distrib_optim(flat.path(0, 0, "distrib_optim.pt"), raw, tp_rank=0, pp_rank=0)
    assert "\n" not in str(e.value)
    raw = dict(flat._raw_shard(0, 1))  # stage 1: one bucket whatever --ddp-bucket-size says
    read_distrib_optim(flat.path(0, 1, "distrib_optim.pt"), raw, tp_rank=0, pp_rank=1)


# what megalite writes: each format, and the torch format of a --use-distributed-optimizer run
WRITES = {"torch": [], "torch_dist": [], "torch+distrib_optim": ["--use-distributed-optimizer"]}


def test_megalite_writes_megatron_formats_that_load_back(tmp_path):
    """--ckpt-format torch / torch_dist: megalite's files of the loaded fixture load back into
    megalite with the same logits and counters; under --use-distributed-optimizer the torch format
    holds Megatron's distributed-optimizer form (``distrib_optim.pt``), whose Adam state reads
    back equal to the plain form's."""
    single = ParallelState.single()
    for what, extra in WRITES.items():
        save = str(tmp_path / what)
        fmt = what.split("+")[0]
        trainer, _, _ = _load(
            FORMATS["torch"], single, "--save", save, "--ckpt-format", fmt, *extra
        )
        checkpoint_io.save_checkpoint(trainer)
        back, _, loaded = _load("", single, "--load", save)
        assert loaded.progress.iteration == 2 and loaded.progress.consumed_train_samples == 8
        _check_logits(_logits(back, _reference()["tokens"], single), f"megalite {what} back")
    shard = os.path.join("iter_0000002", "mp_rank_00")
    assert not os.path.exists(tmp_path / "torch" / shard / "distrib_optim.pt")
    assert os.path.isfile(tmp_path / "torch+distrib_optim" / shard / "distrib_optim.pt")
    plain = LegacyReader(str(tmp_path / "torch" / "iter_0000002")).optimizer_state(0, 0)
    flat = LegacyReader(str(tmp_path / "torch+distrib_optim" / "iter_0000002"))
    assert flat.distributed_optimizer
    got = flat.optimizer_state(0, 0)
    assert got["step"] == plain["step"] == 2 and got["params"].keys() == plain["params"].keys()
    for name, state in plain["params"].items():
        for key, tensor in state.items():
            assert torch.equal(got["params"][name][key], tensor), (name, key)


def _megatron_importable() -> bool:
    try:
        import megatron.core  # noqa: F401
        import megatron.training.checkpointing  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _megatron_importable(), reason="megatron-core/Megatron-LM not importable")
def test_megalite_files_load_in_megatrons_loader(tmp_path):
    """Megatron's own ``load_checkpoint`` (no --finetune) of megalite's files: the logits of the
    source model, and the Adam state megalite wrote (by name), also through Megatron's
    distributed optimizer from ``distrib_optim.pt``."""
    single = ParallelState.single()
    tool = str(paths.ROOT / "tools" / "make_megatron_fixtures.py")
    for what, extra in WRITES.items():
        save = str(tmp_path / what)
        fmt = what.split("+")[0]
        # the schedule of the Megatron run that loads it (tools/make_megatron_fixtures.py)
        trainer, _, _ = _load(
            FORMATS["torch"],
            single,
            "--save",
            save,
            "--ckpt-format",
            fmt,
            "--train-iters",
            "10",
            *extra,
        )
        checkpoint_io.save_checkpoint(trainer)
        shutil.copy(os.path.join(FIXTURES, "reference.pt"), os.path.join(save, "reference.pt"))
        flags = ["--distributed-optimizer"] if extra else []
        proc = subprocess.run(
            [
                sys.executable,
                "-W",
                "ignore",
                tool,
                "--check-load",
                save,
                "--ckpt-format",
                fmt,
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "= megalite's: yes" in proc.stdout, proc.stdout[-2000:]


def test_a_corrupt_megatron_file_is_one_line(tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIXTURES, FORMATS["torch"]), bad)
    path = bad / "iter_0000002" / "mp_rank_01_001" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[:4000])
    with pytest.raises(CheckpointError, match="Megatron checkpoint") as e:
        _load("", ParallelState.single(), "--load", str(bad))
    assert "\n" not in str(e.value)


_ = tempfile


# what Megatron's load_checkpoint reads from ``args`` (check_checkpoint_args, the counters)
LOADER_ARGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "max_position_embeddings",
    "make_vocab_size_divisible_by",
    "padded_vocab_size",
    "tokenizer_type",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "data_parallel_random_init",
    "global_batch_size",
    "consumed_train_samples",
    "consumed_valid_samples",
    "use_distributed_optimizer",
    "ckpt_format",
)


def test_megalite_files_have_the_structure_of_megatrons(tmp_path):
    """Where megatron-core is not installed (CI): megalite's ``--ckpt-format`` files hold what
    Megatron's own save path wrote for the same model (the fixtures), entry for entry: the keys of
    each file, the model's tensor names, the scheduler, the optimizer's nesting and param-group
    keys (Megatron matches groups by them), ``distrib_optim.pt``'s buffers, the ``torch_dist``
    tensor keys and ``common.pt``; and the ``args`` Megatron's loader reads. The load through
    megatron-core itself is ``test_megalite_files_load_in_megatrons_loader``."""
    import re

    import torch.distributed.checkpoint as dcp

    single = ParallelState.single()
    for what, extra in WRITES.items():
        trainer, _, _ = _load(
            FORMATS["torch"],
            single,
            "--save",
            str(tmp_path / what),
            "--ckpt-format",
            what.split("+")[0],
            *extra,
        )
        checkpoint_io.save_checkpoint(trainer)
    layer = re.compile(r"decoder\.layers\.\d+\.")
    for what in ("torch", "torch+distrib_optim"):
        mine_dir = tmp_path / what / "iter_0000002" / "mp_rank_00"
        src = os.path.join(FIXTURES, SOURCES[what], "iter_0000002")
        mine = load_megatron_file(str(mine_dir / "model_optim_rng.pt"))
        theirs = [
            load_megatron_file(os.path.join(src, f"mp_rank_00_00{p}", "model_optim_rng.pt"))
            for p in (0, 1)
        ]
        assert set(mine) == set(theirs[0]), what
        names = {layer.sub("decoder.layers.*.", k) for t in theirs for k in t["model"]}
        assert {layer.sub("decoder.layers.*.", k) for k in mine["model"]} == names, what
        assert set(mine["opt_param_scheduler"]) == set(theirs[0]["opt_param_scheduler"])
        mo, to = mine["optimizer"], theirs[0]["optimizer"]
        assert set(mo) == set(to), what
        mi, ti = mo.get("optimizer", mo), to.get("optimizer", to)
        assert set(mi) == set(ti) and len(mi["param_groups"]) == len(ti["param_groups"]), what
        for mg, tg in zip(mi["param_groups"], ti["param_groups"]):
            assert set(mg) == set(tg), (what, set(mg) ^ set(tg))
        args = vars(mine["args"])
        missing = [a for a in LOADER_ARGS if a not in args]
        assert not missing, (what, missing)
        assert args["use_distributed_optimizer"] == ("distrib" in what)
    mine = torch.load(
        tmp_path / "torch+distrib_optim" / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt",
        weights_only=True,
    )
    src = os.path.join(FIXTURES, SOURCES["torch+distrib_optim"], "iter_0000002", "mp_rank_00_000")
    theirs = torch.load(os.path.join(src, "distrib_optim.pt"), weights_only=True)
    assert set(mine) == set(theirs) and list(mine[0]) == list(theirs[0])
    assert set(next(iter(mine[0].values()))) == set(next(iter(theirs[0].values())))

    def keys(folder):
        index = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        return {k for k in index if not k.startswith("rng_state/")}  # rng shards name the layout

    dist = tmp_path / "torch_dist" / "iter_0000002"
    src = os.path.join(FIXTURES, FORMATS["torch_dist"], "iter_0000002")
    assert keys(dist) == keys(src)
    common = load_megatron_file(str(dist / "common.pt"))
    assert set(common) == set(load_megatron_file(os.path.join(src, "common.pt")))
    assert not [a for a in LOADER_ARGS if a not in vars(common["args"])]
