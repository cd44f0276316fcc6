"""The GPT model split into pipeline stages equals the single-process model.

For PP in {2, 4} and num_microbatches in {pp, 2*pp + 1}, tied and untied embeddings, both families:
every micro-batch's loss (on the last stage) and every parameter's grad (on the stage that holds it)
equal one GPTModel built with ``ParallelState.single()`` in the same process from the same seed, run
over the same micro-batches with no pipelining. The tied word embedding's two copies (first and last
stage) both equal the oracle's grad once summed over the embedding group (what the data-parallel
wrappers do for ``shared_params``). fp32, rtol 1e-5 / atol 1e-6: only the order in which
micro-batch grads are summed differs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.core.pipeline_parallel.forward_backward import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_1f1b,
    forward_backward_pipelining_gpipe,
)
from megalite.core.pipeline_parallel.model_chunk import ModelChunk
from megalite.core.pipeline_parallel.p2p import P2PCommunicator
from megalite.models import GPTModel
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.models.helpers import make_batch, make_config, weighted_lm_step

TOL = dict(rtol=1e-5, atol=1e-6)
SCHEDULES = {"1f1b": forward_backward_pipelining_1f1b, "gpipe": forward_backward_pipelining_gpipe}


def _sum_tied_embedding_grad(weight, embedding_group) -> None:
    """What the data-parallel wrappers do for tied embeddings (``shared_params``): the first and
    the last stage's copies each got their part of the grad; sum them over the embedding group."""
    if weight is None or embedding_group is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=embedding_group)


def _microbatches(config, m):
    return [make_batch(config, seed=100 + i) for i in range(m)]


def _global_name(name: str, offset: int) -> str:
    """Stage-local ``decoder.layers.{i}`` -> the oracle's global layer number."""
    if name.startswith("decoder.layers."):
        _, _, i, rest = name.split(".", 3)
        return f"decoder.layers.{int(i) + offset}.{rest}"
    return name


def _stage_case(pp, cases):
    ps = mesh(1, pp)
    for family, tied, m, schedule, first_last in cases:
        first, last = first_last or (None, None)
        config = make_config(
            family,
            num_layers=4 if first_last is None else 5,
            untie_embeddings_and_output_weights=not tied,
            decoder_first_pipeline_num_layers=first,
            decoder_last_pipeline_num_layers=last,
        )
        ranges = config.stage_layer_ranges(pp)
        model = GPTModel(
            config,
            ps,
            pre_process=ps.is_first_stage,
            post_process=ps.is_last_stage,
            layer_range=ranges[ps.pp_rank],
        )
        p2p = P2PCommunicator(
            prev_rank=ps.prev_rank,
            next_rank=ps.next_rank,
            tensor_shape=(config.seq_length, 2, config.hidden_size),
            dtype=torch.float32,
            device=torch.device("cpu"),
            group=ps.pp_group,
        )
        losses = SCHEDULES[schedule](
            forward_step_func=weighted_lm_step,
            data_iterator=[iter(_microbatches(config, m))],
            model=[ModelChunk(model)],
            num_microbatches=m,
            p2p=p2p,
            pp_rank=ps.pp_rank,
            pp_size=pp,
        )
        _sum_tied_embedding_grad(model.shared_embedding_or_output_weight(), ps.embedding_group)

        oracle = GPTModel(config, ParallelState.single())
        want = forward_backward_no_pipelining(
            forward_step_func=weighted_lm_step,
            data_iterator=[iter(_microbatches(config, m))],
            model=[ModelChunk(oracle)],
            num_microbatches=m,
        )
        label = (family, tied, m, schedule, first_last, ps.pp_rank)
        if ps.is_last_stage:
            assert len(losses) == m, label
            for got, w in zip(losses, want):
                torch.testing.assert_close(got["lm loss"], w["lm loss"], **TOL)
        oracle_params = dict(oracle.named_parameters())
        offset = ranges[ps.pp_rank][0]
        checked = 0
        for name, p in model.named_parameters():
            ref_name = _global_name(name, offset)
            if name == "output_layer.weight" and tied:  # the last stage's copy of the embedding
                ref_name = "embedding.word_embeddings.weight"
            ref = oracle_params[ref_name]
            torch.testing.assert_close(p.detach(), ref.detach(), **TOL, msg=f"{label} {name}")
            torch.testing.assert_close(p.grad, ref.grad, **TOL, msg=f"{label} {name} grad")
            checked += 1
        assert checked > 0
    return True


def _cases(pp):
    cases = []
    for family in ("gpt2", "llama"):
        for tied in (True, False):
            for m in (pp, 2 * pp + 1):
                cases.append((family, tied, m, "1f1b", None))
    cases.append(("gpt2", True, pp + 1, "gpipe", None))
    cases.append(("llama", True, 3, "1f1b", (2, None) if pp == 2 else (2, 1)))
    return cases


@pytest.mark.parametrize("pp", [2, 4])
def test_gpt_pipeline_equals_single_process(pp):
    assert run_distributed(_stage_case, pp, pp, _cases(pp), timeout=600) == [True] * pp
