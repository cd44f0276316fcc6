"""Megatron-LM's ``distrib_optim.pt``: the distributed optimizer's state in the ``torch`` format.

    SAVE/iter_0000500/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt   model, param groups, step
    SAVE/iter_0000500/mp_rank_{tp:02d}[_{pp:03d}]/distrib_optim.pt     fp32 masters, Adam moments

With ``--use-distributed-optimizer`` Megatron keeps the Adam state of a (TP, PP) rank as flat
ranges of its grad buffer, one range per DP rank; at a ``torch``-format save DP rank 0 gathers
them into one file per (TP, PP) rank (so the file does not depend on the DP size):

    {"buckets_coalesced": True,
     0: {torch.float32: {"param": [N], "exp_avg": [N], "exp_avg_sq": [N], "numel_unpadded": N}}}

``0`` is the grad buffer (one per (param dtype, grad dtype); expert parameters have their own),
the key inside it the buffer's dtype. The flat tensors are the buffer's buckets concatenated
without their end padding. The buffer's layout (``flat_layout``) follows Megatron's DDP:

* the stage's parameters in REVERSE module order (``named_parameters``), each starting at a
  multiple of 64 elements from its bucket's start (zeros in the gaps);
* a bucket closes once it holds ``bucket_size`` elements or more; ``bucket_size`` is ``None``
  (one bucket) without ``--overlap-grad-reduce``, on pipeline stages after the first and with
  ``--overlap-param-gather-with-optimizer-step``; else ``--ddp-bucket-size``, or the stage's
  parameter count / ``--ddp-num-buckets``, or max(4e7, 1e6 x DP x CP);
* with tied embeddings and PP > 1 the shared embedding (``embedding.word_embeddings.weight`` on
  the first stage, ``output_layer.weight`` on the last) gets a bucket of its own.

The layout is recomputed from the parameters of ``model_optim_rng.pt`` and checked against the
file's ``numel_unpadded``: a file whose sizes disagree is refused in one line, never misread.
The format Megatron wrote before February 2024 (uncoalesced buckets) is refused likewise.
"""

from __future__ import annotations

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.megatron.args import arg
from megalite.checkpoint.megatron.legacy import Opaque, load_megatron_file, parameter_names

DISTRIB_OPTIM_FILE = "distrib_optim.pt"
PARAM_ALIGN = 64  # elements: Megatron pads each parameter's start in its bucket to this
DEFAULT_BUCKET = 40_000_000
SHARED_EMBEDDINGS = {0: "embedding.word_embeddings.weight", -1: "output_layer.weight"}
# megalite's optimizer-state key -> the flat tensor of distrib_optim.pt that holds it
FLAT_KEYS = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def bucket_size_from_args(args, *, pp_rank: int, stage_numel: int) -> int | None:
    """The grad-buffer bucket size Megatron used on this pipeline stage (module doc)."""
    if not arg(args, "overlap_grad_reduce", False) or pp_rank > 0:
        return None
    if arg(args, "overlap_param_gather_with_optimizer_step", False):
        return None
    if arg(args, "ddp_num_buckets"):
        return stage_numel // int(args.ddp_num_buckets)
    if arg(args, "ddp_bucket_size"):
        return int(args.ddp_bucket_size)
    dp = int(arg(args, "data_parallel_size", 1)) * int(arg(args, "context_parallel_size", 1))
    return max(DEFAULT_BUCKET, 1_000_000 * dp)


def flat_layout(
    params: list[tuple[str, int]], *, bucket_size: int | None, shared: str | None = None
) -> tuple[dict[str, tuple[int, int]], int]:
    """``params``: (name, numel) in module order. Returns each parameter's [start, end) in the
    coalesced flat tensors of ``distrib_optim.pt`` and their length (``numel_unpadded``)."""
    spans: dict[str, tuple[int, int]] = {}
    done = 0  # the unpadded elements of the closed buckets
    pos, used = 0, False  # position in the open bucket; whether it holds a parameter
    for name, numel in reversed(params):
        pos = _pad(pos, PARAM_ALIGN)
        if name == shared and used:
            done, pos, used = done + pos, 0, False
        spans[name] = (done + pos, done + pos + numel)
        pos, used = pos + numel, True
        if (bucket_size is not None and pos >= bucket_size) or name == shared:
            done, pos, used = done + pos, 0, False
    return spans, done + pos


