"""Write Megatron-LM checkpoints with Megatron's own save path (tests/fixtures/megatron_ckpt/).

    # megatron-core 0.16 (wheel) + megatron/{training,rl,post_training,legacy} of Megatron-LM's
    # core_r0.16.0 branch in /tmp/mlm016; psutil in the interpreter (a venv); no GPU needed
    PYTHONPATH=/tmp/mcore/site:/tmp/mlm016 python tools/make_megatron_fixtures.py [--output DIR]
    PYTHONPATH=/tmp/mcore/site:/tmp/mlm016 python tools/make_megatron_fixtures.py \
        --check-load DIR --ckpt-format torch_dist      # megalite's files through Megatron's loader
        [--distributed-optimizer]                       # (torch: its distrib_optim.pt)

Neither is a dependency of megalite; megatron-core is a test dependency (the test extra) for
``test_megatron_core_reads_bf16``, the other tests read only the committed files. On 4 CPU processes
(gloo) a tiny Llama-style GPTModel (local layer spec: RoPE, RMSNorm, SwiGLU, GQA, untied output)
is built at TP 2 x PP 2, its Adam state made non-trivial by two optimizer steps on seeded random
gradients, and ``megatron.training.checkpointing.save_checkpoint`` writes iteration 2 twice:
``legacy_tp2_pp2`` (``--ckpt-format torch``: ``model_optim_rng.pt`` per (TP, PP) rank) and
``dist_tp2_pp2`` (``--ckpt-format torch_dist``). On 8 processes the same run at TP 2 x PP 2 x
DP 2 with ``--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 540`` writes
``legacy_distopt_tp2_pp2_dp2`` (``--ckpt-format torch``: ``distrib_optim.pt`` beside each
``model_optim_rng.pt``; ``--only-distopt`` writes just that one). Megatron's distributed
optimizer refuses parameters that are not CUDA tensors by their ``type()`` name; on this CPU-only
machine the parameters answer with their CUDA name (``cuda_named_types``), which changes nothing
else: Megatron's own code shards, steps, gathers over gloo and saves. Then one process loads
``dist_tp2_pp2`` at TP 1 x PP 1 with Megatron's ``load_checkpoint`` and writes the logits of
fixed tokens to ``reference.pt``: the source model's function, which every megalite load must
reproduce. What it takes to run Megatron's code on CPU processes is in ``megatron_on_cpu.py``.

``--check-load DIR`` runs only that last step on a checkpoint megalite wrote and compares its
logits with ``DIR``'s ``reference.pt`` (written beside it by the caller), and the Adam state
Megatron's optimizer then holds with the one megalite reads from the same files; exit status 0
when both match. ``--layout TP PP DP`` loads it at that layout instead (TP x PP x DP processes;
the logits pipelined by hand and gathered over TP); with ``--distributed-optimizer`` (and
``--bucket-flags``, the grad-buffer flags of the megalite run) the Adam state Megatron then
holds, gathered by its own ``get_parameter_state_dp_zero`` per (TP, PP) rank, must equal the
flat tensors of ``--distopt-ref DIR``'s ``distrib_optim.pt`` files exactly (megalite's, in the
torch format: so a torch_dist load is checked against the same state).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch
from megatron_on_cpu import (
    CONSUMED,
    ITERATION,
    TOKENS_SEED,
    VOCAB,
    PhiloxCudaRng,
    adam_state,
    build,
    cpu_patches,
    cuda_named_types,
    gpt_model,
    inner_optimizer,
    keep_adam_step,
    megatron_args,
    spawn,
)

DISTOPT = "legacy_distopt_tp2_pp2_dp2"


def _cuda_rng(precision: list[str]) -> PhiloxCudaRng | None:
    """The bf16 fixtures are checkpoints as users have them, from GPU runs: the CUDA generators'
    states in the CUDA format (``PhiloxCudaRng``); the fp32 fixtures keep the CPU's state."""
    return PhiloxCudaRng() if "--bf16" in precision else None


