"""Issue 18: ``tools/preprocess_data.py --split-sentences`` (Megatron's: NLTK punkt, one sequence
per sentence, ``{prefix}_{key}_sentence`` files). NLTK is optional and never downloaded: without
it (or without its punkt model) the run stops with one line saying how to install them. The
splitting itself is NLTK's; here a stand-in ``nltk`` module (a test double with punkt's interface,
splitting at ". ") checks what megalite does with the sentences it returns.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from megalite.data import sentence_split
from megalite.data.indexed_dataset import IndexedDataset
from tests.data.helpers import files_in, write_jsonl
from tools import preprocess_data

# NullTokenizer reads ids written as numbers; the stand-in splits at ". " and drops the "."
DOCS = [{"text": "1 2 . 3 4 5 . 6"}, {"text": "7 8"}, {"text": " . "}, {"text": "9 . 10 11"}]


def _argv(tmp_path, *extra):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    return ["--input", src, "--output-prefix", str(tmp_path / "out" / "c"),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--append-eod",
            "--split-sentences", *extra]  # fmt: skip


@pytest.fixture
def fresh_punkt():
    sentence_split._punkt.cache_clear()
    yield
    sentence_split._punkt.cache_clear()


def _stub_nltk(monkeypatch, *, has_model: bool) -> None:
    class Punkt:
        def __init__(self, lang):
            if not has_model:
                raise LookupError(f"Resource punkt_tab/{lang} not found")

        def tokenize(self, text):
            return [p.strip() for p in text.split(". ")]

    def load(name):
        raise LookupError(name)

    nltk = types.ModuleType("nltk")
    nltk.tokenize = types.ModuleType("nltk.tokenize")
    nltk.tokenize.PunktTokenizer = Punkt
    nltk.tokenize.punkt = types.ModuleType("nltk.tokenize.punkt")
    nltk.data = types.SimpleNamespace(load=load)
    monkeypatch.setitem(sys.modules, "nltk", nltk)
    monkeypatch.setitem(sys.modules, "nltk.tokenize", nltk.tokenize)
    monkeypatch.setitem(sys.modules, "nltk.tokenize.punkt", nltk.tokenize.punkt)


def test_without_nltk_one_line_how_to_install_and_no_output(tmp_path, capsys, monkeypatch,
                                                             fresh_punkt):  # fmt: skip
    monkeypatch.setitem(sys.modules, "nltk", None)  # import nltk -> ImportError
    assert preprocess_data.main(_argv(tmp_path)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs NLTK" in err[0] and "pip install nltk" in err[0], err
    assert not (tmp_path / "out").exists() or files_in(tmp_path / "out") == []


def test_without_the_punkt_model_one_line(tmp_path, capsys, monkeypatch, fresh_punkt):
    _stub_nltk(monkeypatch, has_model=False)
    assert preprocess_data.main(_argv(tmp_path, "--lang", "german")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "punkt model for german is not installed" in err[0], err


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sentences_are_sequences_of_their_documents(tmp_path, monkeypatch, fresh_punkt, workers):
    _stub_nltk(monkeypatch, has_model=True)
    if workers == "2":  # the pool's workers import nltk themselves: fork keeps the stand-in
        import multiprocessing as mp

        if mp.get_start_method(allow_none=True) not in (None, "fork"):
            pytest.skip("the stand-in nltk reaches workers only by fork")
    assert preprocess_data.main(_argv(tmp_path, "--workers", workers)) == 0
    assert files_in(tmp_path / "out") == ["c_text_sentence.bin", "c_text_sentence.idx"]
    ds = IndexedDataset(str(tmp_path / "out" / "c_text_sentence"))
    seqs = [ds[i].tolist() for i in range(len(ds))]
    eod = 100
    assert seqs == [[1, 2], [3, 4, 5], [6, eod], [7, 8, eod], [9], [10, 11, eod]], seqs
    # documents: 3 sentences, 1, (the empty one skipped), 2
    assert ds.document_indices.tolist() == [0, 3, 4, 6]
    assert np.all(np.diff(ds.document_indices) > 0)
