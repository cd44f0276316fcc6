"""The planner's model-state bytes under ZeRO-3 offload against measurement, byte for byte, on
every rank of a DP 2 world (GPT-2, and Llama in bf16 with files): params on the host or in files
(fp32 and bf16), with the optimizer state on the host or in files (grads then on the host), and the
optimizer offloaded without the params. Every field of ``memory_report.ModelStateBytes`` but the
theory is compared: device, host and disk bytes of params, grads and optimizer state.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megalite.core.optimizer.memory_report import model_state_bytes
from megalite.planning.predict import predict_for_config
from megalite.training.pretrain import build_run, mesh_for
from tests.harness import run_distributed
from tests.training.common import FAMILIES, config


def cases(tmp: str, rank: int) -> dict[str, tuple[str, ...]]:
    files = (
        *("--param-offload-dir", f"{tmp}/p{rank}", "--param-offload-host-memory-mb", "0.01"),
        *(
            "--optimizer-offload-dir",
            f"{tmp}/o{rank}",
            "--optimizer-offload-host-memory-mb",
            "0.02",
        ),
    )
    return {
        "params host": ("--zero-stage", "3", "--param-cpu-offload"),
        "params + optimizer host bf16": (
            *("--zero-stage", "3", "--bf16", "--param-cpu-offload", "--optimizer-cpu-offload"),
        ),
        "params + optimizer host fp32": (
            *("--zero-stage", "3", "--param-cpu-offload", "--optimizer-cpu-offload"),
        ),
        "params + optimizer files fp32": ("--zero-stage", "3", *files),
        "params + optimizer files bf16 llama": (
            "--zero-stage",
            "3",
            "--bf16",
            *FAMILIES["llama"],
            *files,
        ),
        "optimizer files only": ("--zero-stage", "3", *files[4:]),
        "optimizer host half": (
            *(
                "--zero-stage",
                "3",
                "--optimizer-cpu-offload",
                "--optimizer-offload-fraction",
                "0.5",
            ),
        ),
    }


def prediction_case(tmp: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, flags in cases(tmp, rank).items():
        cfg = config(*flags, world_size=world, rank=rank)
        ps = mesh_for(cfg.parallel)
        try:
            run = build_run(cfg, ps, torch.device("cpu"), resume=False)
            trainer = run.trainer
            measured = model_state_bytes(
                trainer.model[0].grad_wrapper, trainer.optimizer, dp_size=ps.dp_size
            )
            predicted = predict_for_config(
                cfg, dp=ps.dp_size, dp_ranks=[ps.rank("dp")], device="cpu"
            )
            (mine,) = [r.state for r in predicted if r.pp_rank == ps.pp_rank]
        finally:
            ps.destroy()
        bare = dict(theory=0, theory_off=0)
        out[name] = tuple(dataclasses.replace(s, **bare) for s in (measured, mine))
    return out


def test_offloaded_model_state_prediction_matches_measurement(tmp_path):
    for rank, per_rank in enumerate(
        run_distributed(prediction_case, 2, str(tmp_path), timeout=900)
    ):
        for name, (measured, predicted) in per_rank.items():
            assert measured == predicted, (name, rank, measured, predicted)
        files = per_rank["params + optimizer files fp32"][0]
        assert files.params_disk and files.disk and files.grads_host and not files.params, files
