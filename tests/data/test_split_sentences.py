"""``tools/preprocess_data.py --split-sentences`` (Megatron's: NLTK punkt, one sequence
per sentence, ``{prefix}_{key}_sentence`` files). NLTK is optional and nothing is downloaded:
without NLTK the run stops with one line saying how to install it; without its trained punkt
model it splits with an untrained ``PunktSentenceTokenizer()`` and says so in one warning line.
A stand-in ``nltk`` module (a test double with punkt's interface, splitting at ". ") checks what
megalite does with the sentences; where NLTK is installed, the real untrained
``PunktSentenceTokenizer`` runs end to end (skipped otherwise: NLTK is not a test dependency).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import types

import numpy as np
import pytest

from megalite.data import sentence_split
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import make_tokenizer
from tests.data.bpe_files import write_gpt2_files
from tests.data.helpers import files_in, write_jsonl
from tools import preprocess_data

# NullTokenizer reads ids written as numbers; the stand-in splits at ". " and drops the "."
DOCS = [{"text": "1 2 . 3 4 5 . 6"}, {"text": "7 8"}, {"text": " . "}, {"text": "9 . 10 11"}]


def _argv(tmp_path, *extra):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    return [
        "--input",
        src,
        "--output-prefix",
        str(tmp_path / "out" / "c"),
        *"--tokenizer-type NullTokenizer --vocab-size 100 --append-eod --split-sentences".split(),
        *extra,
    ]


@pytest.fixture
def fresh_punkt():
    sentence_split._punkt.cache_clear()
    sentence_split._model.cache_clear()
    yield
    sentence_split._punkt.cache_clear()
    sentence_split._model.cache_clear()


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
    nltk.tokenize.punkt.PunktSentenceTokenizer = lambda: Punkt.__new__(Punkt)  # untrained
    nltk.data = types.SimpleNamespace(load=load)
    monkeypatch.setitem(sys.modules, "nltk", nltk)
    monkeypatch.setitem(sys.modules, "nltk.tokenize", nltk.tokenize)
    monkeypatch.setitem(sys.modules, "nltk.tokenize.punkt", nltk.tokenize.punkt)


def test_without_nltk_one_line_how_to_install_and_no_output(
    tmp_path, capsys, monkeypatch, fresh_punkt
):
    monkeypatch.setitem(sys.modules, "nltk", None)  # import nltk -> ImportError
    assert preprocess_data.main(_argv(tmp_path)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs NLTK" in err[0] and "pip install nltk" in err[0], err
    assert not (tmp_path / "out").exists() or files_in(tmp_path / "out") == []


def test_without_the_punkt_model_untrained_punkt_and_one_warning_line(
    tmp_path, caplog, monkeypatch, fresh_punkt
):
    _stub_nltk(monkeypatch, has_model=False)
    with caplog.at_level(logging.WARNING):
        assert preprocess_data.main(_argv(tmp_path, "--lang", "german")) == 0
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "trained punkt model for german is not installed" in lines[0], lines
    assert "untrained PunktSentenceTokenizer()" in lines[0] and "punkt_tab" in lines[0], lines
    ds = IndexedDataset(str(tmp_path / "out" / "c_text_sentence"))
    assert len(ds) == 6  # split by the (stand-in) untrained tokenizer


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


TEXT = "Dr. Smith went home. He was tired!  Was he? Yes, 3.5 km away.\nThe end"
# NLTK's untrained punkt: breaks after . ! ? before whitespace, knows no abbreviation ("Dr.")
UNTRAINED = ["Dr.", "Smith went home.", "He was tired!", "Was he?", "Yes, 3.5 km away.", "The end"]


def test_real_untrained_punkt_end_to_end(tmp_path, monkeypatch, caplog, fresh_punkt):
    nltk = pytest.importorskip("nltk", reason="NLTK is not installed (not a test dependency)")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "no_nltk_data")])  # no model found
    assert sentence_split.PunktSplitter("english")(TEXT) == UNTRAINED
    assert not sentence_split._trained("english")
    vocab, merges = write_gpt2_files(tmp_path / "bpe", [])
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": TEXT}) + "\n", encoding="utf-8")
    argv = [
        "--input",
        str(src),
        "--output-prefix",
        str(tmp_path / "out" / "c"),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--split-sentences",
    ]
    with caplog.at_level(logging.WARNING):
        assert preprocess_data.main(argv) == 0
    assert sum("untrained PunktSentenceTokenizer()" in r.getMessage() for r in caplog.records) == 1
    tok = make_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    ds = IndexedDataset(str(tmp_path / "out" / "c_text_sentence"))
    assert [tok.detokenize(ds[i].tolist()) for i in range(len(ds))] == UNTRAINED
    assert ds.document_indices.tolist() == [0, len(UNTRAINED)]


def test_a_refused_split_leaves_the_callers_sigterm_handler(tmp_path, monkeypatch):
    """preprocess_data.main refuses --split-sentences without NLTK before installing its own
    SIGTERM handler, so an in-process caller's handler is the one left in place."""

    def no_nltk(lang, keep_newlines):
        raise sentence_split.SentenceSplitError(
            "--split-sentences needs NLTK (planted for the test)"
        )

    monkeypatch.setattr(sentence_split, "_punkt", no_nltk)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": TEXT}])
    before = signal.getsignal(signal.SIGTERM)
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "c")]
    argv += "--tokenizer-type NullTokenizer --vocab-size 100 --split-sentences".split()
    assert preprocess_data.main(argv) == 1
    assert signal.getsignal(signal.SIGTERM) is before
