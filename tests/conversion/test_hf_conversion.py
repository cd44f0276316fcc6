"""megalite <-> HuggingFace conversion (transformers models built from configs, offline).

1. Both families trained at TP2 x PP2 (4 ranks, vocabulary 101 padded to 256 over TP 2) convert
   with ``tools/convert_checkpoint_to_hf.py --verify``; transformers' logits equal
   ``load_model``'s within 1e-4 (fp32; measured ~1e-7: the two differ in op order only, and a wrong
   layout moves logits of size ~0.5 by far more). ``load_model`` itself is checked against an
   independent oracle: the same flags trained in one process give the same weights and logits
   (1e-5 absolute: the layouts differ in the order of sums only, ~1e-6 after 2 Adam steps, while a
   misplaced block moves weights by >= 1e-3). Llama's weights are written in 3 safetensors shards.
2. HF -> megalite (TP2 x PP2) -> HF gives identical tensors and config; the imported checkpoint
   computes the HF model's logits, and ``pretrain --load`` starts from it: the loss of its first
   iteration equals the HF model's loss on the same micro-batches (1e-5 relative).
3. A run with a SentencePiece tokenizer converts with ``tokenizer.model`` and
   ``tokenizer_config.json``, which ``AutoTokenizer`` loads offline and which encode exactly as
   megalite's tokenizer.
4. Models neither family can express are refused, naming the setting.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.distributed as dist

from megalite import load_model
from megalite.conversion import (
    ConversionError,
    export_to_hf,
    family_of,
    hf_logit_difference,
    import_from_hf,
    megalite_flags,
)
from megalite.conversion.hf_files import load_hf_weights
from megalite.data.builders import build_data_loaders
from megalite.models import GPTConfig
from megalite.training.pretrain import pretrain
from tests.harness import run_distributed
from tests.training.common import FAMILIES, config
from tools.convert_checkpoint_to_hf import main as to_hf_main

transformers = pytest.importorskip("transformers")

VOCAB = ["--vocab-size", "100", "--train-iters", "2"]
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _train_case(root: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for family, flags in FAMILIES.items():
        cfg = config(
            *flags,
            *VOCAB,
            *TP2PP2,
            "--save",
            os.path.join(root, family),
            world_size=world,
            rank=rank,
        )
        pretrain(cfg, env={"RANK": str(rank), "WORLD_SIZE": str(world)})


def test_trained_at_tp2_pp2_converts_and_matches_transformers(tmp_path):
    root = str(tmp_path)
    run_distributed(_train_case, 4, root, timeout=600)
    for family, flags in FAMILIES.items():
        oracle = os.path.join(root, family + "_oracle")
        pretrain(config(*flags, *VOCAB, "--save", oracle), env={})
        model, reference = load_model(os.path.join(root, family)), load_model(oracle)
        assert model.config.vocab_size == 101 and model.checkpoint_info["layout"]["tp_size"] == 2
        for name, want in reference.state_dict().items():  # a misplaced block moves >= 1e-3
            assert (model.state_dict()[name] - want).abs().max() < 1e-5, (family, name)
        tokens = torch.arange(32).view(2, 16) * 3 % 101
        with torch.no_grad():
            logits, want = model(tokens), reference(tokens)
        assert want.abs().max() > 0.05  # not trivially ~0
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)

        hf_dir = os.path.join(root, family + "_hf")
        shards = ["--max-shard-size", "40KB"] if family == "llama" else []
        assert (
            to_hf_main(
                ["--load", os.path.join(root, family), "--save", hf_dir, "--verify", *shards]
            )
            == 0
        )
        files = sorted(os.listdir(hf_dir))
        assert {"config.json", "generation_config.json"} <= set(files), files
        if family == "llama":
            assert "model.safetensors.index.json" in files
            assert sum(f.endswith(".safetensors") for f in files) == 3, files
        hf_config = json.load(open(os.path.join(hf_dir, "config.json")))
        arch = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[family]
        assert hf_config["architectures"] == [arch] and hf_config["vocab_size"] == 101
        assert hf_logit_difference(hf_dir, model) < 1e-4


def _random_hf(family: str, path: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=101,
            n_positions=32,
            n_embd=32,
            n_layer=4,
            n_head=4,
            activation_function="gelu_new",
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=101,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=64,
            rope_theta=500000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(cfg)
    model.eval().save_pretrained(path)
    return model


def _hf_first_iteration_loss(hf: torch.nn.Module, cfg) -> float:
    """The mean over the first global batch's micro-batches of the HF model's masked mean loss."""
    t = cfg.training
    loader, _, _ = build_data_loaders(
        cfg.data,
        seq_length=cfg.model.seq_length,
        seed=cfg.model.seed,
        tokenizer=cfg.tokenizer,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        dp_rank=0,
        dp_size=1,
        train_samples=t.global_batch_size,
        valid_samples=0,
        test_samples=0,
    )
    losses = []
    with torch.no_grad():
        for _ in range(t.global_batch_size // t.micro_batch_size):
            batch = next(loader)
            logits = hf(input_ids=batch["tokens"]).logits
            ce = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch["labels"].flatten(), reduction="none"
            )
            mask = batch["loss_mask"].flatten()
            losses.append(((ce * mask).sum() / mask.sum()).item())
    return sum(losses) / len(losses)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_to_megalite_to_hf_is_identical_and_trains_on(family, tmp_path):
    hf = _random_hf(family, str(tmp_path / "hf"))
    model_config, iter_dir = import_from_hf(
        str(tmp_path / "hf"), str(tmp_path / "ml"), tp_size=2, pp_size=2
    )
    assert sorted(os.listdir(iter_dir)) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
        "mp_rank_01_000",
        "mp_rank_01_001",
    ]
    export_to_hf(str(tmp_path / "ml"), str(tmp_path / "back"))
    before, after = load_hf_weights(str(tmp_path / "hf")), load_hf_weights(str(tmp_path / "back"))
    before = {
        k: v for k, v in before.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))
    }
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    a = transformers.AutoConfig.from_pretrained(str(tmp_path / "hf"))
    b = transformers.AutoConfig.from_pretrained(str(tmp_path / "back"))
    assert all(getattr(a, k) == getattr(b, k) for k in keys)
    assert hf_logit_difference(str(tmp_path / "hf"), load_model(str(tmp_path / "ml"))) < 1e-4

    flags = [
        *megalite_flags(model_config),
        *"--vocab-size 100 --seq-length 16 --train-iters 1 --load".split(),
        str(tmp_path / "ml"),
        *"--hidden-dropout 0 --attention-dropout 0".split(),
    ]
    cfg = config(*flags)
    result = pretrain(cfg, env={})
    assert result.iteration == 1  # started from 0: a release checkpoint is weights only
    want = _hf_first_iteration_loss(hf, cfg)
    assert abs(result.losses[0] - want) <= 1e-5 * want, (result.losses[0], want)


def test_sentencepiece_tokenizer_is_written_for_transformers(tmp_path):
    from megalite.data.sentencepiece_tokenizer import SentencePieceTokenizer
    from megalite.data.tokenizer_training import train_sentencepiece

    rng = random.Random(0)
    words = "the cat sat on a red mat while big dogs ran fast near the old stone river".split()
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(12))}) + "\n")
    spm = train_sentencepiece([str(corpus)], str(tmp_path / "tok"), vocab_size=300)
    save = str(tmp_path / "ckpt")
    flags = [
        *FAMILIES["llama"],
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        spm,
        "--train-iters",
        "1",
        "--save",
        save,
    ]
    pretrain(config(*flags), env={})
    hf_dir = str(tmp_path / "hf")
    out = export_to_hf(save, hf_dir)
    assert out["tokenizer_files"] == ["tokenizer.model", "tokenizer_config.json"]
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    ours = SentencePieceTokenizer(spm)
    text = "the big cat ran near the river"
    assert tok(text)["input_ids"] == ours.tokenize(text)
    assert tok.decode(ours.tokenize(text)) == text
    assert tok.eos_token_id == ours.eod
    generation = json.load(open(os.path.join(hf_dir, "generation_config.json")))
    assert generation["eos_token_id"] == ours.eod


def test_models_neither_family_expresses_are_refused():
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8)
    assert family_of(GPTConfig(**base)) == "gpt2"
    with pytest.raises(ConversionError, match="GPT2LMHeadModel needs no --swiglu"):
        family_of(GPTConfig(**base, swiglu=True))
    with pytest.raises(ConversionError, match="LlamaForCausalLM needs --normalization RMSNorm"):
        family_of(GPTConfig(**base, position_embedding_type="rope", swiglu=True))
    with pytest.raises(ConversionError, match="tied embeddings"):
        family_of(GPTConfig(**base, untie_embeddings_and_output_weights=True))
