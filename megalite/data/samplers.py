"""The DP-aware micro-batch sampler, the batch collator and the loader built from them.

Sample order is global: global batch g is samples ``[g * global_batch_size, (g + 1) *
global_batch_size)`` of the dataset's (shuffled, blended) order, whatever the DP size. As in
Megatron's MegatronPretrainingSampler, each micro-step takes the next ``micro_batch_size * dp_size``
consecutive samples and DP rank r gets its contiguous ``micro_batch_size`` slice, so a global batch
is ``global_batch_size / (micro_batch_size * dp_size)`` micro-steps. Resuming from
``consumed_samples`` (a multiple of ``micro_batch_size * dp_size``; checkpoints store multiples of
the global batch) yields exactly what the uninterrupted sampler yields from there on. Pure index
arithmetic: no process group is needed, so every DP rank's stream can be checked in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from megalite.data.gpt_dataset import document_ids, document_position_ids


class MicroBatchSampler:
    """Yields this DP rank's micro-batches as lists of sample indices.

    Finite (``cyclic=False``): every complete global batch of ``[0, total_samples)`` from
    ``consumed_samples`` on; an incomplete last global batch is dropped. Cyclic: the first
    ``total_samples`` rounded down to whole global batches, over and over (validation); consumed
    samples count from the start of the first cycle.
    """

    def __init__(
        self,
        *,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        cyclic: bool = False,
    ):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"micro_batch_size {micro_batch_size} and dp_size {dp_size} must be >= 1 and "
                f"0 <= dp_rank {dp_rank} < dp_size"
            )
        step = micro_batch_size * dp_size
        if global_batch_size % step:
            raise ValueError(
                f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size "
                f"{micro_batch_size} x data-parallel size {dp_size} = {step}"
            )
        if consumed_samples < 0 or consumed_samples % step:
            raise ValueError(
                f"consumed samples {consumed_samples} is not a non-negative multiple of "
                f"micro_batch_size x dp_size = {step}; resume from a checkpoint of this batch setup"
            )
        self.end = (total_samples // global_batch_size) * global_batch_size
        if cyclic and self.end == 0:
            raise ValueError(
                f"{total_samples} samples hold no whole global batch of {global_batch_size}"
            )
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.step = step
        self.dp_rank = dp_rank
        self.cyclic = cyclic

    def __len__(self) -> int:
        if self.cyclic:
            raise TypeError("a cyclic sampler has no length")
        return max(0, self.end - self.consumed_samples) // self.step

    def __iter__(self) -> Iterator[list[int]]:
        first = self.dp_rank * self.micro_batch_size
        start = self.consumed_samples
        if self.cyclic:
            start %= self.end
        while True:
            for s in range(start, self.end, self.step):
                yield list(range(s + first, s + first + self.micro_batch_size))
            if not self.cyclic:
                return
            start = 0


class GPTBatchCollator:
    """Stacks samples (int64 ``[s + 1]`` each) into the training batch dict, all ``[b, s]``:
    ``tokens`` and ``labels`` int64 (labels are tokens shifted by one), ``loss_mask`` float32 (0.0
    where the input token is eod when ``eod_mask_loss``, as Megatron masks it, else 1.0) and
    ``position_ids`` int64 (0..s-1)."""

    def __init__(
        self,
        *,
        eod: int,
        eod_mask_loss: bool,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
    ):
        self.eod = int(eod)
        self.eod_mask_loss = bool(eod_mask_loss)
        # documents inside a sample: positions restart after each eod; ``document_ids`` keep
        # attention inside each document (``gpt_dataset.get_ltor_masks_and_position_ids``, in
        # compact form)
        self.reset_position_ids = bool(reset_position_ids)
        self.reset_attention_mask = bool(reset_attention_mask)

    def __call__(self, samples: list[np.ndarray]) -> dict[str, torch.Tensor]:
        data = torch.from_numpy(np.stack(samples).astype(np.int64, copy=False))  # [b, s + 1]
        b, s = data.shape[0], data.shape[1] - 1
        # tokens, labels and position_ids share one storage: a DataLoader worker then hands the
        # batch over in two shared-memory segments instead of four (measured ~2x faster).
        ints = torch.empty((3, b, s), dtype=torch.int64)
        ints[0] = data[:, :-1]  # tokens
        ints[1] = data[:, 1:]  # labels
        ints[2] = torch.arange(s, dtype=torch.int64)  # position_ids
        loss_mask = torch.ones((b, s), dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[ints[0] == self.eod] = 0.0
        if self.reset_position_ids:
            ints[2] = document_position_ids(ints[0], self.eod)
        batch = {
            "tokens": ints[0],
            "labels": ints[1],
            "loss_mask": loss_mask,
            "position_ids": ints[2],
        }
        if self.reset_attention_mask:
            batch["document_ids"] = document_ids(ints[0], self.eod)
        return batch


class _SampleView(torch.utils.data.Dataset):
    """Map-style torch view of any dataset with ``__len__`` and ``__getitem__``."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.dataset[i]


def make_loader(
    dataset,
    sampler: MicroBatchSampler,
    *,
    eod: int,
    eod_mask_loss: bool,
    num_workers: int = 0,
    device: torch.device | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """An iterator over this rank's micro-batch dicts; pinned memory when ``device`` is CUDA."""
    pin = device is not None and torch.device(device).type == "cuda"
    loader = torch.utils.data.DataLoader(
        _SampleView(dataset),
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=GPTBatchCollator(
            eod=eod,
            eod_mask_loss=eod_mask_loss,
            reset_position_ids=reset_position_ids,
            reset_attention_mask=reset_attention_mask,
        ),
        pin_memory=pin,
    )
    return iter(loader)
