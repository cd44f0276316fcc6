"""Conversion between megalite checkpoints and HuggingFace models (GPT-2 and Llama families).

    hf_dir = export_to_hf("checkpoints/run1", "hf/run1")          # -> GPT2LMHeadModel / Llama...
    import_from_hf("hf/gpt2", "checkpoints/from_hf", tp_size=2)   # -> a megalite checkpoint

Both go through the logical form (full tensors keyed by global megalite name, unpadded vocabulary),
``megalite.load_model`` on the way out and ``megalite_files.write_checkpoint`` on the way in. The
family follows from the model's flags: learned positions + LayerNorm + GELU + biases + tied
embeddings is GPT-2; RoPE + RMSNorm + SwiGLU without biases is Llama; anything else is refused.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

from megalite.checkpoint.files import RELEASE, read_tracker
from megalite.conversion import gpt2, llama, mixtral, qwen2_moe  # mixtral, qwen2_moe: issue 16
from megalite.conversion.errors import ConversionError
from megalite.conversion.hf_files import (
    load_hf_config,
    load_hf_weights,
    save_generation_config,
    save_safetensors,
    save_tokenizer_files,
)
from megalite.conversion.megalite_files import write_checkpoint
from megalite.errors import UserError, check_writable_dir, path_problem
from megalite.models.config import GPTConfig

logger = logging.getLogger(__name__)

FAMILIES = {"gpt2": gpt2, "llama": llama, "mixtral": mixtral}
HF_MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "mixtral": "mixtral"}  # model_type -> family
FAMILIES.update(qwen2=qwen2_moe.Dense, qwen2_moe=qwen2_moe)  # issue 16
HF_MODEL_TYPES.update(qwen2="qwen2", qwen2_moe="qwen2_moe")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

__all__ = [
    "ConversionError",
    "export_to_hf",
    "family_of",
    "hf_logit_difference",
    "import_from_hf",
    "megalite_flags",
]


def family_of(config: GPTConfig) -> str:
    """ "gpt2" or "llama"; ConversionError naming what disagrees with both otherwise."""
    if config.num_experts is not None:  # issue 16: Mixtral unless only Qwen2-MoE fits
        try:
            mixtral.check(config)
            return "mixtral"
        except ConversionError:
            if config.moe_shared_expert_intermediate_size is None:
                raise
        qwen2_moe.check(config)
        return "qwen2_moe"
    if config.add_qkv_bias:  # issue 16
        qwen2_moe.check_dense(config)
        return "qwen2"
    if config.position_embedding_type == "rope":
        llama.check(config)
        return "llama"
    gpt2.check(config)
    return "gpt2"


def export_to_hf(
    load_dir: str,
    hf_dir: str,
    *,
    iteration: int | str | None = None,
    dtype: str = "auto",
    max_shard_size: int = 5 * 10**9,
) -> dict:
    """Write the model of a megalite checkpoint (any layout) as a HuggingFace folder: weights,
    ``config.json``, ``generation_config.json`` and the run's tokenizer when it is known. Returns
    ``{"family", "files", "tokenizer_files", "model"}`` (``model``: the ``load_model`` result)."""
    from megalite.inference import load_model

    check_writable_dir(hf_dir, flag="--save", what="HuggingFace model")
    model = load_model(load_dir, iteration)
    config = model.config
    family = family_of(config)
    record = model.checkpoint_info["config"]
    tokenizer = record.get("tokenizer", {})
    eos = tokenizer.get("eod")
    bos = tokenizer.get("bos", eos)
    if dtype == "auto":
        target = getattr(torch, str(record["model"]["params_dtype"]).removeprefix("torch."))
    elif dtype in DTYPES:
        target = DTYPES[dtype]
    else:
        raise ConversionError(f"--dtype {dtype!r}: use auto, fp32, bf16 or fp16")
    module = FAMILIES[family]
    state = {k: v.detach() for k, v in model.state_dict().items()}
    hf_state = {k: v.to(target) for k, v in module.to_hf(state, config).items()}
    try:  # the weights first, config.json after: a failed write leaves no loadable folder
        files = save_safetensors(hf_state, hf_dir, max_shard_bytes=max_shard_size)
        hf_config = module.hf_config(config, bos_token_id=bos, eos_token_id=eos)
        setattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", target)
        hf_config.save_pretrained(hf_dir)
        save_generation_config(hf_dir, bos_token_id=bos, eos_token_id=eos)
        tokenizer_files = save_tokenizer_files(
            record.get("data", {}), hf_dir, max_length=config.seq_length, eos_token_id=eos
        )
    except OSError as e:
        for name in ("config.json", "generation_config.json"):
            if os.path.exists(os.path.join(hf_dir, name)):
                os.remove(os.path.join(hf_dir, name))
        raise ConversionError(
            f"--save {hf_dir}: cannot write the HuggingFace model ({path_problem(e)}); free space "
            "or choose another folder"
        ) from None
    return {"family": family, "files": files, "tokenizer_files": tokenizer_files, "model": model}


def import_from_hf(
    hf_dir: str,
    save_dir: str,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
) -> tuple[GPTConfig, str]:
    """A local HF GPT-2 or Llama folder -> a megalite ``release`` checkpoint under TP x PP.
    Returns (the model's GPTConfig, the iteration directory)."""
    check_writable_dir(save_dir, flag="--save", what="megalite checkpoint")
    hf_config = load_hf_config(hf_dir)
    family = HF_MODEL_TYPES.get(hf_config.model_type)
    if family is None:
        raise ConversionError(
            f"{hf_dir}: model_type {hf_config.model_type!r} is not supported; megalite converts "
            + ", ".join(HF_MODEL_TYPES)
        )
    module = FAMILIES[family]
    config = module.config_from_hf(hf_config)
    config.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    state = module.from_hf(load_hf_weights(hf_dir), config)
    has_tokenizer = any(
        os.path.isfile(os.path.join(hf_dir, n)) for n in ("tokenizer.json", "tokenizer.model")
    )
    data = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": os.path.abspath(hf_dir)}
    extra = {
        "converted_from": os.path.abspath(hf_dir),
        "data": data if has_tokenizer else {},
        "tokenizer": {"eod": hf_config.eos_token_id, "bos": hf_config.bos_token_id},
    }
    try:
        iter_dir = write_checkpoint(
            state, config, save_dir, tp_size=tp_size, pp_size=pp_size, extra_record=extra
        )
    except (UserError, OSError) as e:  # a full disk: no half-written release stays behind
        if read_tracker(save_dir) != RELEASE:
            shutil.rmtree(os.path.join(save_dir, RELEASE), ignore_errors=True)
        if isinstance(e, UserError):
            raise
        raise ConversionError(
            f"--save {save_dir}: cannot write the checkpoint ({path_problem(e)}); nothing was "
            "kept; free space or choose another folder"
        ) from None
    return config, iter_dir


def megalite_flags(config: GPTConfig) -> list[str]:
    """The ``pretrain_gpt.py`` model flags that build ``config``'s model."""
    c = config
    flags = [
        "--num-layers", str(c.num_layers), "--hidden-size", str(c.hidden_size),
        "--num-attention-heads", str(c.num_attention_heads),
        "--ffn-hidden-size", str(c.ffn_hidden_size),
        "--max-position-embeddings", str(c.max_position_embeddings),
        "--norm-epsilon", repr(c.norm_epsilon),
    ]  # fmt: skip
    if c.num_query_groups != c.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(c.num_query_groups)]
    if c.kv_channels * c.num_attention_heads != c.hidden_size:
        flags += ["--kv-channels", str(c.kv_channels)]
    if c.position_embedding_type == "rope":
        flags += ["--position-embedding-type", "rope", "--rotary-base", str(c.rotary_base)]
    if c.normalization != "LayerNorm":
        flags += ["--normalization", c.normalization]
    if c.swiglu:
        flags.append("--swiglu")
    if c.openai_gelu:
        flags.append("--openai-gelu")
    if not c.add_bias_linear:
        flags.append("--disable-bias-linear")
    if c.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    for flag, on in (("--apply-layernorm-1p", c.apply_layernorm_1p),  # issue 18
                     ("--qk-layernorm", c.qk_layernorm), ("--squared-relu", c.squared_relu),
                     ("--rotary-interleaved", c.rotary_interleaved)):  # fmt: skip
        if on:
            flags.append(flag)
    if c.use_rope_scaling:  # issue 18
        flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(c.rope_scaling_factor)]
    if c.rotary_percent != 1.0:  # issue 18
        flags += ["--rotary-percent", repr(c.rotary_percent)]
    if c.num_experts is not None:  # issue 16
        flags += [
            "--num-experts", str(c.num_experts), "--moe-router-topk", str(c.moe_router_topk),
            "--moe-ffn-hidden-size", str(c.moe_ffn_hidden_size or c.ffn_hidden_size),
        ]  # fmt: skip
        if c.moe_router_pre_softmax:
            flags.append("--moe-router-pre-softmax")
        if c.moe_layer_freq != 1:
            flags += ["--moe-layer-freq", str(c.moe_layer_freq).replace(" ", "")]
        if c.moe_shared_expert_intermediate_size is not None:
            flags += ["--moe-shared-expert-intermediate-size",
                      str(c.moe_shared_expert_intermediate_size)]  # fmt: skip
        if c.moe_shared_expert_gate:
            flags.append("--moe-shared-expert-gate")
    if c.add_qkv_bias:  # issue 16
        flags.append("--add-qkv-bias")
    return flags


def hf_logit_difference(
    hf_dir: str, model: torch.nn.Module, *, batch_size: int = 2, seq_length: int = 32, seed: int = 0
) -> float:
    """The largest |logit difference| between the HF model in ``hf_dir`` (loaded in fp32 with
    transformers) and ``model`` (``load_model``'s) on one fixed random batch of token ids."""
    import transformers

    seq_length = min(seq_length, model.config.max_position_embeddings)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, local_files_only=True, dtype=torch.float32
        )
    except TypeError:  # transformers < 4.56 names it torch_dtype
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, local_files_only=True, torch_dtype=torch.float32
        )
    hf.eval()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_length), generator=g)
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(input_ids=tokens).logits
    if ours.shape != theirs.shape:
        raise ConversionError(
            f"logits of shape {tuple(theirs.shape)}, expected {tuple(ours.shape)}"
        )
    return float((ours - theirs).abs().max())
