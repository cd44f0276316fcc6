"""The numpy index arithmetic behind GPTDataset and BlendedDataset (pure functions, no files).

Vocabulary: a *stream* is the documents of a split laid end to end, epoch after epoch, each epoch in
its own shuffled order (the document index). Sample i is stream tokens ``[i*s, i*s + s + 1)`` for
``s = seq_length``: seq_length + 1 tokens (inputs and the shifted labels), consecutive samples share
one token, and samples run across document and epoch boundaries. A stream of T tokens therefore
holds ``N = (T - 1) // s`` samples, and every token is an input of exactly one sample except the
*tail*: the last ``T - N*s`` tokens (1 to s of them; the first is still the last sample's final
label). Only the last epoch of a stream has a tail; earlier epochs flow into the next one.
"""

from __future__ import annotations

import numpy as np

# Megatron's rule: when the last epoch is needed for fewer than this share of its samples, it is
# shuffled apart from the full epochs, so the requested samples take every full epoch plus a random
# part of the last one (instead of a random subset of all epochs).
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
BLEND_WEIGHT_SCALE = 1 << 40  # blending weights are made integers summing to this


def compute_split_ranges(
    num_documents: int, split: tuple[float, float, float]
) -> list[tuple[int, int]]:
    """Megatron-core's split arithmetic: document ranges [lo, hi) for train, valid and test.

    The normalised weights are summed into book-ends ``[0, w0, w0 + w1, w0 + w1 + w2]``; split
    ``i`` holds the documents ``round(end_i * D) - round(start_i * D)`` from ``round(start_i * D)``
    (Python's round, half to even, as Megatron's ``int(round(...))``), an empty range where its
    weight is 0. E.g. 73 documents at ``--split 90,5,5`` give train 66, valid 3, test 4 (the
    older ``get_split_indices`` rule, rounding each size and then shifting, gave train 65).
    """
    ends = [0.0]
    for w in split:
        ends.append(ends[-1] + w)
    out = []
    for i in range(3):
        lo = int(round(ends[i] * float(num_documents)))
        hi = int(round(ends[i + 1] * float(num_documents))) if ends[i + 1] > ends[i] else lo
        out.append((lo, min(max(lo, hi), num_documents)))
    return out


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    """The fewest epochs whose stream holds ``num_samples`` samples (1 when None)."""
    if tokens_per_epoch <= 0:
        raise ValueError("the split holds no tokens; it cannot give samples")
    if num_samples is None:
        return 1
    # need (E * T - 1) // s >= num_samples  <=>  E * T >= num_samples * s + 1
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.Generator
) -> np.ndarray:
    """[num_epochs * D] document ids: each epoch an independent permutation of ``documents``."""
    dtype = np.int32 if documents.size == 0 or int(documents.max()) < 2**31 - 1 else np.int64
    tiled = np.broadcast_to(documents.astype(dtype), (num_epochs, documents.size))
    return rng.permuted(tiled, axis=1).reshape(-1)  # [E * D]


def build_sample_index(
    sizes: np.ndarray, document_index: np.ndarray, *, seq_length: int, num_samples: int
) -> np.ndarray:
    """[num_samples + 1, 2] (position in document_index, token offset) where each sample starts.

    Row i locates stream token ``i * seq_length``; row ``num_samples`` is where the last sample's
    final (shared) token sits. Offsets are always inside their document (empty documents are never
    pointed at). Vectorised: one cumulative sum and one binary search.
    """
    lengths = sizes[document_index].astype(np.int64)  # tokens of each stream document
    ends = np.cumsum(lengths)  # exclusive end of each stream document
    if num_samples * seq_length + 1 > (int(ends[-1]) if ends.size else 0):
        raise ValueError(
            f"{num_samples} samples of {seq_length} + 1 tokens need more than the stream's "
            f"{int(ends[-1]) if ends.size else 0} tokens"
        )
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(ends, starts, side="right")
    offsets = starts - (ends[doc_pos] - lengths[doc_pos])
    big = max(int(document_index.size), int(sizes.max(initial=0))) >= 2**31 - 1
    out = np.empty((num_samples + 1, 2), dtype=np.int64 if big else np.int32)
    out[:, 0] = doc_pos
    out[:, 1] = offsets
    return out


