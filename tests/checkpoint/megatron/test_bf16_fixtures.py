"""Megatron-LM's bf16 checkpoints, as its users have them, loaded into megalite at other layouts.

Fixtures (tests/fixtures/megatron_ckpt/bf16/, ``tools/make_megatron_fixtures.py --bf16``): the
fp32 fixtures' model and run under Megatron's ``--bf16``: bf16 parameters, fp32 gradients, fp32
main parameters (``Float16OptimizerWithFloat16Params``: ``fp32_from_fp16_params`` in the legacy
file, ``optimizer.state.fp32_param.*`` in ``torch_dist``; the distributed optimizer: the fp32
``param`` ranges of its ``(bf16, fp32)`` grad buffer in ``distrib_optim.pt``) and RNG states in
the CUDA generator's format. ``reference.pt`` is what Megatron holds after its own
``load_checkpoint`` of the torch_dist files at TP 1 x PP 1: its logits of fixed tokens, its bf16
parameters and, by name, its fp32 masters and Adam moments. After two Adam steps no master is a
bf16 value, so a master re-derived from the bf16 parameter differs from Megatron's.

1. Each of the three loads at TP 1 x PP 1, TP 2 x PP 1 and PP 2 x DP 2 (megalite's distributed
   optimizer): the parameters, masters, moments and Adam step are Megatron's bit for bit (each
   rank against its ``chunk`` of the reference), the logits equal Megatron's within bf16 rounding.
2. Training continues two iterations: finite losses, identical (``==``) from the three files at
   one layout, and identical to a megalite run resumed from megalite's own save of the loaded
   state; close across layouts (bf16 sums in another order).
3. At the fixtures' layout (TP 2 x PP 2) the CUDA-format RNG states are recognised as such: on CPU
   the CPU, Python and numpy generators are restored from the file, the CUDA ones left alone.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from megalite.checkpoint.megatron import open_reader
from megalite.core.parallel_state import ParallelState
from megalite.training import checkpoint_io
from megalite.training.forward_step import make_forward_step
from tests import paths
from tests.checkpoint.megatron.test_formats import MODEL, _logits
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import assert_close_rel, config, trainer_and_data

BF16 = str(paths.FIXTURES / "megatron_ckpt" / "bf16")
# the checkpoints Megatron wrote under --bf16, and the flags megalite loads each with
SOURCES = {
    "torch": ("legacy_tp2_pp2", []),
    "torch_dist": ("dist_tp2_pp2", []),
    "torch+distrib_optim": (
        "legacy_distopt_tp2_pp2_dp2",
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "540"],
    ),
}
# bf16 logits: Megatron's and megalite's sums round in another order; 4 bf16 steps of the largest
LOGITS_REL = 4 * 2**-8
# two bf16 iterations at another layout: bf16 sums in another order (2.3e-5 measured at TP 2)
LAYERS_REL = 2e-4


def reference() -> dict:
    return torch.load(os.path.join(BF16, "reference.pt"), weights_only=True)


def tp_chunk(full: torch.Tensor, name: str, tp_size: int, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s slice of Megatron's full tensor ``name``, by Megatron's layout: QKV
    (whole query groups), fc1 (``[gate; up]``, each half split), embeddings and output layer by
    rows; proj and fc2 by columns; norms whole."""
    if tp_size == 1 or name.endswith("layernorm.weight"):
        return full
    if name.endswith("linear_fc1.weight"):
        return torch.cat([half.chunk(tp_size, 0)[tp_rank] for half in full.chunk(2, 0)])
    dim = 1 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0
    return full.chunk(tp_size, dim)[tp_rank]


def load(path: str, ps: ParallelState, *extra: str, world_size: int = 1, rank: int = 0):
    cfg = config(*MODEL, "--bf16", "--load", path, *extra, world_size=world_size, rank=rank)
    trainer, data = trainer_and_data(cfg, ps)
    return trainer, data, checkpoint_io.load_checkpoint(trainer)


def differences(trainer, ps: ParallelState, ref: dict) -> list[str]:
    """Where this rank's parameters and Adam state differ from Megatron's (``reference.pt``),
    compared exactly: ``name.key`` for each tensor that differs, and the step."""
    module = trainer.model[0].module
    offset = module.layer_range[0]
    full = trainer.optimizer.full_state_dict()  # a collective over DP
    bad = [] if full["step"] == 2 else [f"step {full['step']}"]
    for local, param in module.named_parameters():
        name = local
        if local.startswith("decoder.layers."):
            parts = local.split(".")
            name = ".".join([*parts[:2], str(int(parts[2]) + offset), *parts[3:]])
        wants = {"param": ref["params"][name], **ref["adam"][name]}
        for key, want in wants.items():
            got = param.detach() if key == "param" else full["params"][local][key]
            if not torch.equal(got, tp_chunk(want, name, ps.tp_size, ps.tp_rank)):
                bad.append(f"{name}.{key}")
    return bad


