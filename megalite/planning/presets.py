"""Model presets for ``tools/plan.py --model``: pretrain_gpt.py's model flags of published models.

Shapes are the published ones (GPT-2/GPT-3 papers' tables; Meta's Llama 2 and Llama 3 model
cards; Mistral's Mixtral 8x7B config: Llama-shaped, 8 experts, top-2, 32K vocabulary).
"""

from __future__ import annotations

NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def _gpt(layers: int, hidden: int, heads: int, seq: int = 1024) -> dict:
    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden)]
    argv += ["--num-attention-heads", str(heads), "--seq-length", str(seq)]
    argv += ["--max-position-embeddings", str(seq), *NO_DROPOUT]
    return {"argv": argv, "vocab_size": 50257}


def _llama(
    layers: int,
    hidden: int,
    heads: int,
    groups: int,
    ffn: int,
    vocab: int,
    seq: int,
    base: int = 10000,
) -> dict:
    gqa = ["--group-query-attention", "--num-query-groups", str(groups)] if groups != heads else []
    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden)]
    argv += ["--num-attention-heads", str(heads), *gqa, "--ffn-hidden-size", str(ffn)]
    argv += ["--seq-length", str(seq), "--max-position-embeddings", str(seq)]
    argv += ["--position-embedding-type", "rope", "--rotary-base", str(base)]
    argv += ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]
    argv += ["--untie-embeddings-and-output-weights", *NO_DROPOUT]
    return {"argv": argv, "vocab_size": vocab}


MODEL_PRESETS: dict[str, dict] = {
    "gpt2-125m": _gpt(12, 768, 12),
    "gpt2-350m": _gpt(24, 1024, 16),
    "gpt2-760m": _gpt(24, 1536, 16),
    "gpt2-1.5b": _gpt(48, 1600, 25),
    "gpt3-2.7b": _gpt(32, 2560, 32, 2048),
    "gpt3-6.7b": _gpt(32, 4096, 32, 2048),
    "gpt3-13b": _gpt(40, 5140, 40, 2048),
    "gpt3-175b": _gpt(96, 12288, 96, 2048),
    "llama2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": _llama(40, 5120, 40, 40, 13824, 32000, 4096),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192, 500000),
    "llama-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192, 500000),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, 128256, 8192, 500000),
}
MODEL_PRESETS["llama3-70b"] = MODEL_PRESETS["llama-70b"]
MODEL_PRESETS["mixtral-8x7b"] = _llama(32, 4096, 32, 8, 14336, 32000, 4096, 1000000)
MODEL_PRESETS["mixtral-8x7b"]["argv"] += ["--num-experts", "8", "--moe-router-topk", "2"]
MODEL_PRESETS["mixtral-8x7b"]["argv"] += ["--moe-token-dispatcher-type", "alltoall"]
# presets named so that asking for them says why they are refused (none today)
REFUSED_PRESETS: dict[str, str] = {}
