"""Megatron's tokenizer types: GPT2BPETokenizer against hand-computed ids and against HuggingFace's
byte-level BPE on the same files, GPTSentencePieceTokenizer / Llama2Tokenizer against SentencePiece,
TikTokenizer against hand-computed ids and against tiktoken (when installed); all through the
flags of pretrain_gpt.py. Every vocabulary is built in the test (no download)."""

from __future__ import annotations

import base64
import pickle

import pytest

from megalite.data.gpt2_bpe import GPT2BPETokenizer
from megalite.data.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megalite.data.tiktoken_tokenizer import PATTERNS, TikTokenizer
from megalite.data.tokenizers import make_tokenizer
from megalite.training.arguments import parse_args, with_tokenizer
from megalite.training.config import ConfigError
from tests.data.bpe_files import (
    tiktoken_ranks,
    train_merges,
    write_gpt2_files,
    write_tiktoken_json,
)

# unicode (accents, CJK, emoji, an em dash), whitespace runs, tabs, newlines, CRLF, contractions,
# digits, and the special token twice (once glued to text)
TEXT = (
    "Hello  world!\n\n  Don't  STOP—it'll be 2024…\tcafé 日本語😀<|endoftext|> next doc   \n"
    "  x<|endoftext|>y\r\n\r\nABCdef ÉCOLE naïve 12345 'twas  \n"
)
CORPUS = [
    "Hello world! Don't stop: it's 2024.\n\tTabs   and   spaces.",
    "naïve café 日本語 😀 emoji ÉCOLE école",
    "def f(x):\n    return x ** 2  # comment\n\nHELLO World HelloWorld /path/to\r\n",
] * 10
HAND_MERGES = [(b"l", b"l"), (b"h", b"e"), (b"he", b"ll"), (b" ", b"w"), (b"o", b"r")]


def test_gpt2_bpe_hand_computed(tmp_path):
    # vocab: byte b is id b; then ll 256, he 257, hell 258, " w" 259, or 260; <|endoftext|> 261.
    # "hello": h e l l o -> (l,l) rank 0 -> h e ll o -> (h,e) 1 -> he ll o -> (he,ll) 2 -> hell o
    # " world": Ġ w o r l d -> (Ġ,w) 3 -> Ġw o r l d -> (o,r) 4 -> Ġw or l d
    vocab, merges = write_gpt2_files(tmp_path, HAND_MERGES)
    tok = GPT2BPETokenizer(vocab, merges)
    assert (tok.vocab_size, tok.eod) == (262, 261)
    assert tok.tokenize("hello world") == [258, ord("o"), 259, 260, ord("l"), ord("d")]
    assert tok.tokenize("hello<|endoftext|>") == [258, ord("o"), 261]
    assert tok.tokenize(" \n") == [ord(" "), ord("\n")]  # the run " \n": one piece, bytes
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT
    assert tok.detokenize([0xE6]) == "\ufffd"  # a lone UTF-8 lead byte: replacement character


