from __future__ import annotations

import random

import pytest

from tests.data.helpers import write_jsonl

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "theta",
    "kappa",
    "lambda",
    "ünï",
    "日本",
]


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory) -> str:
    """300 documents of 5 to 40 words (with some multi-line texts), written once per session."""
    rng = random.Random(0)
    records = []
    for i in range(300):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 40))]
        if i % 7 == 0:
            words.insert(len(words) // 2, "\n")
        records.append({"text": " ".join(words), "id": str(i)})
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", records)


@pytest.fixture(scope="session")
def sp_model(corpus_jsonl, tmp_path_factory) -> str:
    """A SentencePiece BPE model (vocab 320, byte fallback) trained on the corpus in the test."""
    from megalite.data.tokenizer_training import train_sentencepiece

    prefix = tmp_path_factory.mktemp("sp") / "tok"
    return train_sentencepiece([corpus_jsonl], str(prefix), vocab_size=320, model_type="bpe")