def _train_on_random_grads(ddp, optimizer, scheduler, args) -> None:
    """``ITERATION`` optimizer steps on seeded random gradients: per TP rank for the parameters
    Megatron splits over TP, the same on every TP rank for those it replicates (the norms), as
    real gradients are (the fp32 fixtures predate the second rule: their norms differ across TP
    ranks, and a reader takes TP rank 0's)."""
    from megatron.core import parallel_state as mpu

    split = torch.Generator().manual_seed(100 + mpu.get_tensor_model_parallel_rank())
    replicated = torch.Generator().manual_seed(100)
    for _ in range(ITERATION):
        for p in ddp.module.parameters():
            gen = split if getattr(p, "tensor_model_parallel", False) else replicated
            g = torch.randn(p.shape, generator=gen) * 0.01
            p.main_grad.copy_(g)
        optimizer.step()
        scheduler.step(increment=args.global_batch_size)
    args.consumed_train_samples = CONSUMED


def _save_rank(rank: int, world: int, port: int, out: str, precision: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cpu_patches(cuda_rng=_cuda_rng(precision))
    cuda_named_types()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    args = megatron_args(
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *precision]
    )
    ddp, optimizer, scheduler = build(args, 2, 2)
    _train_on_random_grads(ddp, optimizer, scheduler, args)
    from megatron.training.checkpointing import save_checkpoint

    for fmt, name in (("torch", "legacy_tp2_pp2"), ("torch_dist", "dist_tp2_pp2")):
        args.ckpt_format, args.use_dist_ckpt = fmt, fmt != "torch"
        args.save = os.path.join(out, name)
        save_checkpoint(ITERATION, [ddp], optimizer, scheduler, 0)
    torch.distributed.destroy_process_group()


def _save_distopt_rank(rank: int, world: int, port: int, out: str, precision: list[str]) -> None:
    """TP 2 x PP 2 x DP 2 with the distributed optimizer and small grad-buffer buckets:
    ``--ckpt-format torch`` writes ``distrib_optim.pt`` (DP rank 0's gather of the flat buckets)
    beside each ``model_optim_rng.pt``. The same seeded gradients on both DP replicas, so the
    model and Adam state equal those of ``legacy_tp2_pp2``. 540 elements per bucket: on the first
    stage one bucket closes right after a 32-element norm, so its 64-element alignment padding is
    not in the file (a reader ignoring the buckets gets other sizes)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cpu_patches(cuda_rng=_cuda_rng(precision))
    cuda_named_types()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    layout = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
    buckets = "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 540"
    args = megatron_args([*f"{layout} {buckets}".split(), *precision])
    ddp, optimizer, scheduler = build(args, 2, 2)
    _train_on_random_grads(ddp, optimizer, scheduler, args)
    from megatron.training.checkpointing import save_checkpoint

    args.ckpt_format, args.use_dist_ckpt = "torch", False
    args.save = os.path.join(out, DISTOPT)
    save_checkpoint(ITERATION, [ddp], optimizer, scheduler, 0)
    torch.distributed.destroy_process_group()


def _logits_rank(port: int, load: str, fmt: str, result: str, extra=()) -> None:
    """One process: Megatron's load_checkpoint of ``load`` at TP 1 x PP 1, logits -> result."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    cpu_patches()
    cuda_named_types()
    distributed = "--use-distributed-optimizer" in extra
    if distributed:
        keep_adam_step()
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    args = megatron_args(["--load", load, "--ckpt-format", fmt, *extra])
    ddp, optimizer, scheduler = build(args, 1, 1)
    from megatron.training.checkpointing import load_checkpoint

    # An fp32 model's distributed optimizer keeps views of the parameters as its masters, and
    # load_parameter_state copies into them in place, which autograd refuses outside no_grad;
    # no_grad changes no value loaded.
    with torch.no_grad():
        iteration, _ = load_checkpoint([ddp], optimizer, scheduler)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(TOKENS_SEED))
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    with torch.no_grad():
        logits = ddp.module(tokens, positions, None)  # [b, s, V_pad]
    torch.save(
        {
            "tokens": tokens,
            "logits": logits[..., :VOCAB].clone(),
            "iteration": iteration,
            "consumed_train_samples": args.consumed_train_samples,
            "lr": optimizer.param_groups[0]["lr"],
            "num_steps": scheduler.num_steps,
            "adam": adam_state(ddp, optimizer),
            "params": {n: p.detach().clone() for n, p in gpt_model(ddp).named_parameters()},
        },
        result,
    )
    torch.distributed.destroy_process_group()


