"""The quickstart's own tools: the standard-library corpus and transformers generation.

``stdlib_documents`` on a fake library folder: exactly the .py files expected (tests, site-packages,
the excluded folders, empty and non-UTF-8 files left out), in sorted order, the text unchanged;
``write_corpus`` writes them as jsonl, honours ``max_mb`` and refuses an empty library; on the real
standard library it finds ``os.py``. ``generate`` with --greedy on a tiny random Llama and a tiny
SentencePiece tokenizer gives the tokens of a plain argmax loop over the model's logits, the prompt
encoded by SentencePiece itself with no BOS (an exact comparison of token ids).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tools.make_stdlib_corpus import stdlib_documents, write_corpus

FILES = {
    "a.py": "x = 1\n",
    "pkg/b.py": "def f():\n    return 2\n",
    "pkg/tests/t.py": "assert True\n",
    "test/test_x.py": "import unittest\n",
    "site-packages/s.py": "third = 'party'\n",
    "encodings/cp.py": "table = {0x41: 'A'}\n",
    "empty.py": "   \n",
    "notes.txt": "not python\n",
}


@pytest.fixture
def library(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    for rel, text in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "latin1.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped
    return root


def test_stdlib_documents_picks_the_library_code(library):
    docs = list(stdlib_documents(str(library)))
    assert docs == [("a.py", FILES["a.py"]), ("pkg/b.py", FILES["pkg/b.py"])]
    with_tests = [p for p, _ in stdlib_documents(str(library), include_tests=True)]
    assert with_tests == ["a.py", "pkg/b.py", "pkg/tests/t.py", "test/test_x.py"]
    everything = [p for p, _ in stdlib_documents(str(library), exclude=())]
    assert everything == ["a.py", "encodings/cp.py", "pkg/b.py"]


def test_write_corpus_jsonl_limit_and_errors(library, tmp_path):
    out = tmp_path / "c.jsonl"
    assert write_corpus(str(out), root=str(library)) == (2, 6 + 22)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == [
        {"text": FILES["a.py"], "path": "a.py"},
        {"text": FILES["pkg/b.py"], "path": "pkg/b.py"},
    ]
    assert write_corpus(str(out), root=str(library), max_mb=10e-6) == (1, 6)
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="no .py files found under"):
        write_corpus(str(tmp_path / "x.jsonl"), root=str(tmp_path / "none"))
    assert not (tmp_path / "x.jsonl").exists()


def test_the_real_standard_library_is_there():
    names = {p for p, _ in stdlib_documents()}
    assert "os.py" in names and "json/decoder.py" in names and len(names) > 300
    assert not any(p.startswith(("test/", "encodings/")) for p in names)


def test_generate_greedy_equals_a_plain_argmax_loop(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    spm = pytest.importorskip("sentencepiece")
    from megalite.data.tokenizer_training import train_sentencepiece
    from tools.generate_hf import generate

    corpus = tmp_path / "c.jsonl"
    lines = [f"def f{i}(x):\n    return x + {i}\n" for i in range(200)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    model_file = train_sentencepiece([str(corpus)], str(tmp_path / "tok"), vocab_size=300)
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(model_file, hf / "tokenizer.model")
    (hf / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "add_eos_token": False,
                "legacy": True,
            }
        )
    )
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)

    (text,) = generate(str(hf), ["def f"], max_new_tokens=8, greedy=True)

    sp = spm.SentencePieceProcessor(model_file=model_file)
    ids = sp.encode("def f")  # no BOS: megalite's data has none
    model = transformers.LlamaForCausalLM.from_pretrained(hf).eval()
    new: list[int] = []
    with torch.no_grad():
        for _ in range(8):
            nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if nxt == 2:  # eos ends generation
                break
            new.append(nxt)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf, local_files_only=True)
    assert text == tokenizer.decode(new, skip_special_tokens=True)
    assert len(new) > 0
