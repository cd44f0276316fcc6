"""``pretrain_gpt.py``'s side-by-side: the planner's prediction for the run's own layout, and what
the first training step measured, logged and written to TensorBoard.

    pretrain(cfg, first_step_hooks=[FirstStepComparison()])

As the first step starts, the prediction is logged; the step runs under a ``SavedTensorMeter``
on CPU (the saved-activation peak) and the model state is counted from the tensor storages
(``memory_report``); on CUDA the allocator's peak over the step is the measured figure (it
includes what the prediction leaves out: the logits' transient, workspace, fragmentation). Every
rank measures its own; the logging rank (the last) prints its line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from megalite.core.optimizer.memory_report import model_state_bytes
from megalite.measure.saved_tensors import SavedTensorMeter
from megalite.planning.activations import CP_MODELLED, MODELLED_SCHEDULES
from megalite.planning.predict import RankMemory, predict_for_config
from megalite.training.config import PretrainConfig
from megalite.training.model_chunks import grad_wrappers
from megalite.training.pipeline_config import effective_schedule
from megalite.training.trainer import FirstStepHook, Trainer

logger = logging.getLogger(__name__)
MIB = 2**20


def uncovered_features(cfg: PretrainConfig) -> list[str]:
    """The features of ``cfg`` the planner does not model: a prediction that ignored them would
    be silently wrong, so they are named instead."""
    par, out = cfg.parallel, []
    if par.optimizer_offload_dir is not None:
        out.append("--optimizer-offload-dir (NVMe offload)")
    if par.context_parallel_size > 1 and cfg.model.cp_comm_type not in CP_MODELLED:
        out.append(f"--cp-comm-type {cfg.model.cp_comm_type}")
    if par.pipeline_model_parallel_size > 1 and effective_schedule(cfg) not in MODELLED_SCHEDULES:
        out.append(f"--pipeline-schedule {effective_schedule(cfg)}")
    return out


def predicted_for_rank(trainer: Trainer) -> RankMemory:
    """The prediction for this rank of the trainer's run (NotImplementedError for a layout with
    features the planner does not model)."""
    missing = uncovered_features(trainer.cfg)
    if missing:
        raise NotImplementedError(f"the planner does not model {', '.join(missing)} yet")
    ps = trainer.ps
    rows = predict_for_config(
        trainer.cfg,
        dp=ps.dp_size,
        dp_ranks=[ps.rank("dp", "cp")],
        device=trainer.device.type,
        edp_rank=ps.rank("edp"),
    )
    return next(r for r in rows if r.pp_rank == ps.pp_rank)


class FirstStepComparison(FirstStepHook):
    """Logs the prediction as the first step starts and the measured figures beside it when it
    ends (module docstring). A layout the planner cannot predict still trains: the hook then says
    so and measures nothing."""

    def around_first_step(self, trainer: Trainer) -> AbstractContextManager[None]:
        return self._watch(trainer)

    @contextmanager
    def _watch(self, trainer: Trainer) -> Iterator[None]:
        try:
            predicted = predicted_for_rank(trainer)
        except Exception as e:  # noqa: BLE001 - a layout the planner does not cover must train
            logger.info("planner: no prediction for this layout (%s: %s)", type(e).__name__, e)
            yield
            return
        _log_prediction(trainer, predicted)
        wrapper = grad_wrappers(trainer.model)[0]  # the chunks of a rank share one
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.device)
            yield
            measured_act, peak = None, torch.cuda.max_memory_allocated(trainer.device)
        else:
            with SavedTensorMeter(wrapper.parameters()) as meter:
                yield
            measured_act, peak = meter.peak, None
        try:
            state = model_state_bytes(wrapper, trainer.optimizer, dp_size=trainer.ps.dp_size)
            _report(trainer, predicted, state.total, measured_act, peak)
        except Exception as e:  # noqa: BLE001 - the report must never stop a run
            logger.info("planner: could not measure the first step (%s)", e)


def _log_prediction(trainer: Trainer, predicted: RankMemory) -> None:
    a, s = predicted.activations, predicted.state
    logger.info(
        "planner: predicted per rank (pp rank %d): model state %.2f MiB (params %.2f, grads %.2f,"
        " master %.2f, optimizer %.2f) + activations %.2f MiB (%d micro-batch(es) in flight) = "
        "%.2f MiB",
        trainer.ps.pp_rank,
        s.total / MIB,
        s.params / MIB,
        s.grads / MIB,
        s.master / MIB,
        s.optimizer / MIB,
        a.peak / MIB,
        a.in_flight,
        predicted.total / MIB,
    )


def _report(
    trainer: Trainer, predicted: RankMemory, state: int, act: int | None, peak: int | None
) -> None:
    p_state, p_act = predicted.state.total, predicted.activations.peak
    values = {
        "planner/predicted-state-mib": p_state / MIB,
        "planner/measured-state-mib": state / MIB,
        "planner/predicted-activations-mib": p_act / MIB,
        "planner/predicted-peak-mib": predicted.total / MIB,
    }
    line = (
        f"planner vs first step (pp rank {trainer.ps.pp_rank}): model state predicted "
        f"{p_state / MIB:.2f} MiB, measured {state / MIB:.2f} MiB; activations predicted "
        f"{p_act / MIB:.2f} MiB"
    )
    if act is not None:
        values["planner/measured-activations-mib"] = act / MIB
        line += f", measured {act / MIB:.2f} MiB (saved tensors, {p_act / max(act, 1) - 1:+.1%})"
    if peak is not None:
        values["planner/measured-peak-mib"] = peak / MIB
        line += (
            f"; peak predicted {predicted.total / MIB:.2f} MiB, measured {peak / MIB:.2f} MiB "
            f"(allocator)"
        )
    logger.info(line)
    trainer.tensorboard.scalars(values, trainer.result.iteration + 1)
