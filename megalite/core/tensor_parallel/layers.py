"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Activations are ``[s, b, h]`` (sequence first). With ``sequence_parallel`` the activations outside
TP regions are ``[s/tp, b, h]``: a column-parallel layer all-gathers them on the way in and a
row-parallel layer reduce-scatters on the way out, instead of the identity / all-reduce pair.

Each parameter carries attributes the rest of megalite reads:
``tensor_model_parallel`` (True if sharded over TP), ``partition_dim`` (the dim it is sharded
along), and ``sequence_parallel`` (True for replicated parameters that see only a sequence shard;
their grads must be all-reduced over TP).

Deferred weight grads (zero-bubble pipeline schedules). Both linear layers run ``linear`` (below),
whose backward computes the input grad and, unless a ``WeightGradStore`` attached to the layer is
deferring, the weight and bias grads, exactly as autograd would. While the store defers, the
weight-grad GEMM ``dW = dY^T X`` (and ``db = sum dY``) waits in the store, holding ``X`` and ``dY``;
``store.flush(key)`` later computes it with the same operations and hands it to autograd's
accumulation (``torch.autograd.backward`` on the parameter), so the grads -- and the data-parallel
hooks -- see bit-identical values. Under sequence parallelism a column-parallel layer saves only its
``[s/tp, b, h]`` input shard for backward and all-gathers it again there (as Megatron does); the
store keeps that re-gathered ``[s, b, h]`` ``X`` from I until W (``s x b x h`` elements per
column-parallel layer per micro-batch between I and W, a tp-fold more than the shard a regather
at W would keep, and one all-gather less). Other parameters (norms, embeddings, a
weight passed in at call time such as the tied output layer) get their grads at I.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from megalite.core.groups import group_rank, group_size
from megalite.core.tensor_parallel.init import InitMethod, default_init
from megalite.core.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_first,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_first,
    reduce_scatter_to_sp_region,
    scatter_to_tp_region,
)


def divide(numerator: int, denominator: int, *, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}"
        )
    return numerator // denominator


def set_tp_attributes(param: torch.Tensor, *, partition_dim: int | None) -> None:
    param.tensor_model_parallel = partition_dim is not None
    param.partition_dim = partition_dim


