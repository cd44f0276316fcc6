"""The cluster scripts' flags are flags megalite accepts, at the world sizes they are meant for.

Each ``scripts/pretrain_gpt_*.sh`` (one node of 8 GPUs) and ``scripts/slurm/pretrain_gpt.sbatch``
(2 nodes of 8) is run with ``DRY_RUN=1``, which prints the command instead of running it; the
``pretrain_gpt.py`` arguments are then parsed and validated by ``parse_args`` at that world size
(the tokenizer swapped for a NullTokenizer of the real vocabulary size, since no tokenizer files
exist here). The parameter count, from a plain formula independent of megalite's model code, must
match the size each script is named after. No GPU, no SLURM: this runs everywhere.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from megalite.training.arguments import parse_args
from tests.paths import ROOT

GPT2_VOCAB, LLAMA3_VOCAB = 50257, 128256
CASES = {  # script: (vocabulary, world size, parameters low, high, TP, PP)
    "scripts/pretrain_gpt_gpt2_125m.sh": (GPT2_VOCAB, 8, 0.115e9, 0.135e9, 1, 1),
    "scripts/pretrain_gpt_gpt2_1.3b.sh": (GPT2_VOCAB, 8, 1.25e9, 1.45e9, 1, 1),
    "scripts/pretrain_gpt_llama_1b.sh": (LLAMA3_VOCAB, 8, 1.1e9, 1.4e9, 1, 1),
    "scripts/pretrain_gpt_llama_8b.sh": (LLAMA3_VOCAB, 8, 7.8e9, 8.2e9, 2, 1),
    "scripts/slurm/pretrain_gpt.sbatch": (LLAMA3_VOCAB, 16, 7.8e9, 8.2e9, 2, 1),
}


def _dry_run(script: str, vocab: int, tmp_path: Path) -> list[str]:
    prefix = tmp_path / "corpus_text_document"  # parse_args checks that P.bin and P.idx exist
    for suffix in (".bin", ".idx"):
        prefix.with_suffix(suffix).touch()
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "DATA_PATH": str(prefix),
        "TOKENIZER_MODEL": "tokenizer",
        "NPROC_PER_NODE": "8",
        "CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "SLURM_SUBMIT_DIR": str(ROOT),
    }
    swap = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab - 1)]  # + eod = vocab
    proc = subprocess.run(
        ["bash", str(ROOT / script), *swap], capture_output=True, text=True, env=env, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    return words[words.index("pretrain_gpt.py") + 1 :]


def _parameters(m) -> int:
    """Parameter count of the unsharded model from its shape alone (unpadded vocabulary)."""
    h, v, layers = m.hidden_size, m.vocab_size, m.num_layers
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    d = m.kv_channels or h // heads
    bias = 1 if m.add_bias_linear else 0
    qkv = h * (heads + 2 * groups) * d + bias * (heads + 2 * groups) * d
    proj = heads * d * h + bias * h
    mlp_in = h * m.ffn_hidden_size * (2 if m.swiglu else 1) + bias * m.ffn_hidden_size
    mlp_out = m.ffn_hidden_size * h + bias * h
    norm = 2 * h if m.normalization == "LayerNorm" else h  # weight (+ bias)
    per_layer = qkv + proj + mlp_in + mlp_out + 2 * norm
    embeddings = v * h + (
        m.seq_length * h if m.position_embedding_type == "learned_absolute" else 0
    )
    output = v * h if m.untie_embeddings_and_output_weights else 0
    return embeddings + layers * per_layer + norm + output


@pytest.mark.parametrize("script", list(CASES))
def test_script_flags_parse_at_their_world_size(script, tmp_path):
    vocab, world, low, high, tp, pp = CASES[script]
    argv = _dry_run(script, vocab, tmp_path)
    assert "--exit-signal-handler" in argv and "--save" in argv
    cfg = parse_args(argv, env={"RANK": "0", "WORLD_SIZE": str(world)})
    assert cfg.parallel.tensor_model_parallel_size == tp
    assert cfg.parallel.pipeline_model_parallel_size == pp
    assert cfg.parallel.use_distributed_optimizer and cfg.model.params_dtype == torch.bfloat16
    assert cfg.model.vocab_size == vocab
    n = _parameters(cfg.model)
    assert low <= n <= high, f"{script}: {n / 1e9:.3f}B parameters, outside its name's size"


def test_missing_data_path_is_a_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATA_PATH", "TOKENIZER_MODEL")}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/pretrain_gpt_gpt2_125m.sh")],
        capture_output=True,
        text=True,
        env={**env, "DRY_RUN": "1"},
        timeout=30,
    )
    assert proc.returncode != 0 and "set DATA_PATH" in proc.stderr
