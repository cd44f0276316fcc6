"""The planner's memory model against measurement, on CPU.

Model-state bytes (params, grads, fp32 masters, Adam states) predicted by ``planning.model_state``
must equal what ``core.optimizer.memory_report`` measures on the built run, byte for byte, on every
rank; the saved-activation peak of one training step (``measure.saved_tensors.SavedTensorMeter``,
saved-tensor hooks over the real schedule) must be within 5% of ``planning.activations``.
Single-process cases cover both families, the precisions, recompute and the attention backends; one
4-rank world covers TP, SP, PP 1F1B / GPipe (uneven stages too), DP with no_shard and ZeRO-1; a
second covers the other schedules (interleaved, ZB-H1, ZBV, DualPipeV), ZeRO-2 / ZeRO-3 (and
optimizer offload: the host bytes), context parallelism and MoE with expert parallelism (expert
state over edp). ``theory`` (a formula, not a measurement) is left out of the comparison.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.kernels import runtime
from megalite.measure.saved_tensors import measure_step
from megalite.planning.activations import FusedKernels, fused_kernels
from megalite.planning.predict import predict_for_config
from megalite.training.forward_step import make_forward_step
from megalite.training.pretrain import build_run, mesh_for
from tests.harness import run_distributed
from tests.training.common import FAMILIES, config

ACT_REL = 0.05  # the planner's bar for activations; model state is exact
LLAMA = tuple(FAMILIES["llama"])
GQA = ("--group-query-attention", "--num-query-groups", "2")
LLAMA_MHA = tuple(f for f in LLAMA if f not in GQA)  # every head its own key/value
FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform")
FULL += ("--recompute-num-layers",)  # the count follows in each case

SINGLE = {
    "gpt2 fp32": (),
    "gpt2 bf16": ("--bf16",),
    "gpt2 fp16 fp32-grads": ("--fp16", "--accumulate-allreduce-grads-in-fp32"),
    "llama fp32": LLAMA,
    "llama bf16": (*LLAMA, "--bf16"),
    "gpt2 full recompute": (*FULL, "1"),
    "gpt2 block recompute": ("--num-layers", "4", "--recompute-granularity", "full",
                             "--recompute-method", "block", "--recompute-num-layers", "2"),
    "llama bf16 full recompute 2": (*LLAMA, "--bf16", "--num-layers", "4", *FULL, "2"),
    "gpt2 selective": ("--recompute-activations",),
    "gpt2 unfused": ("--attention-backend", "unfused"),
    "gpt2 unfused selective": ("--attention-backend", "unfused", "--recompute-activations"),
    "gpt2 dropout": ("--hidden-dropout", "0.1"),
    "gpt2 attention dropout": ("--attention-dropout", "0.1", "--hidden-dropout", "0.1"),
    "llama attention dropout": (*LLAMA, "--attention-dropout", "0.1"),
    "llama no-GQA unfused": (*LLAMA_MHA, "--attention-backend", "unfused"),
    "llama no-GQA attention dropout": (*LLAMA_MHA, "--attention-dropout", "0.1"),
    "gpt2 zero1 bf16": ("--use-distributed-optimizer", "--bf16"),
}  # fmt: skip

WORLD4 = {
    "TP2 DP2": ("--tensor-model-parallel-size", "2"),
    "TP2 SP DP2 zero1 llama bf16": (*LLAMA, "--tensor-model-parallel-size", "2",
                                     "--sequence-parallel", "--use-distributed-optimizer",
                                     "--bf16"),
    "TP4 SP": ("--tensor-model-parallel-size", "4", "--sequence-parallel"),
    "TP2 PP2 1f1b llama": (*LLAMA, "--tensor-model-parallel-size", "2",
                           "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"),
    "PP4 1f1b": ("--num-layers", "4", "--pipeline-model-parallel-size", "4",
                 "--micro-batch-size", "1"),
    "PP4 gpipe": ("--num-layers", "4", "--pipeline-model-parallel-size", "4",
                  "--micro-batch-size", "1", "--pipeline-schedule", "gpipe"),
    "PP4 1f1b uneven": ("--num-layers", "6", "--pipeline-model-parallel-size", "4",
                        "--decoder-first-pipeline-num-layers", "1",
                        "--decoder-last-pipeline-num-layers", "1", "--micro-batch-size", "1"),
    "PP2 DP2 zero1 gpipe uneven llama": (*LLAMA, "--num-layers", "3",
                                         "--pipeline-model-parallel-size", "2",
                                         "--decoder-first-pipeline-num-layers", "1",
                                         "--pipeline-schedule", "gpipe",
                                         "--use-distributed-optimizer", "--micro-batch-size", "1"),
    "DP4 zero1 bf16 small buckets": ("--use-distributed-optimizer", "--bf16",
                                     "--ddp-bucket-size", "3000", "--micro-batch-size", "1"),
    "DP4 llama": (*LLAMA, "--micro-batch-size", "1"),
    "TP2 PP2 full recompute": ("--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2", *FULL, "1",
                               "--micro-batch-size", "1"),
    "PP2 TP2 SP selective bf16": ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--pipeline-model-parallel-size", "2", "--recompute-activations",
                                  "--bf16", "--micro-batch-size", "1"),
}  # fmt: skip

PP2 = ("--num-layers", "4", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1")
MOE = ("--num-experts", "4", "--moe-router-topk", "2")
A2A_PAD = (
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-expert-capacity-factor",
    "2.0",
    "--moe-pad-expert-input-to-capacity",
)  # no token dropped: every expert `cap` rows
WORLD4_MORE = {
    "PP2 DP2 interleaved": (*PP2, "--num-virtual-stages-per-pipeline-rank", "2"),
    "PP2 DP2 interleaved uneven chunks": (*PP2, "--num-virtual-stages-per-pipeline-rank", "2",
                                          "--num-layers", "5",
                                          "--decoder-first-pipeline-num-layers", "3"),
    "PP2 TP2 zb-h1 llama": (*LLAMA, *PP2, "--tensor-model-parallel-size", "2",
                            "--pipeline-schedule", "zb-h1"),
    "PP2 DP2 zbv": (*PP2, "--pipeline-schedule", "zbv"),
    "PP2 DP2 dualpipev zero1 bf16": (*PP2, "--pipeline-schedule", "dualpipev",
                                     "--use-distributed-optimizer", "--bf16"),
    "DP4 zero2 bf16": ("--zero-stage", "2", "--bf16"),
    "DP4 zero3 bf16": ("--zero-stage", "3", "--bf16", "--micro-batch-size", "1"),
    "TP2 DP2 zero3 llama": (*LLAMA, "--zero-stage", "3", "--tensor-model-parallel-size", "2"),
    "DP4 zero2 offload half": ("--zero-stage", "2", "--bf16", "--optimizer-cpu-offload",
                               "--optimizer-offload-fraction", "0.5"),
    "CP2 DP2 ring": ("--context-parallel-size", "2"),
    "CP2 TP2 ring llama selective": (*LLAMA, "--context-parallel-size", "2",
                                     "--tensor-model-parallel-size", "2",
                                     "--recompute-activations"),
    "CP2 DP2 all-gather full recompute": ("--context-parallel-size", "2", "--cp-comm-type",
                                          "all_gather", *FULL, "1"),
    "MoE EP1 DP4 zero1": (*MOE, "--use-distributed-optimizer"),
    "MoE EP2 DP4 all-to-all": (*MOE, "--expert-model-parallel-size", "2", *A2A_PAD),
    "MoE EP2 TP2 SP zero3 all-to-all": (*MOE, "--expert-model-parallel-size", "2", *A2A_PAD,
                                        "--tensor-model-parallel-size", "2",
                                        "--sequence-parallel", "--zero-stage", "3"),
}  # fmt: skip


def _measure(cfg, ps: ParallelState):
    run = build_run(cfg, ps, torch.device("cpu"), seed_rng=True, resume=False)
    state, act, _ = measure_step(
        run.trainer, make_forward_step(torch.device("cpu")), run.train_iter
    )
    predicted = predict_for_config(
        cfg, dp=ps.dp_size, dp_ranks=[ps.rank("dp", "cp")], device="cpu", edp_rank=ps.rank("edp")
    )
    mine = next(r for r in predicted if r.pp_rank == ps.pp_rank)
    bare = dict(theory=0, theory_off=0)
    measured, predicted = (dataclasses.replace(s, **bare) for s in (state, mine.state))
    return measured, predicted, act, mine.activations.peak


def _check(name: str, rank: int, measured_state, predicted_state, act, predicted_act) -> None:
    assert measured_state == predicted_state, (name, rank, measured_state, predicted_state)
    assert act > 0, (name, "nothing measured: the check is vacuous")
    assert abs(predicted_act - act) <= ACT_REL * act, (
        f"{name} rank {rank}: activations predicted {predicted_act} measured {act} "
        f"({predicted_act / act - 1:+.1%})"
    )


@pytest.mark.parametrize("name", list(SINGLE))
def test_single_process_prediction_matches(name):
    _check(name, 0, *_measure(config(*SINGLE[name]), ParallelState.single()))


FUSED = {
    "llama bf16": (*LLAMA, "--bf16"),
    "llama bf16 full recompute 2": (*LLAMA, "--bf16", "--num-layers", "4", *FULL, "2"),
    "gpt2 bf16": ("--bf16",),
    "gpt2 unfused": ("--attention-backend", "unfused"),
    "gpt2 unfused attention dropout": ("--attention-backend", "unfused",
                                       "--attention-dropout", "0.1"),
    "llama no-GQA unfused bf16": (*LLAMA_MHA, "--attention-backend", "unfused", "--bf16"),
    "gpt2 unfused, no fused kernels": ("--attention-backend", "unfused", "--no-fused-kernels"),
    "llama bf16, no fused kernels": (*LLAMA, "--bf16", "--no-fused-kernels"),
}  # fmt: skip


@pytest.mark.kernels_on  # scripts/test.sh reruns it under TRITON_INTERPRET=1: the fused kernels
@pytest.mark.parametrize("name", list(FUSED))
def test_prediction_follows_the_kernels_that_run(name):
    """With the fused Triton kernels running (a GPU, or the interpreter on CPU) the RMSNorm saves
    its input and rstd alone and the unfused attention's softmax its output alone; a model that
    does not ask for them (``--no-fused-kernels``) runs the references wherever it runs. The
    planner predicts whichever path runs, kernel by kernel."""
    cfg = config(*FUSED[name])
    on = cfg.model.use_fused_kernels and runtime.interpreting() and runtime.kernels_ready()
    unfused = cfg.model.attention_backend == "unfused"
    assert fused_kernels(cfg.model, "cpu") == FusedKernels(norms=on, softmax=on and unfused)
    _check(name, 0, *_measure(cfg, ParallelState.single()))


def _world_case(cases: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, flags in cases.items():
        cfg = config(*flags, world_size=world, rank=rank)
        ps = mesh_for(cfg.parallel)
        try:
            out[name] = _measure(cfg, ps)
        finally:
            ps.destroy()
    return out


def test_four_rank_layouts_prediction_matches():
    results = run_distributed(_world_case, 4, WORLD4, timeout=600)
    for rank, per_rank in enumerate(results):
        for name in WORLD4:
            _check(name, rank, *per_rank[name])


def test_four_rank_schedules_zero_ladder_cp_and_ep_prediction_matches():
    results = run_distributed(_world_case, 4, WORLD4_MORE, timeout=600)
    for rank, per_rank in enumerate(results):
        for name in WORLD4_MORE:
            _check(name, rank, *per_rank[name])


def test_prediction_sees_a_wrong_layout():
    """The checks can fail: a prediction for a neighbouring config misses the measurement."""
    cfg = config("--fp16", "--accumulate-allreduce-grads-in-fp32", "--micro-batch-size", "4")
    measured_state, predicted_state, act, predicted_act = _measure(cfg, ParallelState.single())
    assert measured_state == predicted_state
    neighbour = predict_for_config(config("--fp16"), dp=1, device="cpu")[0]
    assert neighbour.state != measured_state  # fp16 grads instead of fp32 ones
    assert abs(neighbour.activations.peak - act) > ACT_REL * act  # 2 sequences, not 4
