"""The time offloaded state's transfers add to a predicted step (``planning.offload_time``),
against the closed form of what each offload moves (no timing: bytes over the cluster's link
figures), ``tools/plan.py`` reporting it, and the calibration of the links writing its figures."""

from __future__ import annotations

import dataclasses
import io
import os

import pytest
import torch

from megalite.planning.activations import stage_activations
from megalite.planning.cluster import calibrated, preset
from megalite.planning.model_state import param_numels
from megalite.planning.predict import Layout
from megalite.planning.step_time import predict_step_time
from megalite.training.arguments import parse_args
from tests.training.common import config
from tools.plan import main
from tools.planner.calibrate_offload import offload_figures

LINKS = dict(host_gbps=20.0, disk_read_gbps=0.5, disk_write_gbps=2.0)
GBS, MBS, DP = 8, 2, 2
M = GBS // (MBS * DP)  # micro-batches per step


def _model(*flags: str):
    return config("--bf16", *flags, world_size=DP).model


def _step(c, layout, cluster):
    return predict_step_time(c, layout, cluster, global_batch_size=GBS, precision="bf16")


def test_zero3_params_and_optimizer_in_files_add_the_closed_form():
    """ZeRO-3, params and optimizer state in files (bf16 params, fp32 grads): each unit's shard
    is read at each of its ``2m`` gathers (the tied embedding ``3m``: the output layer gathers it
    too) from NVMe and copied to the device, on the reader thread; each micro-batch's grad shard
    goes to the host; the master and both moments are read and written; the updated bf16 params
    are written to their file. The reads hide behind the compute up to its length."""
    c = _model()
    cluster = dataclasses.replace(preset("H100", DP), **LINKS)
    base = Layout(dp=DP, rung="optim_grads_params", micro_batch_size=MBS)
    layout = dataclasses.replace(
        base, offload_fraction=1.0, optimizer_offload="disk", param_offload="disk"
    )
    numels = dict(param_numels(c, tp=1, pp=1, pp_rank=0))
    embedding = sum(v for k, v in numels.items() if k.startswith("embedding."))
    n = sum(numels.values()) / DP  # the rank's shard
    reads = (3 * M * embedding + 2 * M * (sum(numels.values()) - embedding)) / DP * 2
    overlapped = reads / 0.5e9 + reads / 20e9
    grads = M * n * 4 / 20e9
    optimizer = 12 * n / 0.5e9 + 12 * n / 2e9
    param_write = n * 2 / 2e9
    step, plain = _step(c, layout, cluster), _step(c, base, cluster)
    busy = step.compute  # TP 1, PP 1: the rank's passes
    assert overlapped > busy  # the reads are partly exposed
    expected = grads + optimizer + param_write + overlapped - busy
    assert step.offload == pytest.approx(expected, rel=1e-12)
    assert step.seconds == pytest.approx(plain.seconds + expected, rel=1e-12)
    assert step.offload_by == pytest.approx(
        {"params": overlapped + param_write, "grads": grads, "optimizer": optimizer}, rel=1e-12
    )


def test_zero2_half_the_optimizer_on_the_host():
    """ZeRO-Offload: half of each shard's optimizer state on the host: its fp32 grads go there
    once a step and its updated bf16 params come back, both exposed; nothing in files."""
    c = _model()
    cluster = dataclasses.replace(preset("H100", DP), **LINKS)
    base = Layout(dp=DP, rung="optim_grads", micro_batch_size=MBS)
    layout = dataclasses.replace(base, offload_fraction=0.5)
    n = sum(dict(param_numels(c, tp=1, pp=1, pp_rank=0)).values()) / DP
    expected = 0.5 * n * 4 / 20e9 + 0.5 * n * 2 / 20e9
    step = _step(c, layout, cluster)
    assert step.offload == pytest.approx(expected, rel=1e-12)
    assert step.seconds == pytest.approx(_step(c, base, cluster).seconds + expected, rel=1e-12)


def test_activation_offload_hides_on_a_gpu_and_is_free_or_in_line_on_a_cpu():
    """``--cpu-offloading 1``: the first layer's saved bytes out and back per micro-batch: on a
    GPU behind the compute (a side stream), on a CPU device free unless a calibration measured
    the memcpy, then in line."""
    c = _model("--cpu-offloading", "--cpu-offloading-num-layers", "1")
    layout = Layout(dp=DP, micro_batch_size=MBS)
    per_layer = stage_activations(
        c, micro_batch_size=MBS, tp=1, pp=1, pp_rank=0, num_microbatches=M, precision="bf16"
    ).per_layer
    moved = 2 * M * per_layer
    gpu = dataclasses.replace(preset("H100", DP), **LINKS)
    step = _step(c, layout, gpu)
    assert step.offload_by == pytest.approx({"activations": moved / 20e9}, rel=1e-12)
    assert step.offload == 0.0  # hidden: the compute takes longer
    cpu = dataclasses.replace(gpu, device="cpu")
    assert _step(c, layout, cpu).offload_by == {"activations": 0.0}
    per_layer_cpu = stage_activations(
        c,
        micro_batch_size=MBS,
        tp=1,
        pp=1,
        pp_rank=0,
        num_microbatches=M,
        precision="bf16",
        device="cpu",
    ).per_layer
    measured = calibrated(cpu, {"host_gbps": 5.0})
    assert _step(c, layout, measured).offload == pytest.approx(
        2 * M * per_layer_cpu / 5e9, rel=1e-12
    )


def test_plan_reports_host_bytes_and_transfer_time_of_an_offload_layout():
    """gpt2-350m on 2 GPUs with room for no layout but ZeRO-3 with its state on the host: the
    plan prints the host bytes and the transfers' seconds, and flags pretrain_gpt.py accepts."""
    out = io.StringIO()
    argv = ["--model", "gpt2-350m", "--gpus", "2", "--gpu-memory-gib", "5.5"]
    argv += ["--global-batch-size", "4", "--offload", "host", "--top", "1", "--jobs", "1"]
    assert main(argv, out=out) == 0
    text = out.getvalue()
    assert "optim_grads_params" in text and "params-host" in text, text
    assert "(GiB: host, host, host, disk, disk)" in text
    (line,) = [x for x in text.splitlines() if "offload transfers per step" in x]
    assert "params" in line and "grads" in line
    command = next(x for x in text.splitlines() if "pretrain_gpt.py " in x).split("py ", 1)[1]
    data = "--lr 1e-4 --train-iters 1 --mock-data --tokenizer-type NullTokenizer"
    flags = command.split() + data.split() + ["--vocab-size", "50257"]
    cfg = parse_args(flags, env={"WORLD_SIZE": "2", "RANK": "0"})
    assert cfg.parallel.param_cpu_offload and cfg.parallel.optimizer_offload_fraction == 1.0


def test_calibration_measures_the_offload_links(tmp_path):
    """The figures exist, are positive and reach the cluster; the temporary file is gone."""
    data = offload_figures(str(tmp_path), device=torch.device("cpu"), nbytes=1 << 20)
    assert set(data) == {"host_gbps", "disk_read_gbps", "disk_write_gbps"}
    assert all(v > 0 for v in data.values())
    assert os.listdir(tmp_path) == []
    cluster = calibrated(preset("H100", 8), data)
    assert (cluster.host_gbps, cluster.disk_read_gbps, cluster.disk_write_gbps) == (
        data["host_gbps"],
        data["disk_read_gbps"],
        data["disk_write_gbps"],
    )