def shared_embedding_name(args, pp_rank: int, pp_size: int) -> str | None:
    if pp_size == 1 or arg(args, "untie_embeddings_and_output_weights", False):
        return None
    if pp_rank == 0:
        return SHARED_EMBEDDINGS[0]
    return SHARED_EMBEDDINGS[-1] if pp_rank == pp_size - 1 else None


def _step(optimizer: dict | None, iteration: int) -> int:
    """Adam's step: Megatron stores it in each param group of ``model_optim_rng.pt``'s
    ``optimizer`` (the distributed optimizer keeps no per-parameter ``state`` there); the
    iteration where a Megatron version did not."""
    groups = ((optimizer or {}).get("optimizer") or {}).get("param_groups") or []
    steps = [g.get("step") for g in groups if g.get("step") is not None]
    return int(max(steps)) if steps else int(iteration)


def read_distrib_optim(path: str, raw: dict, *, tp_rank: int, pp_rank: int) -> dict:
    """One (TP, PP) rank's ``distrib_optim.pt`` + its ``model_optim_rng.pt`` (``raw``) ->
    megalite's per-parameter form ``{"params": {name: {"master", "exp_avg", "exp_avg_sq"}},
    "step", "scaler"}``."""
    args = raw["args"]
    pp_size = int(arg(args, "pipeline_model_parallel_size", 1))
    state = load_megatron_file(path)
    if not state.get("buckets_coalesced"):
        raise CheckpointError(
            f"{path}: Megatron's distributed optimizer state in the format before February 2024 "
            "(uncoalesced buckets) is not read; resave it once with Megatron's "
            "--ckpt-convert-update-legacy-dist-opt-format, or pass --no-load-optim"
        )
    buffers = [k for k in state if isinstance(k, int)]
    if buffers != [0] or len(state[0]) != 1:
        raise CheckpointError(
            f"{path}: {len(buffers)} grad buffer(s) with dtypes {[list(state[k]) for k in buffers]}"
            " where megalite reads one (a dense model, one parameter dtype); pass --no-load-optim"
        )
    flat = next(iter(state[0].values()))
    model = raw["model"]
    names = parameter_names(model)
    params = [(n, model[n].numel()) for n in names]
    bucket = bucket_size_from_args(
        args, pp_rank=pp_rank, stage_numel=sum(numel for _, numel in params)
    )
    spans, total = flat_layout(
        params, bucket_size=bucket, shared=shared_embedding_name(args, pp_rank, pp_size)
    )
    if total != int(flat["numel_unpadded"]) or flat["param"].numel() != total:
        raise CheckpointError(
            f"{path}: the grad buffer holds {int(flat['numel_unpadded'])} elements where "
            f"Megatron's layout of this stage's {len(names)} parameters (bucket size {bucket}) "
            f"gives {total}; this Megatron version lays it out otherwise: pass --no-load-optim"
        )
    out = {}
    for name in names:
        start, end = spans[name]
        shape = model[name].shape
        out[name] = {
            key: flat[src][start:end].reshape(shape).float().clone()
            for key, src in FLAT_KEYS.items()
        }
    scaler = (raw.get("optimizer") or {}).get("grad_scaler")
    if isinstance(scaler, dict) and "scale" in scaler:
        scaler = {k: v for k, v in scaler.items() if not isinstance(v, Opaque)}
    else:
        scaler = None
    return {
        "params": out,
        "step": _step(raw.get("optimizer"), raw.get("iteration", 0)),
        "scaler": scaler,
    }