def _layout_case(tp: int, pp: int, native_root: str) -> dict:
    """On this world at TP ``tp`` x PP ``pp`` (DP what is left, with megalite's distributed
    optimizer when DP > 1): each source loaded, compared with Megatron's state, trained two
    iterations; the torch source also saved in megalite's format, reloaded and trained."""
    on_world = dist.is_initialized()  # the harness's world, or one plain process
    rank, world = (dist.get_rank(), dist.get_world_size()) if on_world else (0, 1)
    ps = mesh(tp, pp)
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    zero = ["--use-distributed-optimizer"] if ps.size("dp") > 1 else []
    ref, out = reference(), {}
    step = make_forward_step(torch.device("cpu"))
    try:
        for what, (name, extra) in SOURCES.items():
            flags = [*layout, *extra, *([] if extra else zero)]
            path = os.path.join(BF16, name)
            trainer, data, _ = load(path, ps, *flags, world_size=world, rank=rank)
            bad = differences(trainer, ps, ref)
            logits = _logits(trainer, ref["tokens"], ps)
            if what == "torch":
                checkpoint_io.save_checkpoint(trainer, save_dir=native_root)
            losses = trainer.train(step, data).losses
            out[what] = (bad, None if logits is None else logits.float(), losses)
        trainer, data, _ = load(native_root, ps, *layout, *zero, world_size=world, rank=rank)
        out["megalite"] = ([], None, trainer.train(step, data).losses)
    finally:
        ps.destroy()
        if not on_world and dist.is_initialized():  # the one-process world mesh() built
            dist.destroy_process_group()
    return out


def _check(results: list[dict], what: str) -> list[float]:
    ref = reference()["logits"]
    last = results[-1]
    for rank, out in enumerate(results):
        for source, (bad, _, _) in out.items():
            assert not bad, f"{source} at {what}, rank {rank}: differs from Megatron's {bad[:6]}"
    for source, (_, logits, losses) in last.items():
        if logits is not None:
            err = ((logits - ref).abs().max() / ref.abs().max()).item()
            assert err < LOGITS_REL, f"{source} at {what}: logits differ by {err:.2e}"
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (source, losses)
        assert losses == last["torch"][2], f"{what}: {source} {losses} vs {last['torch'][2]}"
    return last["torch"][2]


def test_bf16_megatron_checkpoints_load_exactly_at_other_layouts_and_continue(tmp_path):
    single = _check([_layout_case(1, 1, str(tmp_path / "tp1"))], "TP1 PP1")
    for (tp, pp), what in (((2, 1), "TP2 PP1"), ((1, 2), "PP2 DP2")):
        world = 2 if what == "TP2 PP1" else 4
        results = run_distributed(_layout_case, world, tp, pp, str(tmp_path / what), timeout=600)
        assert_close_rel(_check(results, what), single, LAYERS_REL, f"{what} vs TP1 PP1")


def test_bf16_fixtures_hold_megatrons_structures():
    """What the fixtures are (so that the tests above test bf16 checkpoints as users have them):
    bf16 parameters; fp32 masters that are not bf16 values, under Megatron's names; a
    ``(bf16, fp32)`` grad buffer; CUDA-format RNG states (16 bytes: seed, Philox offset)."""
    ref = reference()
    for name, (folder, _) in SOURCES.items():
        reader = open_reader(os.path.join(BF16, folder, "iter_0000002"), name.split("+")[0])
        assert reader.args.bf16 and reader.args.accumulate_allreduce_grads_in_fp32
        shard = reader.shard(0, 0)["model"] if name != "torch_dist" else None
        if shard is not None:
            assert {t.dtype for t in shard.values()} == {torch.bfloat16}, name
        entries = reader.rng_states(0, 0)
        assert entries and entries[0]["cuda_rng_state"].numel() == 16, name
        tracker = entries[0]["rng_tracker_states"]["model-parallel-rng"]
        assert tracker.numel() == 16 and not torch.equal(tracker, entries[0]["cuda_rng_state"])
    for name, state in ref["adam"].items():
        master = state["master"]
        assert master.dtype == torch.float32 and ref["params"][name].dtype == torch.bfloat16
        assert not torch.equal(master.bfloat16().float(), master), name
        assert torch.equal(master.bfloat16(), ref["params"][name]), name
