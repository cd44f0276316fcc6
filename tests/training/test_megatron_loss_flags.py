"""Megatron's ``--calculate-per-token-loss``, documents (``--reset-position-ids``,
``--reset-attention-mask``) through the training step, and ``--log-num-zeros-in-grad`` in the log.

Per-token loss (Megatron's semantics): the gradient of a step is that of the global batch's
``sum(loss * mask) / sum(mask)`` over every micro-batch and DP rank, here at DP2 x 2 micro-batches
whose loss masks differ, against that loss written out on one process (fp32, 1e-5; the two differ
only in reduction order). The default (a mean of per-micro-batch means) gives another gradient with
these masks, so the comparison can fail. Under PP2 the documents' positions and masks reach every
stage: the losses of two steps equal the single-process run's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megalite.core.parallel_state import ParallelState
from megalite.data.samplers import GPTBatchCollator
from megalite.models import GPTModel
from megalite.training.config import ConfigError
from megalite.training.forward_step import make_forward_step
from megalite.training.logging import IntervalStats, format_iteration_line
from tests.harness import run_distributed
from tests.mesh import mesh
from tests.training.common import FAMILIES, LogCapture, config, trainer_and_data

TOL = 1e-5
EOD = 127  # NullTokenizer --vocab-size 127: eod is 127
CPU = torch.device("cpu")


def _micro_batches(steps: int = 2, per_step: int = 4) -> list[dict]:
    """``steps x per_step`` micro-batches of 2 samples x 16 tokens with eods inside, and loss masks
    that keep a different number of tokens in each micro-batch."""
    rng = np.random.default_rng(0)
    collate = GPTBatchCollator(
        eod=EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True
    )
    out = []
    for k in range(steps * per_step):
        samples = [rng.integers(0, EOD, 17) for _ in range(2)]
        for s in samples:
            s[rng.integers(1, 15, 2)] = EOD
        batch = collate(samples)
        batch["loss_mask"][:, 3 + 3 * (k % per_step) :] = 0.0  # 6, 12, 18, 24 tokens kept
        out.append(batch)
    return out


def _oracle_grads(model: GPTModel, batches: list[dict], *, per_token: bool):
    model.zero_grad()
    sums, counts, means = [], [], []
    for b in batches:
        mask = None
        if "document_ids" in b:
            mask = (b["document_ids"].unsqueeze(-1) != b["document_ids"].unsqueeze(-2)).unsqueeze(1)
        loss = model(b["tokens"], b["position_ids"], b["labels"], attention_mask=mask)
        sums.append((loss * b["loss_mask"]).sum())
        counts.append(b["loss_mask"].sum())
        means.append(sums[-1] / counts[-1])
    total = sum(sums) / sum(counts) if per_token else sum(means) / len(means)
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _per_token_case(family: str, layout: str):
    """``dp2``: DP 2 x 2 micro-batches of 2 per rank (gbs 8); ``cp2``: CP 2 x 4 micro-batches,
    without the document mask (refused under CP) but with the documents' positions. No clipping:
    it would rescale the grads."""
    rank = dist.get_rank()
    cp = ["--context-parallel-size", "2"] if layout == "cp2" else []
    flags = [*FAMILIES[family], *cp, "--calculate-per-token-loss", "--clip-grad", "0"]
    cfg = config(*flags, world_size=2, rank=rank)
    ps = mesh(1, cp=2 if cp else 1)
    trainer, _ = trainer_and_data(cfg, ps)
    module = trainer.model[0].module
    oracle = GPTModel(cfg.model, ParallelState.single())
    oracle.load_state_dict(module.state_dict())
    batches = _micro_batches(steps=1)
    if cp:
        for b in batches:
            del b["document_ids"]
    loss, want = _oracle_grads(oracle, batches, per_token=True)
    _, mean_of_means = _oracle_grads(oracle, batches, per_token=False)
    mine = batches if cp else [batches[j * 2 + rank] for j in range(2)]  # this rank's
    step = trainer.step(make_forward_step(CPU, calculate_per_token_loss=True), [iter(mine)])
    errors = {n: _err(p.main_grad, want[n]) for n, p in module.named_parameters()}
    errors["lm loss"] = _err(step.losses["lm loss"], loss)
    default = max(_err(want[n], mean_of_means[n]) for n in want)
    return errors, default


def _pp2_documents_case(family: str):
    rank = dist.get_rank()
    documents = "--reset-position-ids --reset-attention-mask --eod-mask-loss --train-iters 2"
    flags = (*FAMILIES[family], "--calculate-per-token-loss", *documents.split())
    batches = _micro_batches(steps=2)
    losses = {}
    for name, pp in (("pp2", 2), ("single", 1)):
        if pp == 2:
            cfg = config(*flags, "--pipeline-model-parallel-size", "2", world_size=2, rank=rank)
            ps = mesh(1, 2)
        else:
            cfg, ps = config(*flags), ParallelState.single()
        trainer, _ = trainer_and_data(cfg, ps)
        forward = make_forward_step(CPU, calculate_per_token_loss=True)
        data = iter(batches)  # every stage reads the same micro-batches
        got = [trainer.step(forward, [data]).losses.get("lm loss") for _ in range(2)]
        losses[name] = got
    return losses


@pytest.mark.parametrize("family,layout", [("gpt2", "dp2"), ("llama", "dp2"), ("llama", "cp2")])
def test_per_token_loss_grads_equal_single_process(family, layout):
    for errors, default in run_distributed(_per_token_case, 2, family, layout):
        bad = {k: v for k, v in errors.items() if not v < TOL}
        assert not bad, bad
        assert default > 1e-3  # the masks differ: the default loss has another gradient


def test_documents_and_per_token_loss_carried_through_pp2():
    results = run_distributed(_pp2_documents_case, 2, "llama")
    losses = results[1]  # the last stage holds the losses
    for got, want in zip(losses["pp2"], losses["single"]):
        assert _err(got, want) < TOL, (losses["pp2"], losses["single"])


def test_reset_attention_mask_refused_under_all_gather_context_parallel():
    with pytest.raises(ConfigError, match="reset-attention-mask.*need --cp-comm-type p2p or a2a"):
        config(
            "--reset-attention-mask",
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            "all_gather",
            world_size=2,
        )


def test_num_zeros_in_log_line_and_tensorboard():
    base = dict(
        iteration=1,
        train_iters=2,
        consumed_samples=8,
        ms_per_iteration=1.0,
        learning_rate=1e-3,
        global_batch_size=8,
        losses={"lm loss": 2.0},
        loss_scale=1.0,
        grad_norm=0.5,
        skipped_iterations=0,
        nan_iterations=0,
        tokens_per_second=1.0,
        tflops_per_device=0.0,
        mfu_percent=None,
        peak_memory_mib=1.0,
    )
    line = format_iteration_line(IntervalStats(**base, num_zeros_in_grad=12.0))
    assert "| grad norm: 0.500 | num zeros: 12.0 |" in line
    assert "num zeros" not in format_iteration_line(IntervalStats(**base))

    run = "--log-interval 1 --train-iters 2 --global-batch-size 2".split()
    cfg = config("--log-num-zeros-in-grad", *run)
    trainer, data = trainer_and_data(cfg, ParallelState.single())
    written: dict[str, float] = {}

    class Board:
        active, writer = True, None

        def scalars(self, values, step):
            written.update({k: v for k, v in values.items() if v is not None})

    trainer.progress.tensorboard = Board()
    with LogCapture() as logs:
        trainer.train(make_forward_step(CPU), data)
    lines = [m for m in logs.lines if m.startswith(" iteration")]
    assert len(lines) == 2 and all(" num zeros: " in m for m in lines), lines
    assert "num-zeros" in written and written["num-zeros"] >= 0