def _layout_rank(rank: int, world: int, port: int, cli_args: tuple) -> None:
    """One of TP x PP x DP processes: Megatron's load_checkpoint of a megalite checkpoint at that
    layout; the last stage's TP-gathered logits and each (TP, PP) rank's DP-gathered flat Adam
    state (DP rank 0) -> ``result_dir``."""
    load, fmt, result_dir, extra, tp, pp = cli_args
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cpu_patches()
    cuda_named_types()
    distributed = "--use-distributed-optimizer" in extra
    if distributed:
        keep_adam_step()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    args = megatron_args(["--load", load, "--ckpt-format", fmt, *layout, *extra])
    ddp, optimizer, scheduler = build(args, tp, pp)
    from megatron.core import parallel_state as mpu
    from megatron.training.checkpointing import load_checkpoint

    if distributed and fmt == "torch_dist":
        # megatron-core 0.16 without Transformer Engine or Apex reads Adam's step from the
        # per-parameter state in ``state_dict()``, which the sharded load calls before any state
        # exists (``assert len(steps) == 1``, for Megatron's own files too): give the state its
        # slots first, as Megatron's dummy-state initialiser does; the load then replaces them.
        inner_optimizer(optimizer)._init_optimizer_states_with_dummy_values()
    with torch.no_grad():  # as _logits_rank
        iteration, _ = load_checkpoint([ddp], optimizer, scheduler)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(TOKENS_SEED))
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    model = ddp.module
    with torch.no_grad():
        if not mpu.is_pipeline_first_stage():
            hidden = torch.empty(16, 2, 32, dtype=args.params_dtype)
            torch.distributed.recv(hidden, src=mpu.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, positions, None)
        if not mpu.is_pipeline_last_stage():
            torch.distributed.send(
                out.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank()
            )
    t, p = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
    d = mpu.get_data_parallel_rank()
    result = {"iteration": iteration, "consumed_train_samples": args.consumed_train_samples}
    if mpu.is_pipeline_last_stage():
        parts = [torch.empty_like(out) for _ in range(tp)]
        torch.distributed.all_gather(
            parts, out.contiguous(), group=mpu.get_tensor_model_parallel_group()
        )
        result["logits"] = torch.cat(parts, dim=-1)[..., :VOCAB].clone()
    if distributed:
        result["flat"] = inner_optimizer(optimizer).get_parameter_state_dp_zero()
    if d == 0:
        torch.save(result, os.path.join(result_dir, f"rank_{t}_{p}.pt"))
    torch.distributed.destroy_process_group()


def _logits_rel(cli) -> float:
    """The logits' tolerance (relative to their largest): fp32 sums in another order, or under
    --bf16 four bf16 rounding steps of the largest (megalite's and Megatron's kernels differ)."""
    return 4 * 2**-8 if cli.bf16 else 1e-5


def _check_layout(cli, extra: list[str]) -> bool:
    tp, pp, dp = cli.layout
    result_dir = tempfile.mkdtemp()
    spawn(_layout_rank, tp * pp * dp, (cli.check_load, cli.ckpt_format, result_dir, extra, tp, pp))
    want = torch.load(os.path.join(cli.check_load, "reference.pt"), weights_only=False)
    ok, notes = True, []
    for t in range(tp):
        for p in range(pp):
            got = torch.load(os.path.join(result_dir, f"rank_{t}_{p}.pt"), weights_only=False)
            ok &= got["iteration"] == want["iteration"]
            if "logits" in got:
                err = (got["logits"] - want["logits"]).abs().max() / want["logits"].abs().max()
                notes.append(f"logits (TP {t}) max rel err {err.item():.2e}")
                ok &= err.item() < _logits_rel(cli)
            if "flat" in got and cli.distopt_ref:
                ref_dir = os.path.join(
                    cli.distopt_ref,
                    sorted(d for d in os.listdir(cli.distopt_ref) if d.startswith("iter_"))[-1],
                )
                shard = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                ref = torch.load(
                    os.path.join(ref_dir, shard, "distrib_optim.pt"), weights_only=False
                )
                mine, theirs = next(iter(ref[0].values())), next(iter(got["flat"][0].values()))
                same = all(
                    torch.equal(mine[k], theirs[k]) for k in ("param", "exp_avg", "exp_avg_sq")
                )
                notes.append(f"Adam state of {shard} = megalite's: {'yes' if same else 'NO'}")
                ok &= same
    verdict = "ok" if ok else "MISMATCH"
    what = f"{cli.check_load} ({cli.ckpt_format} {' '.join(extra)})"
    print(f"Megatron loaded {what} at TP {tp} x PP {pp} x DP {dp}: {'; '.join(notes)} -> {verdict}")
    return ok