def build_shuffle_index(
    total: int, separate_from: int | None, rng: np.random.Generator
) -> np.ndarray:
    """A permutation of ``range(total)``; with ``separate_from = k``, ``[0, k)`` and ``[k, total)``
    are shuffled apart and concatenated (Megatron's separate final epoch)."""
    dtype = np.uint32 if total < 2**32 - 1 else np.int64
    if separate_from is None or separate_from >= total:
        return rng.permutation(total).astype(dtype)
    head = rng.permutation(separate_from)
    tail = separate_from + rng.permutation(total - separate_from)
    return np.concatenate([head, tail]).astype(dtype)


def build_gpt_indices(
    sizes: np.ndarray,
    documents: np.ndarray,
    *,
    seq_length: int,
    seed: int,
    num_samples: int | None,
) -> dict[str, np.ndarray]:
    """The three arrays of a GPTDataset split: document, sample and shuffle index.

    ``sizes`` are the token counts of every sequence of the indexed dataset and ``documents`` the
    ids this split owns. The stream has enough epochs for ``num_samples`` (one epoch when None);
    the dataset's length is every sample of those epochs (>= num_samples).
    """
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    num_epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    if total < 1:
        raise ValueError(
            f"the split holds {tokens_per_epoch} tokens, fewer than one sample of --seq-length "
            f"{seq_length} + 1; use more data or a shorter --seq-length"
        )
    separate_from = None
    if num_epochs > 1 and num_samples is not None:
        before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        if num_samples - before_final < SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch:
            separate_from = before_final
    rng = np.random.default_rng(seed)
    document_index = build_document_index(documents, num_epochs, rng)
    sample_index = build_sample_index(
        sizes, document_index, seq_length=seq_length, num_samples=total
    )
    shuffle_index = build_shuffle_index(total, separate_from, rng)
    return {
        "document_index": document_index,
        "sample_index": sample_index,
        "shuffle_index": shuffle_index,
    }


def integer_weights(weights: list[float], scale: int = BLEND_WEIGHT_SCALE) -> list[int]:
    """Positive weights -> integers summing to ``scale`` exactly (largest remainder)."""
    w = np.asarray(weights, dtype=np.float64)
    raw = w / w.sum() * scale
    out = np.floor(raw).astype(np.int64)
    short = scale - int(out.sum())
    out[np.argsort(-(raw - out), kind="stable")[:short]] += 1
    tiny = out == 0  # a weight under 1 / scale of the total: keep it drawable, barely
    out[tiny] = 1
    out[int(np.argmax(out))] -= int(tiny.sum())
    return [int(x) for x in out]


def build_blending_index(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]) for a weighted blend.

    Guarantee (quota): after any prefix of n samples, dataset d has contributed
    ``floor(w_d n)`` or ``ceil(w_d n)`` samples, so it is within one sample of its share. Built as
    earliest-deadline-first over the datasets' next samples: dataset d's k-th sample (from 0) may
    not come before position ``floor(k / w_d) + 1`` (its release) and must come by position
    ``ceil((k + 1) / w_d)`` (its deadline); at each position the released sample with the earliest
    deadline goes next (ties: lower dataset index). A schedule meeting every such window exists
    (Balinski and Young's quota method) and EDF finds one. Exact integer arithmetic; O(size * D)
    steps in Python, a few seconds per 10 M samples, cached by the caller.
    """
    scale = BLEND_WEIGHT_SCALE
    iw = integer_weights(weights, scale)
    num = len(iw)
    if num > np.iinfo(np.int16).max:
        raise ValueError(f"at most {np.iinfo(np.int16).max} datasets can be blended, got {num}")
    release = [1] * num  # earliest 1-based position of each dataset's next sample
    deadline = [-(-scale // w) for w in iw]  # latest 1-based position of it
    counts = [0] * num
    order = range(num)
    out = np.empty(size, dtype=np.int16)
    for pos in range(1, size + 1):
        best, best_deadline = -1, None
        for d in order:
            if release[d] <= pos and (best_deadline is None or deadline[d] < best_deadline):
                best, best_deadline = d, deadline[d]
        out[pos - 1] = best
        k = counts[best] + 1
        counts[best] = k
        w = iw[best]
        release[best] = (k * scale) // w + 1
        deadline[best] = -(-((k + 1) * scale) // w)
    sample_index = np.empty(size, dtype=np.int64)
    for d in range(num):
        where = np.flatnonzero(out == d)
        sample_index[where] = np.arange(where.size, dtype=np.int64)
    return out, sample_index
