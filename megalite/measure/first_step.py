"""``pretrain_gpt.py``'s side-by-side: the planner's prediction for the run's own layout, and what
the first training step measured, logged and written to TensorBoard.

    pretrain(cfg, first_step_hooks=[FirstStepComparison()])

As the first step starts, the prediction is logged; the step runs under a ``SavedTensorMeter``
on CPU (the saved-activation peak) and the model state is counted from the tensor storages
(``memory_report``); on CUDA the allocator's peak over the step is the measured figure (against
the predicted device peak, the loss's transient logits included; it also holds what the prediction
leaves out: workspace, fragmentation). Every
rank measures its own; the logging rank (the last) prints its line.

A MoE model's activations depend on the routing: the line gives the prediction for balanced
routing, the one for the routing this step's routers chose (each expert's share of this rank's
tokens, over its MoE layers), and the bound for any routing the capacity settings allow, measures
against this step's routing and says which figure applies: the balanced one (within the planner's
5% of this step's), the bound (likewise), or, the routing skewed, this step's own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from megalite.core.moe.router import TopKRouter
from megalite.core.optimizer.memory_report import model_state_bytes
from megalite.measure.saved_tensors import SavedTensorMeter
from megalite.planning.activations import CP_MODELLED, MODELLED_SCHEDULES
from megalite.planning.moe_activations import BALANCED, WORST, Routing
from megalite.planning.predict import RankMemory, predict_for_config
from megalite.training.config import PretrainConfig
from megalite.training.model_chunks import grad_wrappers
from megalite.training.pipeline_config import effective_schedule
from megalite.training.trainer import FirstStepHook, Trainer

logger = logging.getLogger(__name__)
MIB = 2**20
FIGURE_WITHIN = 0.05  # the balanced figure (or the bound) applies when this step's is this close


def uncovered_features(cfg: PretrainConfig) -> list[str]:
    """The features of ``cfg`` the planner does not model: a prediction that ignored them would
    be silently wrong, so they are named instead."""
    par, out = cfg.parallel, []
    if par.optimizer_offload_dir is not None:
        out.append("--optimizer-offload-dir (NVMe offload)")
    if par.param_offload:
        out.append("--param-cpu-offload / --param-offload-dir (the transfers' time)")
    if par.context_parallel_size > 1 and cfg.model.cp_comm_type not in CP_MODELLED:
        out.append(f"--cp-comm-type {cfg.model.cp_comm_type}")
    if par.pipeline_model_parallel_size > 1 and effective_schedule(cfg) not in MODELLED_SCHEDULES:
        out.append(f"--pipeline-schedule {effective_schedule(cfg)}")
    return out


def observed_routing(routers: list[TopKRouter], topk: int) -> Routing | None:
    """The routing ``routers`` chose since their counts were last read: each expert's share of
    the tokens (``topk`` choices per token), summed over the routers (the MoE layers). None
    without routers or counts."""
    if not routers:
        return None
    counts = sum(r.stats[3:].double() for r in routers).tolist()  # [E], one host read
    total = sum(counts)
    if total == 0:
        return None
    return Routing(shares=tuple(n * topk / total for n in counts))


def which_figure_applies(balanced: int, routed: int, bound: int) -> str:
    """Which MoE activation figure describes this step, in words: the balanced one when this
    step's routing predicts within ``FIGURE_WITHIN`` of it, else the bound when within that of
    it (the routing was the worst the capacity settings allow), else this step's own."""
    if abs(routed - balanced) <= FIGURE_WITHIN * balanced:
        return "the balanced figure applies"
    if abs(routed - bound) <= FIGURE_WITHIN * bound:
        return "the bound applies (this routing is the worst the capacity settings allow)"
    return f"routing skewed ({routed / balanced - 1:+.1%}): this step's figure applies"


def predicted_for_rank(trainer: Trainer, routing: Routing = BALANCED) -> RankMemory:
    """The prediction for this rank of the trainer's run, MoE layers routed as ``routing``
    assumes (NotImplementedError for a layout with features the planner does not model)."""
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
        ep_rank=ps.rank("ep"),
        routing=routing,
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
            routing = observed_routing(trainer.routers, trainer.cfg.model.moe_router_topk)
            routed = None if routing is None else predicted_for_rank(trainer, routing)
            _report(trainer, predicted, routed, state.total, measured_act, peak)
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
    trainer: Trainer,
    predicted: RankMemory,
    routed: RankMemory | None,
    state: int,
    act: int | None,
    peak: int | None,
) -> None:
    """The comparison line and its TensorBoard scalars; ``routed``: a MoE model's prediction for
    this step's routing (measurements are compared with it)."""
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
    against, verdict = predicted, ""
    if routed is not None:
        a, r = predicted.activations, routed.activations
        values["planner/predicted-activations-routed-mib"] = r.peak / MIB
        values["planner/predicted-activations-bound-mib"] = a.bound / MIB
        line += (
            f" for {a.routing}, {r.peak / MIB:.2f} MiB for {r.routing}, at most "
            f"{a.bound / MIB:.2f} MiB for {WORST.describe(trainer.cfg.model)}"
        )
        verdict = "; " + which_figure_applies(a.peak, r.peak, a.bound)
        against = routed
    p_act = against.activations.peak
    if act is not None:
        values["planner/measured-activations-mib"] = act / MIB
        line += f", measured {act / MIB:.2f} MiB (saved tensors, {p_act / max(act, 1) - 1:+.1%})"
    if peak is not None:
        values["planner/measured-peak-mib"] = peak / MIB
        line += (
            f"; peak predicted {against.total / MIB:.2f} MiB, measured {peak / MIB:.2f} MiB "
            f"(allocator)"
        )
    line += verdict
    logger.info(line)
    trainer.tensorboard.scalars(values, trainer.result.iteration + 1)
