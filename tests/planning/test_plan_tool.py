"""tools/plan.py and the planner's pure parts: search, explain, schedules, the bytes table."""

from __future__ import annotations

import dataclasses
import io

import pytest

from megalite.planning.cluster import calibrated, load_calibration, preset, save_calibration
from megalite.planning.model_state import ZERO_RUNGS, bytes_per_param
from megalite.planning.predict import Layout
from megalite.planning.presets import MODEL_PRESETS
from megalite.planning.search import evaluate
from megalite.planning.step_time import predict_step_time
from megalite.training.arguments import parse_args
from tests.training.common import config
from tools.plan import main


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_plan_prints_ranked_layouts_whose_flags_pretrain_gpt_accepts():
    rc, out = _run("--model", "gpt2-125m", "--gpus", "8", "--global-batch-size", "32", "--top", "2")
    assert rc == 0
    commands = [
        x.split("pretrain_gpt.py ", 1)[1] for x in out.splitlines() if "pretrain_gpt.py " in x
    ]
    assert len(commands) == 2
    for command in commands:  # the printed flags run as they are (data flags added)
        data = "--lr 1e-4 --train-iters 1 --mock-data --tokenizer-type NullTokenizer"
        argv = command.split() + data.split() + ["--vocab-size", "50257"]
        cfg = parse_args(argv, env={"WORLD_SIZE": "8", "RANK": "0"})
        assert cfg.parallel.world_size == 8
    rows = [x for x in out.splitlines() if x[:4].strip() in ("1", "2")]
    speeds = [float(r.split()[-4].replace(",", "")) for r in rows]
    assert speeds == sorted(speeds, reverse=True)


def test_explain_names_refusals_and_misfits():
    small_gpus = ["--gpus", "8", "--gpu-memory-gib", "24"]
    rc, out = _run("--model", "llama3-8b", *small_gpus, "--global-batch-size", "8", "--explain")
    assert rc == 0
    explained = out.split("why each", 1)[1]
    assert "TP1 PP1 DP8: does not fit" in explained and "GiB usable per GPU" in explained
    assert (
        "refused by pretrain_gpt.py" in _run("--model", "gpt2-125m", "--gpus", "8", "--explain")[1]
    )  # 12 heads over TP 8


def test_one_line_errors(capsys):
    assert _run("--model", "deepseek-v3")[0] == 2  # not a preset: one line naming the presets
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model deepseek-v3" in err and "mixtral-8x7b" in err
    no_vocab = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    assert _run(*no_vocab, "--seq-length", "32")[0] == 2
    assert "--vocab-size" in capsys.readouterr().err


def test_bytes_per_param_table_is_designs():
    assert bytes_per_param("no_shard", 8, param_bytes=2, grad_bytes=2) == 16
    assert bytes_per_param("optim", 8, param_bytes=2, grad_bytes=2) == 4 + 12 / 8
    assert bytes_per_param("optim_grads", 8, param_bytes=2, grad_bytes=2) == 2 + 14 / 8
    assert bytes_per_param("optim_grads_params", 8, param_bytes=2, grad_bytes=2) == 16 / 8
    assert all(v.available for v in ZERO_RUNGS.values())  # the whole ladder is modelled


def test_step_time_bubble_comes_from_the_schedule():
    """The pipeline term is the simulator over each schedule's action list: GPipe and 1F1B share
    the textbook bubble, interleaving and zero-bubble schedules shrink it."""
    shape = ["--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024"]
    batch = ["--global-batch-size", "16", "--micro-batch-size", "1"]
    cfg = config("--num-layers", "8", *batch, *shape, "--max-position-embeddings", "1024").model
    free_links = dict(collective_latency_s=0.0, intra_node_gbps=1e9, inter_node_gbps=1e9)
    cluster = dataclasses.replace(preset("H100", 4), **free_links)

    def bubble(schedule, vp=1):
        lay = Layout(pp=4, schedule=schedule, vp=vp)
        st = predict_step_time(cfg, lay, cluster, global_batch_size=16, precision="bf16")
        return st.bubble / st.seconds

    one = bubble("1f1b")
    assert one == pytest.approx(bubble("gpipe"), rel=0.05)
    assert one == pytest.approx(3 / 19, rel=0.1)  # (p - 1) / (m + p - 1)
    assert bubble("interleaved-1f1b", 2) < 0.6 * one
    assert bubble("zb-h1") < 0.5 * one
    assert bubble("zbv", 2) < 0.3 * one
    assert bubble("dualpipev", 2) < 0.3 * one


def test_presets_override():
    c = preset("A100", 16, gpu_memory_gib=40, gpus_per_node=None)
    assert (c.gpu_memory_gib, c.peak_tflops, c.gpus_per_node) == (40, 312.0, 8)
    with pytest.raises(ValueError, match="unknown GPU preset"):
        preset("Z9", 8)


def test_calibration_file_round_trip(tmp_path):
    path = tmp_path / "calib.json"
    figures = {
        "device": "cpu",
        "peak_tflops": 0.05,
        "efficiency": 0.5,
        "layer_overhead_s": 1e-3,
        "optimizer_s_per_param": 1e-8,
        "collectives": {"all_reduce": {"gbps": 0.8, "latency_s": 5e-4}},
    }
    save_calibration(path, figures)
    c = calibrated(preset("H100", 2), load_calibration(path))
    assert (c.peak_tflops, c.efficiency, c.intra_node_gbps, c.collective_latency_s) == (
        0.05,
        0.5,
        0.8,
        5e-4,
    )
    path.write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="run tools/plan.py --calibrate again"):
        load_calibration(path)
    rc, _ = _run("--model", "gpt2-125m", "--calibration", str(tmp_path / "missing.json"))
    assert rc == 2


def test_mixtral_preset_is_planned():
    """A MoE preset: mixtral-8x7b is planned (Megatron-Core's published layout fits)."""
    p = MODEL_PRESETS["mixtral-8x7b"]
    layout = Layout(tp=1, pp=4, dp=16, ep=8, rung="optim", schedule="interleaved-1f1b", vp=8)
    argv, cluster = [*p["argv"], "--bf16"], preset("H100", 64)
    c = evaluate(argv, layout, cluster, vocab_size=p["vocab_size"], global_batch_size=256)
    assert c.error is None and c.fits and 35.0 < c.step.mfu < 55.0
