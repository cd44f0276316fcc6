"""BlendedDataset: a weighted interleaving of datasets (``--data-path 0.3 A 0.7 B``).

Sample i of the blend is sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``. The
order is built by ``index_builders.build_blending_index``: after every prefix of n samples, each
dataset has given ``floor(w n)`` or ``ceil(w n)`` of them (within one sample of its share). Each
constituent's samples are taken in its own (shuffled) order, from its start.
"""

from __future__ import annotations

import os

import numpy as np

from megalite.data import index_cache
from megalite.data.cache_dirs import CacheDirs
from megalite.data.index_builders import build_blending_index


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (normalised here).

    Each dataset must hold at least its share: ``ceil(w * size) + 1`` samples is always enough.
    ``datasets`` should carry a ``description`` dict (GPTDataset does) for the cache key; without
    one the index is built in memory, as it is when ``cache`` is None.
    """

    def __init__(
        self,
        datasets: list,
        weights: list[float],
        size: int,
        *,
        cache: CacheDirs | None = None,
        write_cache: bool = True,
    ):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.datasets = datasets
        self.size = int(size)
        # any sequences of samples; only the GPT datasets describe themselves (for the cache)
        descriptions = [getattr(d, "description", None) for d in datasets]
        if any(d is None for d in descriptions):
            cache = None
        self.description = {
            "kind": "BlendedDataset",
            "weights": self.weights,
            "size": self.size,
            "datasets": descriptions,
        }
        arrays = index_cache.load_or_build(
            cache,
            self.description,
            ["dataset_index", "dataset_sample_index"],
            build=lambda: dict(
                zip(
                    ("dataset_index", "dataset_sample_index"),
                    build_blending_index(self.weights, self.size),
                )
            ),
            write=write_cache,
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(datasets))
        for d, ds in enumerate(datasets):
            used = int(counts[d])
            if used > len(ds):
                raise ValueError(
                    f"blended dataset {d} (weight {self.weights[d]:.4f}) must give {used} "
                    f"samples but holds {len(ds)}; build it with more samples"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        d = int(self.dataset_index[i])
        return self.datasets[d][int(self.dataset_sample_index[i])]


def default_blend_cache_dir(first_prefix: str) -> str:
    """Beside the first dataset's data: ``dirname(prefix)/cache/BlendedDataset_indices``."""
    return os.path.join(
        os.path.dirname(os.path.abspath(first_prefix)), "cache", "BlendedDataset_indices"
    )
