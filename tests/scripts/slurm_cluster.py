"""A real two-node SLURM on this one machine, for the SLURM tests.

    reason = install_reason()           # None when SLURM can run here; else why the tests skip
    with SlurmCluster(tmp_path) as cluster:
        job = cluster.sbatch("--nodes=2", "scripts/slurm/pretrain_gpt.sbatch", env=env)
        cluster.wait(job, ("COMPLETED",), timeout=60)

Debian's ``slurm-wlm`` (22.05) and ``munge``, installed with apt-get when missing, only as root and
only under CI (``CI=true``, as ``.ci/run`` has it) or with ``MEGALITE_INSTALL_SLURM=1``: a test
run on a developer's machine never installs system packages unasked. The cluster: a private
munged (its own key and socket under the temp folder, so a system munged is left alone),
slurmctld, and two slurmd started with ``-N n1`` / ``-N n2``, both nodes at 127.0.0.1 (traffic
stays on loopback), on ports free when it starts. No cgroups, no systemd: ``proctrack/linuxproc``
and ``task/none``. Every daemon runs in the foreground as a child of this process; ``stop()``
cancels the jobs, then ends each daemon and every process of the cluster (slurmstepd, the job's
shells, torchrun and its workers) by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NODES = ("n1", "n2")
# A requeued job may start again only once its old credential has expired (120 s by default).
CRED_EXPIRE = 5  # the least slurm accepts (less: "invalid", and 120 s)
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun", "scancel", "sinfo")
PACKAGES = ("slurm-wlm", "munge")


def install_reason() -> str | None:
    """None when SLURM and munge are usable here (installed first if allowed: see the module
    docstring); otherwise the reason the SLURM tests must skip (one line)."""
    if os.geteuid() != 0:
        return "not root: the SLURM test runs munged, slurmctld and slurmd as root"
    if all(shutil.which(d) for d in COMMANDS):
        return None
    if not shutil.which("apt-get"):
        return "SLURM is not installed and there is no apt-get to install slurm-wlm and munge"
    if (
        os.environ.get("CI", "").lower() != "true"
        and os.environ.get("MEGALITE_INSTALL_SLURM") != "1"
    ):
        return (
            "SLURM is not installed; the test installs slurm-wlm and munge with apt-get only "
            "under CI=true or MEGALITE_INSTALL_SLURM=1"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    quiet = {"capture_output": True, "text": True, "env": env, "timeout": 300}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(install, **quiet)
    if proc.returncode != 0:  # the package lists may be missing or stale: refresh once
        subprocess.run(["apt-get", "update", "-q"], **quiet)
        proc = subprocess.run(install, **quiet)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return f"apt-get install {' '.join(PACKAGES)} failed: {last[0][:200]}"
    missing = [d for d in COMMANDS if not shutil.which(d)]
    return f"installed {' '.join(PACKAGES)} but {missing} are missing" if missing else None


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first-level first), read from /proc."""
    out, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def processes_with_env(marker: str) -> list[int]:
    """Pids whose environment holds ``marker`` (``SLURM_CONF=<our path>``): every process of this
    cluster, slurmstepd included (it detaches from slurmd, so it is nobody's child of ours)."""
    needle = marker.encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (bound together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _slurm_conf(root: Path, host: str, ports: list[int]) -> str:
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=1 "
        "RealMemory=1000 State=UNKNOWN"
        for name, port in zip(NODES, ports[1:])
    )
    return f"""\
ClusterName=megalite
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
# seconds from SIGTERM to SIGKILL: the preempted step saves in them, on a loaded machine too
KillWait=300
MinJobAge=600
MessageTimeout=20
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """munged + slurmctld + two slurmd under ``root``; see the module docstring."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- bring-up ----------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> SlurmCluster:
        r = self.root
        for d in ("munge", "state", "spool/n1", "spool/n2"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        ports = free_ports(1 + len(NODES))  # slurmctld, then one slurmd per node
        self.conf.write_text(_slurm_conf(r, socket.gethostname(), ports))
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={r}/munge/munge.socket",
                f"--key-file={key}",
                f"--pid-file={r}/munge/munged.pid",
                f"--log-file={r}/munge/munged.log",
                f"--seed-file={r}/munge/munged.seed",
            ],
        )
        self._until(lambda: (r / "munge" / "munge.socket").exists(), timeout, "munged socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._until(lambda: self._ok(["scontrol", "ping"], "UP"), timeout, "slurmctld ping")
        for name in NODES:
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        self._until(self._nodes_idle, timeout, "both nodes idle")
        return self

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.out", "wb")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.root
        )
        log.close()

    def _ok(self, cmd: list[str], needle: str) -> bool:
        out = self.run(cmd, check=False)
        return needle in out

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).split()
        return out.count("idle") == len(NODES)

    def _until(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise SlurmError(f"{dead} exited during bring-up; logs: {self.logs()}")
            if ok():
                return
            time.sleep(0.2)
        raise SlurmError(f"timed out after {timeout:.0f} s waiting for {what}; logs: {self.logs()}")

    # -- using it ----------------------------------------------------------------------------
    def run(self, cmd: list[str], *, check: bool = True, env: dict | None = None) -> str:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**self.env, **(env or {})}, timeout=60
        )
        if check and proc.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, *args: str, env: dict | None = None, cwd: str | None = None) -> int:
        proc = subprocess.run(
            ["sbatch", "--parsable", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**self.env, **(env or {})},
            cwd=cwd,
        )
        if proc.returncode != 0:
            raise SlurmError(f"sbatch {' '.join(args)} failed: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, RestartCnt, ExitCode, ...)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        fields = {}
        for item in out.split():
            if "=" in item:
                k, v = item.split("=", 1)
                fields[k] = v
        return fields

    def wait(self, job_id: int, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """Poll until the job's state is one of ``states`` (or a final state); return its fields."""
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            state = info.get("JobState")
            if state in states or state in final:
                return info
            time.sleep(0.25)
        raise SlurmError(f"job {job_id} not in {states} after {timeout:.0f} s: {info}")

    def logs(self) -> str:
        parts = []
        for f in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            text = f.read_text(errors="replace").strip().splitlines()[-5:]
            parts.append(f"\n== {f.name}\n" + "\n".join(text))
        return "".join(parts)

    # -- tear-down ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, then end each daemon and everything below it, by pid."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--user", "root"], check=False)
        pids = set(processes_with_env(f"SLURM_CONF={self.conf}"))
        for proc in self.procs.values():
            pids.update(descendants(proc.pid))
        pids -= {p.pid for p in self.procs.values()}
        for name in reversed(list(self.procs)):  # slurmd, slurmctld, then munged
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for pid in pids:  # job steps and their children left by the daemons
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs.clear()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