def test_gpt2_bpe_matches_huggingface_byte_level_bpe(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.ByteLevelBPETokenizer()
    hf.train_from_iterator(
        CORPUS,
        vocab_size=420,
        min_frequency=1,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    hf.save_model(str(tmp_path))
    vocab, merges = str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    tok = GPT2BPETokenizer(vocab, merges)
    ref = tokenizers.ByteLevelBPETokenizer(vocab, merges)
    ref.add_special_tokens(["<|endoftext|>"])
    ids = tok.tokenize(TEXT)
    assert len(ids) > 40 and tok.eod in ids and ids.count(tok.eod) == 2
    assert ids == ref.encode(TEXT).ids
    transformers = pytest.importorskip("transformers")
    slow = transformers.GPT2Tokenizer(vocab, merges)
    assert ids == slow(TEXT)["input_ids"]
    assert tok.vocab_size == len(slow.get_vocab()) and tok.eod == slow.eos_token_id
    assert tok.detokenize(ids) == TEXT == slow.decode(ids)
    # the same on files written by the test's own trainer (merges of a different corpus order)
    vocab2, merges2 = write_gpt2_files(tmp_path / "own", train_merges(CORPUS[::-1], 150))
    assert (
        GPT2BPETokenizer(vocab2, merges2).tokenize(TEXT)
        == transformers.GPT2Tokenizer(vocab2, merges2)(TEXT)["input_ids"]
    )


def test_gpt2_bpe_bad_files_and_pickle(tmp_path):
    vocab, merges = write_gpt2_files(tmp_path, HAND_MERGES)
    with pytest.raises(ValueError, match="--merge-file .*nope: no such file"):
        GPT2BPETokenizer(vocab, str(tmp_path / "nope"))
    bad = tmp_path / "bad.txt"
    bad.write_text("#version: 0.2\nl l\nh e x\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.txt:3: expected 'left right'"):
        GPT2BPETokenizer(vocab, str(bad))
    with pytest.raises(ValueError, match="needs --vocab-file .* and --merge-file"):
        make_tokenizer("GPT2BPETokenizer", vocab_file=vocab)
    tok = make_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    again = pickle.loads(pickle.dumps(tok))
    assert again.tokenize(TEXT) == tok.tokenize(TEXT)


def test_sentencepiece_gpt_and_llama2(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    text = "alpha beta ünï 日本 gamma"  # (this model maps a newline to a space)
    gpt = make_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    llama = make_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    assert isinstance(gpt, GPTSentencePieceTokenizer) and isinstance(llama, Llama2Tokenizer)
    # Megatron: GPTSentencePiece = the model's ids as they are; Llama2 = bos first, no eos;
    # both: vocab_size = the model's piece count, eod = eos
    assert gpt.tokenize(text) == sp.encode(text) == SentencePieceTokenizer(sp_model).tokenize(text)
    assert llama.tokenize(text) == [sp.bos_id(), *sp.encode(text)]
    assert llama.tokenize_batch([text, "beta"]) == [llama.tokenize(text), llama.tokenize("beta")]
    for tok in (gpt, llama):
        assert (tok.vocab_size, tok.eod) == (sp.get_piece_size(), sp.eos_id())
        assert tok.detokenize(tok.tokenize(text)) == text
    assert pickle.loads(pickle.dumps(llama)).tokenize(text) == llama.tokenize(text)


def test_tiktokenizer_hand_computed(tmp_path):
    # ranks: the 256 bytes, then ll 256, he 257, hell 258, " w" 259, or 260; 4 special ids first,
    # so rank r is id r + 4 and --vocab-size is 261 + 4. "hello" (not a vocabulary entry): the
    # lowest-ranked adjacent pair first: ll (256) -> he (257) -> hell (258), then "o":
    # ids 262, 115. " world" (one v1 piece): " w" (259), then or (260): 263, 264, then l, d.
    path = write_tiktoken_json(tmp_path / "tik.json", tiktoken_ranks(HAND_MERGES))
    tok = TikTokenizer(path, pattern="v1", vocab_size=265, num_special_tokens=4)
    assert (tok.vocab_size, tok.eod, tok.bos, tok.unk) == (265, 2, 1, 0)
    assert tok.tokenize("hello world") == [262, 115, 263, 264, ord("l") + 4, ord("d") + 4]
    assert tok.tokenize("hell") == [262]  # a whole vocabulary entry is one id
    assert tok.tokenize("</s>") == [b + 4 for b in b"</s>"]  # ordinary text, as encode_ordinary
    assert tok.detokenize([1, 262, 2, 3, 7]) == "<s>hell</s><SPECIAL_3>\x03"
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT
    # --vocab-size smaller than the file: the first V - S ranks are kept (Megatron's max_vocab)
    small = TikTokenizer(path, pattern="v1", vocab_size=263, num_special_tokens=4)
    # V - S = 259 ranks: " w" (259) and or (260) are cut off, hell (258) stays
    assert small.tokenize("hello world") == [262, 115, *(b + 4 for b in b" world")]
    # tiktoken's own text format ("base64 rank" lines) reads the same
    text_file = tmp_path / "tik.tiktoken"
    text_file.write_text(
        "".join(
            f"{base64.b64encode(t).decode()} {r}\n" for t, r in tiktoken_ranks(HAND_MERGES).items()
        )
    )
    same = TikTokenizer(str(text_file), pattern="v1", vocab_size=265, num_special_tokens=4)
    assert same.tokenize(TEXT) == tok.tokenize(TEXT)
    assert pickle.loads(pickle.dumps(tok)).tokenize(TEXT) == tok.tokenize(TEXT)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"pattern": "v3"}, r"needs --tiktoken-pattern v1 or v2, got 'v3'"),
        (
            {},
            r"has 261 tokens, fewer than --vocab-size 131072 - .* 1000 = 130072; pass "
            r"--vocab-size 1261",
        ),
        ({"vocab_size": 300, "num_special_tokens": 2}, r"need 3 <= --tiktoken-num-special-tokens"),
        ({"vocab_size": 1200}, r"--vocab-size 1200 - .*1000 = 200 leaves no room for the 256"),
    ],
)
def test_tiktokenizer_refuses_bad_settings(tmp_path, kwargs, message):
    path = write_tiktoken_json(tmp_path / "tik.json", tiktoken_ranks(HAND_MERGES))
    with pytest.raises(ValueError, match=message):
        TikTokenizer(path, **{"pattern": "v1", **kwargs})


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_matches_tiktoken(tmp_path, pattern):
    tiktoken = pytest.importorskip("tiktoken")
    ranks = tiktoken_ranks(train_merges(CORPUS, 200, PATTERNS[pattern]))
    path = write_tiktoken_json(tmp_path / "tik.json", ranks)
    s = 10
    tok = TikTokenizer(path, pattern=pattern, vocab_size=len(ranks) + s, num_special_tokens=s)
    ref = tiktoken.Encoding(
        name="test",
        pat_str=PATTERNS[pattern],
        mergeable_ranks={t: r + s for t, r in ranks.items()},
        special_tokens={t: i for i, t in enumerate(tok.special_tokens)},
    )
    ids = tok.tokenize(TEXT)
    assert ids == ref.encode_ordinary(TEXT) and len(ids) > 40
    assert tok.detokenize(ids) == ref.decode(ids) == TEXT


