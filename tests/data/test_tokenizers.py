"""Tokenizers: Megatron's NullTokenizer semantics, SentencePiece trained here, HuggingFace from a
local tokenizer.json or folder; DataConfig validation messages."""

from __future__ import annotations

import pickle

import pytest

from megalite.data.config import DataConfig, parse_blend, parse_split
from megalite.data.hf_tokenizer import HuggingFaceTokenizer
from megalite.data.null_tokenizer import NullTokenizer
from megalite.data.sentencepiece_tokenizer import SentencePieceTokenizer
from megalite.data.tokenizers import build_tokenizer
from tests.data.helpers import write_dataset


def test_null_tokenizer_megatron_semantics():
    tok = NullTokenizer(100)
    assert tok.eod == 100 and tok.vocab_size == 101
    assert tok.tokenize(" 5 0\t99\n7 ") == [5, 0, 99, 7]
    assert tok.detokenize([5, 0, 99]) == "5 0 99"
    with pytest.raises(ValueError, match=r"id 100 is outside \[0, 100\) set by --vocab-size 100"):
        tok.tokenize("1 100")
    with pytest.raises(ValueError, match=r"integer ids, got 'x1'"):
        tok.tokenize("1 x1")


def test_sentencepiece_trained_in_test(sp_model, tmp_path):
    tok = SentencePieceTokenizer(sp_model)
    assert tok.vocab_size == 320
    assert (tok.unk, tok.bos, tok.eos, tok.pad) == (0, 1, 2, 3) and tok.eod == tok.eos
    text = "alpha beta gamma ☃ unseen"  # ☃ is not in the corpus: byte fallback keeps it
    ids = tok.tokenize(text)
    assert all(0 <= i < 320 for i in ids) and tok.detokenize(ids) == text
    assert tok.tokenize_batch([text, "delta"]) == [ids, tok.tokenize("delta")]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(text) == ids


def test_train_tokenizer_tool_unigram(corpus_jsonl, tmp_path):
    from tools.train_tokenizer import main

    prefix = str(tmp_path / "uni")
    args = ["--input", corpus_jsonl, "--model-prefix", prefix, "--vocab-size", "30"]
    assert main([*args, "--model-type", "unigram", "--no-byte-fallback"]) == 0
    tok = SentencePieceTokenizer(prefix + ".model")
    assert tok.vocab_size == 30 and tok.detokenize(tok.tokenize("alpha beta")) == "alpha beta"


def _hf_tokenizer_json(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"])
    tk.train_from_iterator(["alpha beta gamma delta"] * 20 + ["kappa lambda zeta"] * 20, trainer)
    path = folder / "tokenizer.json"
    tk.save(str(path))
    return tk, path


def test_huggingface_tokenizer_from_file_and_folder(tmp_path):
    pytest.importorskip("tokenizers")
    raw, path = _hf_tokenizer_json(tmp_path)
    by_file = HuggingFaceTokenizer(str(path))
    assert by_file.eod == raw.token_to_id("</s>") == 1
    assert by_file.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    text = "alpha beta kappa"
    assert by_file.tokenize(text) == raw.encode(text).ids
    by_folder = HuggingFaceTokenizer(str(tmp_path))
    assert by_folder.tokenize(text) == by_file.tokenize(text) and by_folder.eod == 1
    assert by_folder.detokenize(by_folder.tokenize(text)).replace(" ", "") == "alphabetakappa"
    assert pickle.loads(pickle.dumps(by_file)).tokenize(text) == by_file.tokenize(text)


def test_build_tokenizer_from_config(sp_model):
    assert build_tokenizer(DataConfig(vocab_size=7, mock_data=True)).eod == 7
    cfg = DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model)
    assert build_tokenizer(cfg).vocab_size == 320


def test_parse_split_and_blend(tmp_path):
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.03, 0.001))
    assert parse_split("98/2") == pytest.approx((0.98, 0.02, 0.0))
    a = write_dataset(tmp_path / "a", [[1]])
    b = write_dataset(tmp_path / "b", [[2]])
    assert parse_blend([a]) == ([a], None)
    assert parse_blend(["0.3", a, "0.7", b]) == ([a, b], [0.3, 0.7])
    assert parse_blend([a, b]) == ([a, b], None)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tokenizer_type": "BertWordPieceCase"}, r"--tokenizer-type 'BertWordPieceCase' is not"),
        ({"tokenizer_type": "GPT2BPETokenizer"}, r"GPT2BPETokenizer needs --vocab-file"),
        ({}, r"NullTokenizer needs --vocab-size V >= 1 \(got None\)"),
        ({"tokenizer_type": "SentencePieceTokenizer"}, r"needs --tokenizer-model"),
        ({"vocab_size": 9}, r"no data: pass --data-path"),
        ({"vocab_size": 9, "mock_data": True, "data_path": ["x"]}, r"mutually exclusive"),
        ({"vocab_size": 9, "data_path": ["0.5", "P"]}, r"P\.idx does not exist"),
        ({"vocab_size": 9, "data_path": ["0.5", "P", "0.5"]}, r"has 3 entries"),
        ({"vocab_size": 9, "data_path": ["-1", "P"]}, r"weight -1 for P must be > 0"),
        ({"vocab_size": 9, "split": "a,b", "data_path": ["P"]}, r"--split 'a,b' is not a list"),
        ({"vocab_size": 9, "split": "1,1,1,1", "data_path": ["P"]}, r"needs 1 to 3 non-neg"),
    ],
)
def test_config_validation_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**kwargs).validate()


def test_keep_whitespace_round_trips_code(tmp_path):
    """``--keep-whitespace``: newlines and indentation survive encode -> decode (the default
    normalisation folds them into single spaces, which ruins code)."""
    import json

    from megalite.data.tokenizer_training import train_sentencepiece

    code = "def f(x):\n    if x:\n        return x  + 1\n    return None\n"
    path = tmp_path / "code.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": code.replace("x", f"v{i % 17}")}) + "\n")
    kept = SentencePieceTokenizer(
        train_sentencepiece(
            [str(path)], model_prefix=str(tmp_path / "k"), vocab_size=300, keep_whitespace=True
        )
    )
    folded = SentencePieceTokenizer(
        train_sentencepiece([str(path)], model_prefix=str(tmp_path / "f"), vocab_size=300)
    )
    assert kept.detokenize(kept.tokenize(code)) == code
    assert folded.detokenize(folded.tokenize(code)) != code