def _sharded_parameter(
    shape: tuple[int, ...],
    *,
    partition_dim: int,
    tp_group,
    init_method: InitMethod,
    params_dtype: torch.dtype,
    device: torch.device | None,
    init_rows: int | None = None,
    stride: int = 1,
) -> nn.Parameter:
    """Initialise the full ``shape`` on CPU in fp32 (only the first ``init_rows`` rows when given;
    the rest stay zero), keep this rank's chunk along ``partition_dim`` (on the meta device: its
    shape only, nothing drawn; ``core.distributed.deferred_init`` fills it later).

    ``stride`` > 1: the full tensor is ``stride`` blocks stacked along ``partition_dim`` (SwiGLU's
    ``[gate; up]``) and each rank keeps its chunk of every block, so a local ``chunk(stride)`` gives
    this rank's gate and up.
    """
    tp, rank = group_size(tp_group), group_rank(tp_group)
    if device is not None and torch.device(device).type == "meta":  # shapes only: nothing drawn
        shard = torch.empty(
            [n // tp if d == partition_dim else n for d, n in enumerate(shape)], device=device
        )
    else:
        full = torch.zeros(shape, dtype=torch.float32)
        init_method(full if init_rows is None else full[:init_rows])
        blocks = full.chunk(stride, dim=partition_dim)
        shard = torch.cat([b.chunk(tp, dim=partition_dim)[rank] for b in blocks], dim=partition_dim)
    param = nn.Parameter(shard.to(device=device, dtype=params_dtype).contiguous())
    set_tp_attributes(param, partition_dim=partition_dim)
    param.partition_stride = stride
    return param


class WeightGradStore:
    """Queue of deferred weight-grad computations, one list per key (e.g. (micro-batch,
    chunk)). Attach it to the linear layers of a module with ``attach_weight_grad_store``."""

    def __init__(self) -> None:
        self._key: Hashable | None = None
        self._queues: dict[Hashable, list[Callable[[], tuple[list, list]]]] = {}

    @property
    def deferring(self) -> bool:
        return self._key is not None

    @contextlib.contextmanager
    def defer(self, key: Hashable) -> Iterator[None]:
        """Weight grads computed by the backward run inside are queued under ``key``."""
        previous, self._key = self._key, key
        self._queues.setdefault(key, [])
        try:
            yield
        finally:
            self._key = previous

    def put(self, compute: Callable[[], tuple[list, list]]) -> None:
        self._queues[self._key].append(compute)

    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def flush(self, key: Hashable) -> None:
        """Compute the weight grads queued under ``key`` and accumulate them (one engine call)."""
        params, grads = [], []
        for compute in self._queues.pop(key, []):
            p, g = compute()
            params += p
            grads += g
        if params:
            torch.autograd.backward(params, grads)


def attach_weight_grad_store(module: nn.Module, store: WeightGradStore | None) -> None:
    """Every column/row-parallel linear layer under ``module`` defers into ``store`` (None:
    never defers)."""
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.weight_grad_store = store


class _Linear(torch.autograd.Function):
    """``F.linear`` whose weight-grad GEMM may be deferred into a ``WeightGradStore``. With
    ``sp_group`` the input is a sequence shard ``[s/tp, b, h]``, all-gathered here; only the
    shard is saved and backward all-gathers it again for the weight grad (a tp-fold fewer saved
    bytes for one more all-gather, Megatron's trade) and reduce-scatters the input grad."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, sp_group):
        ctx.save_for_backward(x, weight)
        ctx.sp_group = sp_group
        if sp_group is not None:
            x = gather_first(x, sp_group)  # [s/tp, b, h] -> [s, b, h]
        # W accumulates into the parameter object itself, kept here: the ``weight`` that
        # ``saved_tensors`` returns is that parameter only while no saved-tensor hooks are on;
        # under any hooks (identity, save_on_cpu, the planner's meter) autograd returns a
        # stand-in whose grad accumulator it holds weakly, so once I's graph is freed a W fed
        # the stand-in would accumulate into the stand-in's own ``.grad`` and the grad is lost
        ctx.bias, ctx.store, ctx.weight = bias, store, weight if store is not None else None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors  # values only: under hooks not the parameter objects
        bias, store, target, group = ctx.bias, ctx.store, ctx.weight, ctx.sp_group
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if group is not None and want_w:  # the gathered input again, for dW (same order on
            x = gather_first(x, group)  # every TP rank: gather, then reduce-scatter)
        grad_in = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        if group is not None and grad_in is not None:
            grad_in = reduce_scatter_first(grad_in, group)  # partial sums -> [s/tp, b, h]

        def weight_grads() -> tuple[list, list]:
            dy = grad_out.reshape(-1, grad_out.shape[-1])  # [s*b, h_out]
            params, grads = [], []
            if want_w:
                params.append(target)
                grads.append(dy.t().mm(x.reshape(-1, x.shape[-1])))  # [h_out, h_in]
            if want_b:
                params.append(bias)
                grads.append(dy.sum(0))
            return params, grads

        if store is not None and store.deferring and (want_w or want_b):
            store.put(weight_grads)
            return grad_in, None, None, None, None
        _, grads = weight_grads()
        grad_w = grads.pop(0) if want_w else None
        grad_b = grads.pop(0) if want_b else None
        return grad_in, grad_w, grad_b, None, None


def linear(
    x, weight, bias=None, store: WeightGradStore | None = None, *, sp_group=None
) -> torch.Tensor:
    """``x @ weight^T + bias`` whose backward may defer the weight grads into ``store``;
    ``sp_group``: ``x`` is this rank's sequence shard, all-gathered over that group first."""
    return _Linear.apply(x, weight, bias, store, sp_group)


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with A split by output rows: rank r holds ``A[r*o/tp:(r+1)*o/tp, :]``.

    Input ``[s, b, h_in]`` (``[s/tp, b, h_in]`` under sequence parallel); output ``[s, b,
    h_out/tp]``, or ``[s, b, h_out]`` with ``gather_output``. Returns ``(output, bias)``: bias is
    None unless ``skip_bias_add``, in which case it is returned (this rank's slice) for the caller
    to fuse.
    ``stride`` > 1 shards each of ``stride`` stacked output blocks separately (see
    ``_sharded_parameter``); the bias follows the same layout.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod = default_init,
        stride: int = 1,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        if sequence_parallel and gather_output:
            raise ValueError(
                "ColumnParallelLinear: gather_output is not allowed with sequence_parallel"
            )
        tp = group_size(tp_group)
        self.weight_grad_store: WeightGradStore | None = None
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = (
            divide(output_size, tp * stride, what="output size") * stride
        )
        self.tp_group, self.gather_output = tp_group, gather_output
        self.skip_bias_add, self.sequence_parallel = skip_bias_add, sequence_parallel
        self.weight = _sharded_parameter(
            (output_size, input_size),
            partition_dim=0,
            tp_group=tp_group,
            init_method=init_method,
            params_dtype=params_dtype,
            device=device,
            stride=stride,
        )
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device)
            )
            set_tp_attributes(self.bias, partition_dim=0)
            self.bias.partition_stride = stride
        else:
            self.register_parameter("bias", None)

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``weight`` overrides the layer's own (the output layer tied to the word embedding)."""
        weight = self.weight if weight is None else weight
        sp_group = self.tp_group if self.sequence_parallel else None  # [s/tp, b, h] in
        if sp_group is None:
            x = copy_to_tp_region(x, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        store = self.weight_grad_store if weight is self.weight else None  # a borrowed: at I
        y = linear(x, weight, bias, store, sp_group=sp_group)  # [s, b, h_out/tp]
        if self.gather_output:
            y = gather_from_tp_region(y, self.tp_group)
        return y, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with A split by input columns: rank r holds ``A[:, r*i/tp:(r+1)*i/tp]``.

    Input ``[s, b, h_in/tp]`` (``input_is_parallel``) or ``[s, b, h_in]`` (then split here). The
    partial products are all-reduced (``[s, b, h_out]``) or, under sequence parallel,
    reduce-scattered (``[s/tp, b, h_out]``). The bias is replicated and added after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod = default_init,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        tp = group_size(tp_group)
        self.weight_grad_store: WeightGradStore | None = None
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, tp, what="input size")
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        self.skip_bias_add, self.sequence_parallel = skip_bias_add, sequence_parallel
        self.weight = _sharded_parameter(
            (output_size, input_size),
            partition_dim=1,
            tp_group=tp_group,
            init_method=init_method,
            params_dtype=params_dtype,
            device=device,
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            set_tp_attributes(self.bias, partition_dim=None)
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        store = self.weight_grad_store
        if group_size(self.tp_group) == 1 and not self.skip_bias_add:
            return linear(x, self.weight, self.bias, store), None  # nothing to reduce: fuse bias
        partial = linear(x, self.weight, None, store)  # [s, b, h_out], a partial sum per TP rank
        if self.sequence_parallel:
            y = reduce_scatter_to_sp_region(partial, self.tp_group)  # [s/tp, b, h_out]
        else:
            y = reduce_from_tp_region(partial, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return y, self.bias
        return y + self.bias, None


def padded_vocab_size(vocab_size: int, *, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Round the vocabulary up to a multiple of ``make_vocab_size_divisible_by * tp_size``."""
    if vocab_size < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {vocab_size}")
    if make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"make_vocab_size_divisible_by must be >= 1, got {make_vocab_size_divisible_by}"
        )
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Embedding whose (padded) vocabulary is split over TP: rank r holds rows
    ``[r * V_pad/tp, (r+1) * V_pad/tp)``. Only the ``num_embeddings`` real rows are initialised from
    ``init_method``; padding rows are zero and no token id reaches them.

    Input ids of any shape; output ``[*ids.shape, h]`` all-reduced over TP, or with
    ``reduce_scatter_embeddings`` (sequence parallel; ids ``[s, b]``) reduce-scattered to ``[s/tp,
    b, h]``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group,
        make_vocab_size_divisible_by: int = 128,
        reduce_scatter_embeddings: bool = False,
        init_method: InitMethod = default_init,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        tp = group_size(tp_group)
        self.num_embeddings = num_embeddings
        self.padded_num_embeddings = padded_vocab_size(
            num_embeddings, make_vocab_size_divisible_by=make_vocab_size_divisible_by, tp_size=tp
        )
        self.num_embeddings_per_partition = self.padded_num_embeddings // tp
        self.vocab_start = group_rank(tp_group) * self.num_embeddings_per_partition
        self.tp_group, self.reduce_scatter_embeddings = tp_group, reduce_scatter_embeddings
        self.weight = _sharded_parameter(
            (self.padded_num_embeddings, embedding_dim),
            partition_dim=0,
            tp_group=tp_group,
            init_method=init_method,
            params_dtype=params_dtype,
            device=device,
            init_rows=num_embeddings,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp = group_size(self.tp_group)
        if tp > 1:
            outside = (ids < self.vocab_start) | (
                ids >= self.vocab_start + self.num_embeddings_per_partition
            )
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(ids, self.weight)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sp_region(out, self.tp_group)  # [s/tp, b, h]
        return reduce_from_tp_region(out, self.tp_group)
