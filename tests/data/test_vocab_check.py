"""The start-up vocabulary check reads each ``.bin`` once per node, before any process group: local
rank 0 scans a cold cache, the node's other ranks wait for the entry it writes (and fail in one
line, naming the file and the fix, when it never comes)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from megalite.data import cache_dirs, index_cache, vocab_check
from megalite.data.indexed_dataset import IndexedDataset
from megalite.errors import DataError
from megalite.training.arguments import parse_args
from megalite.training.config import with_tokenizer
from megalite.training.launch import LaunchInfo
from megalite.training.startup_checks import check_startup
from tests.user_errors import TINY, dataset, files_under, good_docs, read_only

LOCAL_RANKS = 3  # one node


def _rank(local_rank: int, argv: list[str], looked, results) -> None:
    """One rank's start-up checks (a forked process): the ``.bin`` files it scanned and its
    outcome go to ``results``."""
    scanned: list[str] = []
    scan, try_load = vocab_check.scan_token_range, index_cache.try_load

    def counting_scan(indexed):
        scanned.append(indexed.prefix)
        return scan(indexed)

    def noting_try_load(folder, description, names):
        if description["kind"] == "TokenRange":
            looked[local_rank].set()  # this rank has looked for a cached range
        return try_load(folder, description, names)

    vocab_check.scan_token_range = counting_scan
    index_cache.try_load = noting_try_load
    try:
        cfg = with_tokenizer(parse_args(argv, env={}))
        launch = LaunchInfo("torchrun", local_rank, LOCAL_RANKS, local_rank, None, None)
        check_startup(cfg, launch)
        outcome = "ok"
    except DataError as e:
        outcome = str(e)
    results.put((local_rank, scanned, outcome))


def _start_ranks(argv: list[str]) -> dict[int, tuple[list[str], str]]:
    """Local ranks 0..2 of one node through the start-up checks: {local rank: (the .bin files it
    scanned, its outcome)}. The waiting ranks start first and look for the cache before local
    rank 0 exists (a cold cache)."""
    ctx = mp.get_context("fork")
    looked = [ctx.Event() for _ in range(LOCAL_RANKS)]
    results = ctx.Queue()
    procs = {
        r: ctx.Process(target=_rank, args=(r, argv, looked, results)) for r in range(LOCAL_RANKS)
    }
    for r in (1, 2):
        procs[r].start()
    for r in (1, 2):
        assert looked[r].wait(60), f"local rank {r} never looked for the cache"
    procs[0].start()
    got = {}
    for _ in range(LOCAL_RANKS):
        r, scanned, outcome = results.get(timeout=120)
        got[r] = (scanned, outcome)
    for p in procs.values():
        p.join(30)
        assert p.exitcode == 0
    return got


@pytest.mark.parametrize(
    "case", ["ids fit", "id 200 beyond the vocabulary", "read-only data folder"]
)
def test_a_cold_cache_is_read_by_local_rank_0_alone(tmp_path, monkeypatch, case):
    # a blend of two datasets: two .bin files, neither cached yet
    data = tmp_path / "data"
    data.mkdir()
    bad = case == "id 200 beyond the vocabulary"
    first = dataset(data, "a")
    second = dataset(data, "b", good_docs(seed=1) + ([[5, 200, 7]] if bad else []))
    argv = [*TINY, "--data-path", first, second, "--distributed-timeout-minutes", "2"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with read_only(data if case == "read-only data folder" else tmp_path / "unused") as ok:
        if case == "read-only data folder" and not ok:
            pytest.skip("cannot make a folder read-only here (no chattr for root)")
        got = _start_ranks(argv)
    # local rank 0 read each .bin once; the others read none, and reached the same verdict
    assert got[0][0] == [first, second]
    assert got[1][0] == [] and got[2][0] == []
    outcomes = {outcome for _, outcome in got.values()}
    assert len(outcomes) == 1
    outcome = outcomes.pop()
    if bad:
        assert outcome.startswith(f"--data-path {second}.bin: largest token id 200"), outcome
    else:
        assert outcome == "ok"
    # the ranges are cached beside the data, or per user when the data folder is read-only
    cached = files_under(tmp_path / "xdg") if case == "read-only data folder" else files_under(data)
    assert sum(f.endswith("TokenRange-description.json") for f in cached) == 2


def test_a_waiting_rank_gives_up_in_one_line(tmp_path):
    ds = IndexedDataset(dataset(tmp_path, "d"))
    with pytest.raises(DataError) as e:
        vocab_check.token_range(ds, scan=False, wait_s=0.2, flag="--train-data-path")
    message = str(e.value)
    assert "\n" not in message
    for needle in (
        f"--train-data-path {ds.prefix}.bin",
        "waited 0 s for local rank 0",
        str(tmp_path / "cache" / "GPTDataset_indices"),
        "tools/build_data_cache.py",
        "--distributed-timeout-minutes",
    ):
        assert needle in message, (needle, message)


def test_a_waiting_rank_scans_when_no_folder_is_writable(tmp_path, monkeypatch):
    # nobody could write the entry, so waiting would only time out: each rank reads on its own
    monkeypatch.setattr(cache_dirs, "can_write", lambda folder, probe=True: False)
    ds = IndexedDataset(dataset(tmp_path, "d", good_docs() + [[3, 99]]))
    assert vocab_check.token_range(ds, scan=False, wait_s=0.0) == (0, 126)
