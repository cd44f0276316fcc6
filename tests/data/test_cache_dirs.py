"""Where the dataset caches go: beside the data, or a per-user folder when the data folder is
read-only (one warning line, and the second run reads what the first one cached)."""

from __future__ import annotations

import logging
import os

import pytest

from megalite.data import cache_dirs, gpt_dataset, vocab_check
from pretrain_gpt import main
from tests.user_errors import TINY, dataset, files_under, read_only


class _Lines(logging.Handler):
    """The messages of one logger, whatever the handlers and propagation above it."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_read_only_data_folder_is_cached_per_user_and_read_once(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    data.mkdir()
    prefix = dataset(data, "d")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    scans, builds = [], []
    scan, build = vocab_check.scan_token_range, gpt_dataset.build_gpt_indices
    monkeypatch.setattr(vocab_check, "scan_token_range", lambda ds: scans.append(1) or scan(ds))
    monkeypatch.setattr(
        gpt_dataset, "build_gpt_indices", lambda *a, **k: builds.append(1) or build(*a, **k)
    )
    argv = [*TINY, "--data-path", prefix, "--eval-iters", "1", "--eval-interval", "2"]
    before = files_under(data)
    with read_only(data) as ok:
        if not ok:
            pytest.skip("cannot make a folder read-only here (no chattr for root)")
        lines = _Lines()
        logging.getLogger(cache_dirs.__name__).addHandler(lines)
        try:
            assert main(argv) == 0
            first, warned = (len(scans), len(builds)), list(lines.lines)
            assert main(argv) == 0
        finally:
            logging.getLogger(cache_dirs.__name__).removeHandler(lines)
    capsys.readouterr()
    # the first run read the .bin once and built the train and valid indices (the test split of
    # --split 969,30,1 is empty); the second did neither
    assert first == (1, 2)
    assert (len(scans), len(builds)) == first
    # one warning line naming the data folder and where its caches went
    user = cache_dirs.user_cache_dir(str(data / "cache" / "GPTDataset_indices"))
    assert len(warned) == 1, warned
    assert str(data) in warned[0] and os.path.dirname(user) in warned[0]
    assert "--data-cache-path" in warned[0]
    assert lines.lines == warned  # nothing more in the second run
    # the entries are in the per-user folder; the data folder is as it was
    assert any(name.endswith("TokenRange-description.json") for name in os.listdir(user))
    assert sum(name.endswith("GPTDataset-description.json") for name in os.listdir(user)) == 2
    assert files_under(data) == before


def test_the_per_user_folder_is_one_per_data_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    a = cache_dirs.user_cache_dir("/runs/one/corpus/cache/GPTDataset_indices")
    b = cache_dirs.user_cache_dir("/runs/two/corpus/cache/GPTDataset_indices")
    blend = cache_dirs.user_cache_dir("/runs/one/corpus/cache/BlendedDataset_indices")
    assert a != b  # the same folder name elsewhere: its own cache
    assert os.path.dirname(a) == os.path.dirname(blend)  # one folder per data folder
    assert a.startswith(str(tmp_path / "xdg" / "megalite" / "corpus-"))
    assert os.path.basename(a) == "GPTDataset_indices"
    monkeypatch.delenv("XDG_CACHE_HOME")
    home = os.path.expanduser("~")
    assert cache_dirs.user_cache_root() == os.path.join(home, ".cache", "megalite")


def test_a_writable_data_folder_keeps_its_caches_beside_the_data(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    beside = str(tmp_path / "data" / "cache" / "GPTDataset_indices")
    (tmp_path / "data").mkdir()
    assert cache_dirs.resolve(None, beside=beside) == cache_dirs.CacheDirs((beside,), beside)
    given = str(tmp_path / "given")
    assert cache_dirs.resolve(given, beside=beside) == cache_dirs.CacheDirs((given,), given)
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "data" / "cache").exists()