def _adam_mismatches(load: str, fmt: str, got: dict) -> list[str]:
    """Where the Adam state Megatron loaded differs from the one megalite reads in the same files
    (megalite's readers are checked against Megatron's own files by the tests)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from megalite.checkpoint.files import read_tracker
    from megalite.checkpoint.megatron import open_reader

    iter_dir = os.path.join(load, f"iter_{read_tracker(load):07d}")
    reader = open_reader(iter_dir, fmt)
    want = reader.optimizer_state(0, 0)["params"] if fmt == "torch" else None
    bad = []
    for name, state in got.items():
        expected = want[name] if want is not None else reader.optimizer_tensors(name)
        for key, tensor in state.items():
            if not torch.equal(expected[key].float(), tensor):
                bad.append(f"{name}.{key}")
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument(
        "--output", default=os.path.join(here, "..", "tests", "fixtures", "megatron_ckpt")
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="Megatron's --bf16 run (fp32 masters, fp32 grads): the fixtures go to OUTPUT/bf16; "
        "with --check-load: Megatron loads with --bf16",
    )
    parser.add_argument("--check-load", default=None, help="a checkpoint megalite wrote")
    parser.add_argument("--ckpt-format", default="torch_dist", choices=("torch", "torch_dist"))
    parser.add_argument("--only-distopt", action="store_true", help="write only " + DISTOPT)
    parser.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="with --check-load: Megatron loads with --use-distributed-optimizer",
    )
    parser.add_argument(
        "--layout",
        type=int,
        nargs=3,
        default=None,
        metavar=("TP", "PP", "DP"),
        help="with --check-load: load at this layout (TP x PP x DP processes)",
    )
    parser.add_argument(
        "--bucket-flags",
        default="",
        help="with --layout: e.g. '--overlap-grad-reduce --ddp-bucket-size 540'",
    )
    parser.add_argument(
        "--distopt-ref",
        default=None,
        help="with --layout: megalite's torch-format save of the same state",
    )
    cli = parser.parse_args()
    precision = ["--bf16"] if cli.bf16 else []
    extra = ["--use-distributed-optimizer"] if cli.distributed_optimizer else []
    extra += precision
    if cli.check_load and cli.layout:
        raise SystemExit(0 if _check_layout(cli, extra + cli.bucket_flags.split()) else 1)
    if cli.check_load:
        result = os.path.join(tempfile.mkdtemp(), "logits.pt")
        spawn(_logits_rank, 1, cli.check_load, cli.ckpt_format, result, extra)
        got = torch.load(result, weights_only=False)
        want = torch.load(os.path.join(cli.check_load, "reference.pt"), weights_only=False)
        err = ((got["logits"] - want["logits"]).abs().max() / want["logits"].abs().max()).item()
        bad = _adam_mismatches(cli.check_load, cli.ckpt_format, got["adam"])
        it, seen = got["iteration"], got["consumed_train_samples"]
        what = f"{cli.check_load} ({cli.ckpt_format}{' + ' if extra else ''}{' '.join(extra)})"
        same = "yes" if not bad else "NO: " + ", ".join(bad[:4])
        print(
            f"Megatron loaded {what} at iteration {it}: logits max rel err {err:.2e}, consumed "
            f"{seen}, Adam state of {len(got['adam'])} parameters = megalite's: {same}"
        )
        ok = err < _logits_rel(cli) and got["iteration"] == want["iteration"] and not bad
        raise SystemExit(0 if ok else 1)
    out = os.path.abspath(os.path.join(cli.output, "bf16") if cli.bf16 else cli.output)
    if cli.only_distopt:
        shutil.rmtree(os.path.join(out, DISTOPT), ignore_errors=True)
        spawn(_save_distopt_rank, 8, out, precision)
        print(f"fixtures -> {out}/{DISTOPT}")
        return
    for name in ("legacy_tp2_pp2", "dist_tp2_pp2", DISTOPT):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    spawn(_save_rank, 4, out, precision)
    spawn(_save_distopt_rank, 8, out, precision)
    reference = os.path.join(out, "reference.pt")
    spawn(_logits_rank, 1, os.path.join(out, "dist_tp2_pp2"), "torch_dist", reference, precision)
    print(f"fixtures -> {out}")


if __name__ == "__main__":
    main()
