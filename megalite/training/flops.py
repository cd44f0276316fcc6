"""Model FLOPs per iteration, achieved TFLOP/s and MFU.

Model FLOPs count the matrix multiplications of one forward and backward pass of the model as
defined (recomputation is not counted: that is hardware FLOPs), a multiply-add being 2 FLOPs and the
backward twice the forward. Per token and per layer, forward, with ``h`` the hidden size, ``q`` =
heads x kv_channels, ``kv`` = query_groups x kv_channels, ``f`` the FFN size, ``s`` the sequence:

    QKV projection          2 h (q + 2 kv)
    attention scores QK^T   2 s q a        (a = 1: full s x s, the causal mask is not discounted)
    attention x V           2 s q a
    output projection       2 q h
    MLP                     4 h f          (GELU: two matrices)   or  6 h f  (SwiGLU: three)

plus the output layer ``2 h V`` per token (``V`` the padded vocabulary). Training FLOPs per
iteration = 3 x forward x (global batch x s) tokens. Norms, softmax, activations and the
embedding lookup are not matrix multiplications and are left out, as in the Megatron-LM and
PaLM papers. ``a`` (``attention_fraction``) is the share of the ``s x s`` score entries computed,
averaged over the layers: 1 for plain attention; under windows and sparse layouts the entries of
the blocks the block-sparse attention computes (``models.attention_mask.attention_fraction``), so
MFU counts only computed blocks.
"""

from __future__ import annotations

# Dense peak TFLOP/s per device (no sparsity), by data type: bf16/fp16 tensor cores, and tf32 for
# fp32 training. Sources: the vendors' data sheets.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5},  # SXM / HBM3
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 1100.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7},
    "MI300X": {"bf16": 1307.0, "fp16": 1307.0, "fp32": 653.7},
}


def model_flops_per_iteration(
    *,
    num_layers: int,
    hidden_size: int,
    seq_length: int,
    global_batch_size: int,
    padded_vocab_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    kv_channels: int | None = None,
    num_query_groups: int | None = None,
    swiglu: bool = False,
    attention_fraction: float = 1.0,
) -> int:
    """Training FLOPs (forward + backward) of one iteration; see the module docstring."""
    kv_channels = kv_channels or hidden_size // num_attention_heads
    num_query_groups = num_query_groups or num_attention_heads
    h, s, f = hidden_size, seq_length, ffn_hidden_size
    q = num_attention_heads * kv_channels
    kv = num_query_groups * kv_channels
    scores = 2 * s * q * attention_fraction  # QK^T; the same again for x V
    attention = 2 * h * (q + 2 * kv) + 2 * scores + 2 * q * h
    mlp = (6 if swiglu else 4) * h * f
    forward_per_token = num_layers * (attention + mlp) + 2 * h * padded_vocab_size
    return round(3 * forward_per_token * global_batch_size * s)


def peak_tflops(
    device_name: str | None, dtype: str, *, override: float | None = None
) -> float | None:
    """Peak dense TFLOP/s of one device: ``override`` (``--peak-tflops``) if given, else the table
    entry whose key occurs in ``device_name`` (longest key first, so "H100 PCIe" beats "H100"), else
    None (unknown device, CPU). ``dtype``: "bf16", "fp16" or "fp32"."""
    if override is not None:
        return override
    if not device_name:
        return None
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            value = PEAK_TFLOPS[key].get(dtype, 0.0)
            return value or None
    return None


def throughput(
    flops_per_iteration: float,
    seconds_per_iteration: float,
    *,
    world_size: int,
    peak: float | None,
) -> tuple[float, float | None]:
    """(achieved TFLOP/s per device, MFU in percent or None without a peak)."""
    per_device = flops_per_iteration / (seconds_per_iteration * world_size) / 1e12
    mfu = 100.0 * per_device / peak if peak else None
    return per_device, mfu
