"""GPTDataset: fixed-length samples over one split of an indexed dataset, Megatron's semantics.

A split owns a contiguous range of the dataset's documents (``--split 969,30,1``, by document; each
sequence of the indexed dataset is one document, as ``tools/preprocess_data.py`` writes them). Its
documents are laid end to end in a per-epoch shuffled order, cut into samples of seq_length + 1
tokens that run across document boundaries, with as many epochs as the requested sample count
needs, and the samples are shuffled (see ``index_builders``). ``ds[i]`` is an int64 array of
seq_length + 1 tokens. The index arrays are cached (``index_cache``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from megalite.data import cache_dirs, index_cache
from megalite.data.index_builders import build_gpt_indices
from megalite.data.indexed_dataset import IndexedDataset

if TYPE_CHECKING:
    import torch

SPLIT_NAMES = ("train", "valid", "test")


def default_cache_dir(prefix: str) -> str:
    """Beside the data, as Megatron does: ``dirname(prefix)/cache/GPTDataset_indices``."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


def dataset_fingerprint(indexed: IndexedDataset) -> dict:
    """What identifies the files' contents in a cache key: absolute path, sizes, mtimes, counts."""
    idx_stat = os.stat(indexed.prefix + ".idx")
    bin_stat = os.stat(indexed.prefix + ".bin")
    return {
        "prefix": os.path.abspath(indexed.prefix),
        "idx_bytes": idx_stat.st_size,
        "idx_mtime_ns": idx_stat.st_mtime_ns,
        "bin_bytes": bin_stat.st_size,
        "bin_mtime_ns": bin_stat.st_mtime_ns,
        "num_sequences": len(indexed),
    }


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from documents ``[lo, hi)`` of ``indexed``.

    ``len(ds)`` is every sample of the epochs built (at least ``num_samples``; one epoch when
    None). ``cache_dir`` None means :func:`default_cache_dir` (or the per-user folder when that
    cannot be written: ``cache_dirs``); ``write_cache`` False means this rank only reads the cache
    (building in memory if it is missing or invalid).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: tuple[int, int],
        *,
        num_samples: int | None,
        seq_length: int,
        seed: int,
        split_name: str = "train",
        cache_dir: str | None = None,
        write_cache: bool = True,
        use_cache: bool = True,
    ):
        lo, hi = documents
        if not 0 <= lo < hi <= len(indexed):
            raise ValueError(
                f"{split_name} split of {indexed.prefix}: document range [{lo}, {hi}) is empty or "
                f"outside its {len(indexed)} documents; adjust --split"
            )
        self.indexed = indexed
        self.seq_length = seq_length
        self.split_name = split_name
        self.description = {
            "kind": "GPTDataset",
            "data": dataset_fingerprint(indexed),
            "split": split_name,
            "documents": [lo, hi],
            "seq_length": seq_length,
            "seed": seed,
            "num_samples": num_samples,
        }
        sizes = indexed.sequence_lengths

        def build() -> dict[str, np.ndarray]:
            docs = np.arange(lo, hi, dtype=np.int64)
            return build_gpt_indices(
                np.asarray(sizes), docs, seq_length=seq_length, seed=seed, num_samples=num_samples
            )

        dirs = None
        if use_cache:
            beside = default_cache_dir(indexed.prefix)
            dirs = cache_dirs.resolve(cache_dir, beside=beside, writer=write_cache)
        arrays = index_cache.load_or_build(
            dirs,
            self.description,
            ["document_index", "sample_index", "shuffle_index"],
            build=build,
            write=write_cache,
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        if num_samples is not None and len(self) < num_samples:
            raise RuntimeError(f"{split_name}: built {len(self)} samples, {num_samples} asked")

    def __len__(self) -> int:
        return int(self.shuffle_index.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i`` of the shuffled order: int64 tokens ``[seq_length + 1]``."""
        j = int(self.shuffle_index[i])
        pos, offset = (int(x) for x in self.sample_index[j])
        need = self.seq_length + 1
        out = np.empty(need, dtype=np.int64)
        filled = 0
        sizes = self.indexed.sequence_lengths
        while filled < need:
            doc = int(self.document_index[pos])
            take = min(int(sizes[doc]) - offset, need - filled)
            out[filled : filled + take] = self.indexed.get(doc, offset, take)
            filled += take
            pos += 1
            offset = 0
        return out


# --- documents inside a sample (--reset-position-ids, --reset-attention-mask) -------------------
# torch tensors in and out; torch is imported inside (``megalite.data`` imports no torch).


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """# [b, s] int64: the index of each token's document inside its sample, counting the eod
    tokens strictly before it (an eod belongs to the document it ends, as in Megatron)."""
    import torch

    is_eod = (tokens == eod).to(torch.int64)
    return torch.cumsum(is_eod, dim=-1) - is_eod


def document_position_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """# [b, s] int64: positions that restart at 0 on the token after each eod."""
    import torch

    s = tokens.shape[-1]
    arange = torch.arange(s, dtype=torch.int64, device=tokens.device).expand_as(tokens)
    after_eod = torch.where(tokens == eod, arange + 1, torch.zeros_like(arange))
    start = torch.cummax(after_eod, dim=-1).values  # first position of each token's document
    start = torch.cat([torch.zeros_like(start[..., :1]), start[..., :-1]], dim=-1)
    return arange - start


def document_attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """bool # [b, 1, s, s] from ``document_ids`` # [b, s]: True where query i may NOT read key j
    because they lie in different documents (the causal part is the attention's)."""
    return (doc_ids.unsqueeze(-1) != doc_ids.unsqueeze(-2)).unsqueeze(1)


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    *,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's left-to-right masks for tokens ``data`` # [b, s]: (attention_mask bool
    # [b or 1, 1, s, s], True where masked, causal included; loss_mask float32 # [b, s];
    position_ids int64 # [b, s]). The loader ships the compact ``document_ids`` instead of this
    ``s x s`` mask; the two describe the same attention."""
    import torch

    b, s = data.shape
    causal = torch.ones(s, s, dtype=torch.bool, device=data.device).triu(1)
    if reset_attention_mask:
        attention_mask = document_attention_mask(document_ids(data, eod_token)) | causal
    else:
        attention_mask = causal.view(1, 1, s, s)
    loss_mask = torch.ones((b, s), dtype=torch.float32, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    if reset_position_ids:
        position_ids = document_position_ids(data, eod_token)
    else:
        position_ids = torch.arange(s, dtype=torch.int64, device=data.device).expand(b, s)
    return attention_mask, loss_mask, position_ids
