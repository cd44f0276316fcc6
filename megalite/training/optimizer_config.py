"""The optimizer's part of a run's configuration (``PretrainConfig.optimizer``): AdamW, its LR
schedule, clipping, and the loss scaling of fp16; it validates itself. The precision itself is the
model's ``GPTConfig.params_dtype`` (``--bf16`` / ``--fp16``)."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.core.optimizer.compressed import COMPRESSED_OPTIMIZERS, OPTIMIZERS, CompressionSpec
from megalite.errors import ConfigError, at_least
from megalite.training.lr_scheduler import DECAY_STYLES


@dataclass
class OptimizerConfig:
    """AdamW, its LR schedule, clipping, and the loss scaling that fp16 parameters need."""

    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None  # None: train_iters
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None
    lr_warmup_init: float = 0.0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    loss_scale: float | None = None  # fp16: a constant scale; None: dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # the word embedding / output weights' own LR schedule (Megatron's flags)
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    # adam (AdamW), lamb, or a compressed one (megalite.core.optimizer.compressed)
    optimizer: str = "adam"
    lamb_min_trust_ratio: float = 0.01
    lamb_max_trust_ratio: float = 10.0
    onebit_freeze_step: int = 100000  # 1-bit Adam / LAMB: full-precision warm-up steps
    zero_one_var_freeze_step: int = 100000
    zero_one_var_update_scaler: int = 16
    zero_one_local_step_scaler: int = 32678
    zero_one_local_step_clipper: int = 16
    onebit_lamb_factor_max: float = 4.0  # 1-bit LAMB: bounds on the frozen trust ratio's factor
    onebit_lamb_factor_min: float = 0.5
    onebit_lamb_factor_threshold: float = 0.1  # its largest relative change per step

    @property
    def compressed(self) -> bool:
        return self.optimizer in COMPRESSED_OPTIMIZERS

    def compression(self) -> CompressionSpec:
        return CompressionSpec(
            freeze_step=self.onebit_freeze_step,
            var_freeze_step=self.zero_one_var_freeze_step,
            var_update_scaler=self.zero_one_var_update_scaler,
            local_step_scaler=self.zero_one_local_step_scaler,
            local_step_clipper=self.zero_one_local_step_clipper,
            factor_max=self.onebit_lamb_factor_max,
            factor_min=self.onebit_lamb_factor_min,
            factor_threshold=self.onebit_lamb_factor_threshold,
        )

    def warmup_iters(self, decay_iters: int) -> float:
        if self.lr_warmup_fraction is not None:  # Megatron: a fraction of the decay samples
            return self.lr_warmup_fraction * decay_iters
        return self.lr_warmup_iters

    def validate(self, *, train_iters: int | None = None) -> None:
        """``train_iters`` stands in for ``lr_decay_iters`` when that is None."""
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr})")
        if self.lr_decay_style not in DECAY_STYLES:
            raise ConfigError(
                f"lr_decay_style must be one of {', '.join(DECAY_STYLES)}, got "
                f"{self.lr_decay_style!r}"
            )
        at_least(0, ("lr_warmup_iters", self.lr_warmup_iters))
        at_least(1, ("loss_scale_window", self.loss_scale_window))
        at_least(1, ("hysteresis", self.hysteresis))
        if self.lr_warmup_fraction is not None:
            if self.lr_warmup_iters:
                raise ConfigError(
                    "lr_warmup_fraction and lr_warmup_iters are mutually exclusive; choose one"
                )
            if not 0.0 <= self.lr_warmup_fraction <= 1.0:
                raise ConfigError(
                    f"lr_warmup_fraction must be in [0, 1], got {self.lr_warmup_fraction}"
                )
        decay = self.lr_decay_iters if self.lr_decay_iters is not None else train_iters
        if decay is not None:
            at_least(1, ("lr_decay_iters", decay))
            if self.lr_warmup_iters > decay:
                raise ConfigError(
                    f"lr_warmup_iters {self.lr_warmup_iters} exceeds lr_decay_iters {decay}"
                    + ("" if self.lr_decay_iters is not None else " (= train_iters)")
                    + "; shorten the warmup or lengthen the decay"
                )
        if self.clip_grad < 0 or self.weight_decay < 0:
            raise ConfigError(
                f"clip_grad ({self.clip_grad}) and weight_decay ({self.weight_decay}) must be >= 0"
            )
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1 and self.adam_eps > 0):
            raise ConfigError(
                f"need 0 <= adam_beta1 ({self.adam_beta1}), adam_beta2 ({self.adam_beta2}) < 1 "
                f"and adam_eps ({self.adam_eps}) > 0"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if not 0 <= self.lamb_min_trust_ratio <= self.lamb_max_trust_ratio:
            raise ConfigError(
                f"need 0 <= lamb_min_trust_ratio ({self.lamb_min_trust_ratio}) <= "
                f"lamb_max_trust_ratio ({self.lamb_max_trust_ratio})"
            )
        at_least(0, ("onebit_freeze_step", self.onebit_freeze_step))
        at_least(0, ("zero_one_var_freeze_step", self.zero_one_var_freeze_step))
        low, high = self.onebit_lamb_factor_min, self.onebit_lamb_factor_max
        if not 0 < low <= 1 <= high or self.onebit_lamb_factor_threshold < 0:
            raise ConfigError(
                f"need 0 < onebit_lamb_factor_min ({low}) <= 1 <= onebit_lamb_factor_max ({high}) "
                f"and onebit_lamb_factor_threshold ({self.onebit_lamb_factor_threshold}) >= 0"
            )
        for name in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            at_least(1, (f"zero_one_{name}", getattr(self, f"zero_one_{name}")))
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ConfigError(f"loss_scale must be > 0, got {self.loss_scale}")
        if self.initial_loss_scale < self.min_loss_scale or self.min_loss_scale <= 0:
            raise ConfigError(
                f"need 0 < min_loss_scale ({self.min_loss_scale}) <= initial_loss_scale "
                f"({self.initial_loss_scale})"
            )
