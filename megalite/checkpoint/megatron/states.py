"""megalite's RNG states and scheduler position <-> Megatron-LM's, both ways.

RNG: Megatron's ``rng_state`` entry of one rank (Python ``random``, numpy, torch CPU, CUDA and the
tracker's states under its names) <-> megalite's form (``records.capture_rng_state``). Scheduler:
Megatron counts its position (``num_steps``) in samples, ``--rampup-batch-size`` included; megalite
in global batches of the final size (fractional during a ramp).
"""

from __future__ import annotations

import numpy as np
import torch

from megalite.core.tensor_parallel.random import TP_RNG


def _is_cpu_state(state) -> bool:
    return isinstance(state, torch.Tensor) and state.numel() == torch.get_rng_state().numel()


def rng_state_from_megatron(entry: dict) -> dict:
    """One rank's Megatron ``rng_state`` entry -> megalite's form (``records.capture_rng_state``);
    ``rng_state_to_megatron``'s inverse.

    The device generator and the tracker's ``"tensor-parallel"`` state (Megatron's
    ``"model-parallel-rng"``: per TP rank, shared over DP, as megalite's) are CUDA states when
    Megatron ran on GPUs; on a CPU run (megalite's, or Megatron's under the fixtures' workaround)
    they are CPU generator states and the default generator is torch's CPU one."""
    py = entry["random_rng_state"]
    n = entry["np_rng_state"]
    cuda = entry.get("cuda_rng_state")
    tracker = (entry.get("rng_tracker_states") or {}).get("model-parallel-rng")
    return {
        "torch_cpu": entry["torch_rng_state"],
        "cuda": None if cuda is None or _is_cpu_state(cuda) else cuda,
        "tracker": None if tracker is None else {TP_RNG: tracker},
        "python": (py[0], tuple(py[1]), py[2]),
        "numpy": {
            "kind": n[0],
            "keys": torch.from_numpy(np.asarray(n[1]).astype(np.int64)),
            "pos": int(n[2]),
            "has_gauss": int(n[3]),
            "cached_gaussian": float(n[4]),
        },
    }


def scheduler_steps_from_samples(samples, samples_per_step: int) -> int | float:
    """Megatron's scheduler position (``num_steps``: samples consumed, ``--rampup-batch-size``
    included) -> megalite's (global batches of the final size; fractional during a ramp)."""
    steps = int(samples) / int(samples_per_step)
    return int(steps) if steps.is_integer() else steps


def scheduler_samples_from_steps(num_steps: int | float, samples_per_step: int) -> int:
    """megalite's scheduler position -> Megatron's, in samples (``scheduler_steps_from_samples``'s
    inverse)."""
    return int(round(float(num_steps) * int(samples_per_step)))


def rng_state_to_megatron(state: dict) -> dict:
    """One rank's megalite RNG states -> Megatron's ``rng_state`` entry."""
    py = state["python"]
    n = state["numpy"]
    cpu = state["torch_cpu"]
    tracker = state.get("tracker") or {}
    tp_state = next(iter(tracker.values()), cpu) if tracker else cpu
    return {
        "random_rng_state": (py[0], tuple(py[1]), py[2]),
        "np_rng_state": (
            n["kind"],
            n["keys"].numpy().astype(np.uint32),
            int(n["pos"]),
            int(n["has_gauss"]),
            float(n["cached_gaussian"]),
        ),
        "torch_rng_state": cpu,
        "cuda_rng_state": state.get("cuda") if state.get("cuda") is not None else cpu,
        "rng_tracker_states": {
            "model-parallel-rng": tp_state,
            "data-parallel-rng": state.get("cuda") if state.get("cuda") is not None else cpu,
            "expert-parallel-rng": tp_state,
        },
    }


def scheduler_to_megatron(meta: dict) -> dict | None:
    """megalite's scheduler (iterations) -> Megatron's OptimizerParamScheduler state (samples)."""
    s = meta.get("scheduler")
    if s is None:
        return None
    config = meta.get("config", {})
    gbs = int(config.get("training", {}).get("global_batch_size", 1))
    train_iters = int(config.get("training", {}).get("train_iters", s["decay_iters"]))
    wd = float(config.get("optimizer", {}).get("weight_decay", 0.0))
    return {
        "max_lr": s["max_lr"],
        "lr_warmup_steps": s["warmup_iters"] * gbs,
        "num_steps": scheduler_samples_from_steps(s["num_steps"], gbs),
        "lr_decay_style": s["decay_style"],
        "lr_decay_steps": s["decay_iters"] * gbs,
        "min_lr": s["min_lr"],
        "start_wd": wd,
        "end_wd": wd,
        "wd_incr_style": "constant",
        "wd_incr_steps": train_iters * gbs,
    }
