"""TensorBoard scalars (``--tensorboard-dir``), written by one rank (the logging rank).

Tags follow Megatron-LM: ``lm loss``, ``learning-rate``, ``loss-scale``, ``grad-norm``,
``batch-size``, ``num-skipped-iterations``, ``num-nan-iterations``, ``iteration-time``,
``tokens-per-second``, ``tflops-per-device``, ``mfu``, ``peak-memory-mib``, and for evaluation
``lm loss validation`` / ``lm loss validation ppl``. The x axis is the iteration. torch's
``SummaryWriter`` is imported only when a directory is given.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class TensorBoardLogger:
    """A no-op unless ``log_dir`` is set and ``enabled`` (this rank writes)."""

    def __init__(self, log_dir: str | None, *, enabled: bool, queue_size: int = 1000):
        self.writer = None
        if log_dir and enabled:
            # needs the optional tensorboard package: imported only when a run writes events
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)
            logger.info("writing TensorBoard scalars to %s", log_dir)

    @property
    def active(self) -> bool:
        return self.writer is not None

    def scalars(self, values: dict[str, float | None], step: int) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, float(value), step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
