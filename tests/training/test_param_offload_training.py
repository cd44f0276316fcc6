"""ZeRO-Infinity in the real training loop: ZeRO-3 with its parameter shards on the host
(``--param-cpu-offload``) or in files (``--param-offload-dir``), and with the whole optimizer state
offloaded (which puts the reduced grad shards on the host too), against the same run without
offload.

- fp32, both families at DP 2 (2 ranks); GPT-2 at TP2 x DP2 with sequence parallel and Llama at
  PP2 x DP2 (4 ranks):
  the 5 losses and grad norms of each offload equal those of ZeRO-3 without offload within 1e-6
  (the same arithmetic in another place; only the order of nothing changes, so in practice they
  are equal), and the params' file holds the params.
- bf16 (DP 2, GPT-2): each offload equals bf16 ZeRO-3 without offload within 1e-6.
- flags: invalid combinations are refused in one line naming the flags.
- the memory report (DP 2, GPT-2; params and optimizer on the host in bf16, in files in bf16 and
  fp32): nothing of the model state on the device; params, grads and optimizer state on the host
  or disk at their theory (fp32 params in files are the master file: counted once), equal to the
  bytes counted from the storages and files.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megalite.core.optimizer.memory_report import log_model_state_memory
from megalite.training.config import ConfigError
from megalite.training.pretrain import build_run
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, assert_close_rel, config, train_losses

REL = 1e-6
ZERO3 = ("--zero-stage", "3", "--ddp-bucket-size", "3000")
LAYOUTS = {
    2: [()],
    4: [
        ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
        ("--pipeline-model-parallel-size", "2"),
    ],
}


def offloads(tmp: str, rank: int) -> dict[str, tuple[str, ...]]:
    """The offload flags of each case (files under ``tmp``, one directory per rank and case)."""
    return {
        "param cpu": ("--param-cpu-offload",),
        "param cpu + optimizer cpu (grads on the host)": (
            "--param-cpu-offload",
            "--optimizer-cpu-offload",
        ),
        "param nvme + optimizer nvme (grads on the host)": (
            "--param-offload-dir",
            f"{tmp}/param{rank}",
            "--param-offload-host-memory-mb",
            "0.001",  # 1 KiB of staging: every unit streamed in several chunks
            "--optimizer-offload-dir",
            f"{tmp}/optim{rank}",
            "--optimizer-offload-host-memory-mb",
            "0.01",
        ),
    }


def offload_case(tmp: str, cases: list[tuple[str, tuple[str, ...]]]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for family, flags in cases:
        for name, extra in {"none": (), **offloads(tmp, rank)}.items():
            cfg = config(*FAMILIES[family], *ZERO3, *flags, *extra, world_size=world, rank=rank)
            ps = mesh(
                cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
            )
            try:
                result = train_losses(cfg, ps)
            finally:
                ps.destroy()
            files = sorted(os.listdir(f"{tmp}/param{rank}")) if "nvme" in name else []
            out[family, flags, name] = (ps.is_last_stage, result.losses, result.grad_norms, files)
    return out


def _check(rank_outs: list[dict]) -> int:
    checked = 0
    for out in rank_outs:
        for (family, flags, name), (last, losses, norms, files) in out.items():
            _, want_losses, want_norms, _ = out[family, flags, "none"]
            what = f"{family} {flags} {name}"
            if last:
                assert_close_rel(losses, want_losses, REL, f"{what} loss")
            assert_close_rel(norms, want_norms, REL, f"{what} norm")
            if "nvme" in name:
                assert files and all(f.endswith(".param") for f in files), (what, files)
            checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 4], ids=["dp2", "tp2_dp2_sp_and_pp2_dp2"])
def test_param_and_grad_offload_train_like_zero3_without_offload(tmp_path, world):
    # DP 2: both families; 4 ranks: GPT-2 under TP 2 x SP, Llama under PP 2 (each family meets a
    # 4-rank layout; every family and layout the four offloads)
    families = sorted(FAMILIES)
    if world == 2:
        cases = [(family, flags) for flags in LAYOUTS[world] for family in families]
    else:
        cases = list(zip(families, LAYOUTS[world], strict=True))
    assert _check(run_distributed(offload_case, world, str(tmp_path), cases, timeout=900))


def test_bf16_offload_equals_bf16_without(tmp_path):
    cases = [("gpt2", ("--bf16",))]
    assert _check(run_distributed(offload_case, 2, str(tmp_path), cases, timeout=900))


def test_flags_refuse_invalid_param_offload_in_one_line(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    for flags, words in [
        (["--zero-stage", "2", "--param-cpu-offload"], "--zero-stage 3"),
        (["--zero-stage", "3", "--param-offload-dir", str(tmp_path)], "--optimizer-offload-dir"),
        (
            ["--zero-stage", "3", "--optimizer-cpu-offload", "--param-offload-dir", str(blocked)],
            "not a writable directory",
        ),
        (
            "--zero-stage 3 --param-cpu-offload --param-offload-host-memory-mb 0".split(),
            "--param-offload-host-memory-mb must be > 0",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            config(*flags)
        assert words in str(e.value) and "\n" not in str(e.value), (flags, str(e.value))
    par = config("--zero-stage", "3", "--optimizer-cpu-offload").parallel
    assert par.grad_offload and not par.param_offload


def memory_case(tmp: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = {
        "cpu bf16": ("--bf16", "--param-cpu-offload", "--optimizer-cpu-offload"),
        "nvme bf16": (
            "--bf16",
            *offloads(tmp, rank)["param nvme + optimizer nvme (grads on the host)"],
        ),
        "nvme fp32": offloads(f"{tmp}/fp32", rank)[
            "param nvme + optimizer nvme (grads on the host)"
        ],
    }
    out = {}
    for name, flags in cases.items():
        cfg = config(*FAMILIES["gpt2"], *ZERO3, *flags, world_size=world, rank=rank)
        ps = mesh(1, 1)
        try:
            run = build_run(cfg, ps, torch.device("cpu"), resume=False)
            model, opt = run.trainer.model[0].grad_wrapper, run.trainer.optimizer
            s = log_model_state_memory(model, opt, ps)[rank]
            files = [f.path for f in model.param_store.files]
            counted = {
                "params_disk": sum(os.path.getsize(p) for p in files),
                "params_host": sum(t.untyped_storage().nbytes() for t in model.param_store.host),
                "grads_host": sum(b.data.untyped_storage().nbytes() for b in model.grad_buffers),
            }
        finally:
            ps.destroy()
        out[name] = (s, counted)
    return out


def test_memory_report_shows_params_grads_and_optimizer_in_each_tier(tmp_path):
    dp = 2
    for rank_out in run_distributed(memory_case, dp, str(tmp_path), timeout=900):
        for name, (s, counted) in rank_out.items():
            phi, p = s.num_params, (2 if "bf16" in name else 4)
            pad = 4 * 18 * (phi // 3000 + 16)  # < dp elements per bucket, 18 bytes each
            steps = 4 * 64
            assert s.stage == 3 and s.params == 0 and s.grads == 0, (name, s)  # all offloaded
            assert s.master + s.optimizer <= steps, (name, s)  # step counters only
            assert abs(s.total - s.theory) <= pad + steps, (name, s)
            assert counted["grads_host"] == s.grads_host, (name, s)
            assert abs(s.grads_host - 4 * phi / dp) <= pad, (name, s)
            if name == "cpu bf16":
                assert counted["params_host"] == s.params_host and s.params_disk == 0, (name, s)
                assert abs(s.params_host - p * phi / dp) <= pad, (name, s)
                assert abs(s.host - 12 * phi / dp) <= pad and s.disk == 0, (name, s)
                off = s.params_host + s.grads_host + s.host
            else:  # fp32 params in files are the master file: counted once, as params
                assert counted["params_disk"] == s.params_disk, (name, s)
                assert abs(s.params_disk - p * phi / dp) <= pad, (name, s)
                master = 4 if p == 2 else 0
                assert abs(s.disk - (8 + master) * phi / dp) <= pad, (name, s)
                assert s.params_host <= 2 * int(0.001 * 2**20), (name, s)  # the staging bound
                off = s.params_disk + s.grads_host + s.disk
            assert abs(off - s.theory_off) <= pad, (name, off, s.theory_off)
