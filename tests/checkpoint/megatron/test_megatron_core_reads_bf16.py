"""megatron-core's own loaders read megalite's bf16 checkpoints. megatron-core is in the test
extra (``pip install -e .[test]``, pinned; it imports on CPU without Apex or Transformer Engine);
Megatron-LM is not needed. Without it the test skips, except under ``CI=true``, where it fails.
All of it is one 4-rank case, so each rank imports megatron-core once.

megalite, on 4 CPU ranks with ``--bf16``, loads the bf16 fixture (``test_bf16_fixtures``), trains
one iteration (so the state is megalite's own: its bf16 step with fp32 grads and masters) and
saves iteration 3: at TP 2 x PP 2 in ``--ckpt-format torch`` and ``torch_dist``, and at TP 1 x
PP 2 x DP 2 with ``--use-distributed-optimizer`` (its 540-element grad buckets) in ``torch``
(``distrib_optim.pt``). Each rank keeps what it holds: bf16 parameters, fp32 masters and Adam
moments by name, the step, the last stage's logits of fixed tokens.

Then megatron-core alone, on the same ranks and layout (``tools/megatron_on_cpu.py``: its
``GPTModel`` of the fixtures' model in a ``Float16Module``, its DDP and optimizers; the CPU
patches undone afterwards), loads each as Megatron-LM's ``load_checkpoint`` does, through
megatron-core's APIs only: the legacy file's ``model`` into the model's ``state_dict`` and its
``optimizer`` into ``Float16OptimizerWithFloat16Params.load_state_dict`` (masters from
``fp32_from_fp16_params``); ``distrib_optim.pt`` through ``DistributedOptimizer.
load_parameter_state`` (each DP rank its range); ``torch_dist`` through
``dist_checkpointing.load`` of the model's and the optimizer's ``sharded_state_dict``. Every rank
must then hold exactly what megalite held: each bf16 parameter, each fp32 master, ``exp_avg``,
``exp_avg_sq`` (over the DP rank's range) and the step; the logits equal megalite's within bf16
rounding (the two frameworks' kernels sum in other orders).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

from megalite.training import checkpoint_io
from megalite.training.forward_step import make_forward_step
from tests.checkpoint.megatron.test_bf16_fixtures import (
    BF16,
    LOGITS_REL,
    SOURCES,
    load,
    reference,
)
from tests.checkpoint.megatron.test_formats import _logits
from tests.harness import run_distributed
from tests.mesh import mesh
from tools.megatron_on_cpu import (
    adam_shards,
    build_core,
    core_configs,
    gpt_model,
    megatron_core_on_cpu,
)

# megatron-core is a test dependency (pyproject's test extra); found without importing it here
# (its import costs seconds of CPU: only the ranks that run it pay)
MISSING = importlib.util.find_spec("megatron.core") is None
# CI installs the test extra, so there a missing megatron-core fails the test instead
pytestmark = pytest.mark.skipif(
    MISSING and os.environ.get("CI", "").lower() != "true",
    reason="megatron-core is not installed (pip install -e .[test] installs it)",
)

ITER = "iter_0000003"
# the runs: megalite's layout (TP, PP) and flags, and the formats it saves
RUNS = {
    "plain": ((2, 2), "torch", ("torch", "torch_dist")),
    "distopt": ((1, 2), "torch+distrib_optim", ("torch",)),
}


def _megalite_saves(root: str, tp: int, pp: int, source: str, formats: tuple) -> dict:
    """One rank of megalite: the bf16 fixture ``source`` loaded at TP x PP, one iteration, saved
    in ``formats``; returns what this rank holds."""
    ps = mesh(tp, pp)
    name, extra = SOURCES[source]
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    flags = [*layout, *extra, "--train-iters", "3"]
    try:
        trainer, data, _ = load(
            os.path.join(BF16, name), ps, *flags, world_size=4, rank=dist.get_rank()
        )
        trainer.train(make_forward_step(torch.device("cpu")), data)
        for fmt in formats:
            trainer.cfg.training.ckpt_format = fmt
            checkpoint_io.save_checkpoint(trainer, save_dir=os.path.join(root, f"{source}-{fmt}"))
        full = trainer.optimizer.full_state_dict()  # a collective over DP
        logits = _logits(trainer, reference()["tokens"], ps)
        return {
            "coords": (ps.tp_rank, ps.pp_rank, ps.rank("dp")),
            "params": {
                n: p.detach().clone() for n, p in trainer.model[0].module.named_parameters()
            },
            "adam": full["params"],
            "step": full["step"],
            "logits": None if logits is None else logits.float(),
        }
    finally:
        ps.destroy()


def _megatron_core_loads(iter_dir: str, fmt: str, tp: int, pp: int, distopt: bool, want: dict):
    """One rank of megatron-core: the model and optimizer at TP x PP (DP what is left), ``iter_dir``
    loaded through megatron-core's APIs (module doc); returns where this rank differs from what
    megalite's same rank held (``want``), the Adam elements it owns and the logits' relative
    error on the last stage (None elsewhere)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu

    with megatron_core_on_cpu():
        config, ddp_config, opt_config = core_configs(
            tp, pp, bf16=True, distributed_optimizer=distopt
        )
        if distopt:
            ddp_config.overlap_grad_reduce, ddp_config.bucket_size = True, 540
        ddp, optimizer = build_core(config, ddp_config, opt_config, tp=tp, pp=pp, seed=1234)
        coords = (
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_data_parallel_rank(),
        )
        assert coords == want["coords"], (coords, want["coords"])
        shard = os.path.join(iter_dir, f"mp_rank_{coords[0]:02d}_{coords[1]:03d}")
        model = gpt_model(ddp)  # as Megatron-LM's load_checkpoint: the unwrapped model
        if fmt == "torch":
            raw = torch.load(os.path.join(shard, "model_optim_rng.pt"), weights_only=False)
            model.load_state_dict(raw["model"], strict=True)
            optimizer.load_state_dict(raw["optimizer"])
            if distopt:
                optimizer.load_parameter_state(os.path.join(shard, "distrib_optim.pt"))
        else:
            meta = dist_checkpointing.load_content_metadata(iter_dir) or {}
            meta["dp_cp_group"] = mpu.get_data_parallel_group(with_context_parallel=True)
            sharded = {"model": model.sharded_state_dict(metadata=meta)}
            sharded["optimizer"] = optimizer.sharded_state_dict(
                sharded, is_loading=True, metadata=meta
            )
            loaded = dist_checkpointing.load(sharded, iter_dir)
            model.load_state_dict(loaded["model"], strict=True)
            optimizer.load_state_dict(loaded["optimizer"])
        bad = []
        for name, param in model.named_parameters():
            if not torch.equal(param.detach(), want["params"][name]):
                bad.append(f"{name}.param")
        shards = adam_shards(ddp, optimizer)
        for name, got in shards.items():
            start, end = got["range"]
            for key in ("master", "exp_avg", "exp_avg_sq"):
                if not torch.equal(got[key], want["adam"][name][key].reshape(-1)[start:end]):
                    bad.append(f"{name}.{key}")
            if got["step"] != want["step"]:
                bad.append(f"{name}.step {got['step']} vs {want['step']}")
        owned = sum(end - start for s in shards.values() for start, end in [s["range"]])
        logits = _pipelined_logits(ddp, reference()["tokens"], tp)
    err = None
    if logits is not None:
        ref = want["logits"]
        err = ((logits - ref).abs().max() / ref.abs().max()).item()
    return bad, owned, err