def test_pretrain_flags_build_each_tokenizer(tmp_path, sp_model):
    vocab, merges = write_gpt2_files(tmp_path, HAND_MERGES)
    tik = write_tiktoken_json(tmp_path / "tik.json", tiktoken_ranks(HAND_MERGES))
    base = (
        "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
        "--micro-batch-size 1 --lr 1e-3 --train-iters 1 --mock-data"
    ).split()
    cases = {
        "GPT2BPETokenizer": (["--vocab-file", vocab, "--merge-file", merges], 262, 261),
        "GPTSentencePieceTokenizer": (["--tokenizer-model", sp_model], 320, 2),
        "Llama2Tokenizer": (["--tokenizer-model", sp_model], 320, 2),
        "TikTokenizer": (
            [
                "--tokenizer-model",
                tik,
                *"--tiktoken-pattern v2 --tiktoken-num-special-tokens 4 --vocab-size 265".split(),
            ],
            265,
            2,
        ),
    }
    for kind, (flags, vocab_size, eod) in cases.items():
        cfg = with_tokenizer(parse_args([*base, "--tokenizer-type", kind, *flags], env={}))
        assert type(cfg.tokenizer).__name__ == kind
        assert (cfg.tokenizer.vocab_size, cfg.tokenizer.eod) == (vocab_size, eod), kind
        assert cfg.model.vocab_size == vocab_size
    with pytest.raises(ConfigError, match="GPT2BPETokenizer needs --merge-file"):
        with_tokenizer(
            parse_args(
                [*base, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab], env={}
            )
        )
    with pytest.raises(ConfigError, match="needs --tiktoken-pattern v1 or v2, got None"):
        with_tokenizer(
            parse_args(
                [*base, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", tik], env={}
            )
        )
