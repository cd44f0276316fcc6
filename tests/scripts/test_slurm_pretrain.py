"""``scripts/slurm/pretrain_gpt.sbatch`` on a real SLURM: two slurmd "nodes" on this machine.

Submitted with ``--nodes=2``: one srun task per node, each a torchrun with one CPU (gloo) worker,
rendezvous on the first node; the model is split in two pipeline stages, one per node. Once the
job is training, the test sends USR1 to its batch shell (what ``#SBATCH --signal=B:USR1@120`` does
before the time limit). Checked: the shell forwards it, the ranks stop at one iteration k, save it
and exit 0, the shell requeues the job; the requeued run (same job id, same log) says it resumes
from k, loads iteration k and trains k+1..N; the job ends COMPLETED with exit code 0, its log holds
every iteration 1..N exactly once, the periodic and final checkpoints exist. The losses of both
runs equal those of an uninterrupted run of the same flags and layout (PP 2, driven in-process on
two gloo ranks by ``tests.training.common.train_losses``), as printed: 7 significant digits, exact
string equality (resume is bitwise-exact on CPU and the layout is the same, so no tolerance).

The cluster and every process it starts are ended by pid (``SlurmCluster.stop``). SLURM holds a
requeued job until its old credential expires (``cred_expire``: 120 s by default, 5 s here).
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megalite.training.arguments import parse_args
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.paths import ROOT
from tests.scripts.slurm_cluster import SlurmCluster, free_ports, install_reason
from tests.training.common import train_losses

SCRIPT = ROOT / "scripts" / "slurm" / "pretrain_gpt.sbatch"
ITERS = 60
LOSS = re.compile(r" iteration +(\d+)/ +\d+ \| .* lm loss: ([0-9.E+-]+) \|")
FLAGS = {  # the sbatch script's flag groups, shrunk to a tiny model
    "MODEL_ARGS": "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--hidden-dropout 0 --attention-dropout 0",
    "PARALLEL_ARGS": "--pipeline-model-parallel-size 2",
    "TRAIN_ARGS": f"--micro-batch-size 2 --global-batch-size 8 --train-iters {ITERS} "
    "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --seed 7",
    "DATA_ARGS": "--mock-data --tokenizer-type NullTokenizer --vocab-size 127",
    "LOG_ARGS": "--log-interval 1 --eval-iters 0",
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = install_reason()
    if reason:
        pytest.skip(f"SLURM test skipped: {reason}")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _submit(cluster: SlurmCluster, tmp: Path) -> tuple[int, Path]:
    env = {
        **FLAGS,
        "MEGALITE_DIR": str(ROOT),
        "CHECKPOINT_DIR": str(tmp / "ckpt"),
        "SAVE_INTERVAL": "25",
        "NPROC_PER_NODE": "1",
        "RDZV_PORT": str(free_ports(1)[0]),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    job = cluster.sbatch(
        "--nodes=2", f"--output={tmp}/%x-%j.out", str(SCRIPT), env=env, cwd=str(ROOT)
    )
    return job, tmp / f"megalite-gpt-{job}.out"


def _uninterrupted_losses() -> list[float]:
    """On each of two gloo ranks: the same flags and layout, run start to end in-process."""
    argv = shlex.split(" ".join(FLAGS.values()))
    cfg = parse_args(argv, env={"RANK": str(dist.get_rank()), "WORLD_SIZE": "2"})
    ps = mesh(1, 2)
    try:
        return train_losses(cfg, ps).losses
    finally:
        ps.destroy()


def _losses(text: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for it, loss in LOSS.findall(text):
        assert int(it) not in found, f"iteration {it} logged twice"
        found[int(it)] = loss
    return found


def _read(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def _context(cluster: SlurmCluster, log: Path) -> str:
    return f"\n--- job log:\n{_read(log)[-4000:]}\n--- daemons:{cluster.logs()}"


def _until(ok, timeout: float, what: str, cluster: SlurmCluster, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out: {what}" + _context(cluster, log)
        time.sleep(0.1)


@pytest.mark.slow
def test_sbatch_two_nodes_preempted_requeued_resumed(cluster, tmp_path):
    job, log = _submit(cluster, tmp_path)
    state = lambda: cluster.job(job).get("JobState")  # noqa: E731
    _until(
        lambda: re.search(r" iteration +5/", _read(log)) or state() not in ("PENDING", "RUNNING"),
        600,  # hang guards, here and below: far above a loaded machine's time
        "iteration 5",
        cluster,
        log,
    )
    assert state() == "RUNNING", _context(cluster, log)
    cluster.run(["scancel", "--batch", "--signal=USR1", str(job)])
    _until(lambda: cluster.job(job).get("Restarts", "0") != "0", 600, "requeue", cluster, log)
    reference = run_distributed(_uninterrupted_losses, 2)[1]  # the last stage's, meanwhile
    info = cluster.wait(job, ("COMPLETED",), timeout=600)
    text = _read(log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", _context(cluster, log)
    first, _, second = text.partition(f"=== megalite job {job} (restart 1)")
    assert second, "the requeued run did not start" + _context(cluster, log)
    assert "=== nodes n[1-2]: 2 x 1 workers, rendezvous n1 (127.0.0.1:" in first
    assert "world 2 = TP 1 x PP 2 x DP 1 on cpu (gloo)" in first

    (k,) = map(int, re.findall(r"exiting program at iteration (\d+): SIGUSR1 received", first))
    assert 5 <= k < ITERS, k
    assert f"saved checkpoint at iteration {k} " in first
    assert "training step exited with status 0" in first and "=== requeued" in first
    assert f"=== resuming from iteration {k}" in second
    assert re.search(rf"loaded checkpoint \S+ \(TP 1 x PP 2 x DP 1\) in .* iteration {k},", second)
    assert f"training done: {ITERS} iterations" in second
    before, after = _losses(first), _losses(second)
    assert sorted(before) == list(range(1, k + 1)), sorted(before)[-3:]
    assert sorted(after) == list(range(k + 1, ITERS + 1)), sorted(after)[:3]
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    for it in (k, 25, 50, ITERS):
        assert (ckpt / f"iter_{it:07d}" / "mp_rank_00_001" / "model_optim_rng.pt").exists(), it

    assert len(reference) == ITERS and reference[-1] < reference[0]  # it trains: not vacuous
    logged = {**before, **after}
    differ = [
        (i, logged[i], f"{reference[i - 1]:.6E}")
        for i in sorted(logged)
        if logged[i] != f"{reference[i - 1]:.6E}"
    ]
    assert not differ, f"losses differ from the uninterrupted run at {differ[:5]}"