def _pipelined_logits(ddp, tokens: torch.Tensor, tp: int) -> torch.Tensor | None:
    """megatron-core's forward of ``tokens`` through the pipeline by hand; the last stage's
    logits gathered over TP (None on other stages)."""
    from megatron.core import parallel_state as mpu

    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    model = ddp.module
    with torch.no_grad():
        if not mpu.is_pipeline_first_stage():
            hidden = torch.empty(tokens.shape[1], tokens.shape[0], 32, dtype=torch.bfloat16)
            dist.recv(hidden, src=mpu.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, positions, None)
        if not mpu.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
            return None
    parts = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(parts, out.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., : reference()["logits"].shape[-1]].float()


def _round_trip(root: str) -> list[tuple[str, list, int, float | None]]:
    """One rank: megalite's saves of each run (``RUNS``), then megatron-core's load of each file
    at the run's layout, compared with what megalite's same rank held. One case, so that the
    ranks import megatron-core once."""
    held = {
        run: _megalite_saves(root, tp, pp, source, formats)
        for run, ((tp, pp), source, formats) in RUNS.items()
    }
    dist.barrier()  # every rank's files are written
    out = []
    for run, ((tp, pp), source, formats) in RUNS.items():
        for fmt in formats:
            iter_dir = os.path.join(root, f"{source}-{fmt}", ITER)
            bad, owned, err = _megatron_core_loads(
                iter_dir, fmt, tp, pp, run == "distopt", held[run]
            )
            out.append((f"{fmt} ({run}, TP {tp} x PP {pp})", bad, owned, err))
    return out


def test_megatron_core_reads_megalites_bf16_files(tmp_path):
    assert not MISSING, "megatron-core is not installed (pip install -e .[test] installs it)"
    results = run_distributed(_round_trip, 4, str(tmp_path), timeout=600)
    for rank, loads in enumerate(results):
        for what, bad, owned, err in loads:
            what = f"megatron-core's load of megalite's {what}, rank {rank}"
            assert not bad, f"{what}: differs in {bad[:6]}"
            assert owned > 0, f"{what}: holds no Adam state"
            if err is not None:
                assert err < LOGITS_REL, f"{what}: logits differ by {err:.2e}"
