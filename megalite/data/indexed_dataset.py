"""Megatron's indexed dataset (``P.bin`` + ``P.idx``): a memory-mapped reader, a streaming builder.

The index format (little-endian; DESIGN section 4)::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version = 1
    uint8     dtype code (DTYPE_CODES)
    uint64    sequence count S
    uint64    document count D (= documents + 1)
    int32[S]  sequence lengths in tokens
    int64[S]  sequence pointers: byte offset of each sequence in P.bin
    int64[D]  document indices: 0, then the running sequence count at the end of each document

``P.bin`` holds the tokens of all sequences back to back in that dtype. The reader maps both files
and never reads ``P.bin`` whole; the builder writes both with O(1) memory (lengths and document
indices spill to side files until ``finalize``) under temporary names that ``commit`` renames into
place, so an interrupted write never leaves a pair that looks valid.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
from collections.abc import Iterable

import numpy as np

from megalite.errors import UserError, path_problem

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_CHUNK = 1 << 20  # entries per streamed chunk when assembling an index


class IndexedDatasetError(UserError, ValueError):
    """A malformed ``.bin``/``.idx`` pair; the message names the file and what is wrong."""


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Megatron's rule: uint16 when the vocabulary is under 65,500 tokens, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def dtype_code(dtype: np.dtype | type) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(
            f"dtype {np.dtype(dtype)} has no indexed-dataset code; use one of "
            f"{sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())}"
        ) from None


class IndexedDataset:
    """Read-only, memory-mapped view of ``prefix.bin`` / ``prefix.idx``.

    ``ds[i]`` is sequence i as a read-only numpy array of ``ds.dtype`` (a view into the map);
    ``ds.get(i, offset, length)`` a slice of it. ``sequence_lengths`` (int32 [S]),
    ``sequence_pointers`` (int64 [S]) and ``document_indices`` (int64 [D]) are views into the index.
    Opening validates the header, the index size and the ``.bin`` size (IndexedDatasetError).
    Pickling keeps only the prefix; the copy re-maps the files (DataLoader workers).
    """

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        self._open()

    def _open(self) -> None:
        try:
            self._open_files()
        except OSError as e:  # unreadable (permissions, I/O error): name the file
            raise IndexedDatasetError(
                f"{e.filename or self.prefix}: cannot read the dataset ({path_problem(e)}); check "
                "the path and its permissions"
            ) from None

    def _open_files(self) -> None:
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(
                    f"{path}: no such file (a dataset prefix P needs both P.idx and P.bin)"
                )
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index: {idx_size} bytes, the header alone needs "
                f"{HEADER_BYTES}"
            )
        if header[: len(MAGIC)] != MAGIC:
            raise IndexedDatasetError(
                f"{idx_path}: wrong magic {header[: len(MAGIC)]!r} (expected {MAGIC!r}); "
                "not a Megatron indexed-dataset index"
            )
        (version,) = struct.unpack_from("<Q", header, 9)
        (code,) = struct.unpack_from("<B", header, 17)
        num_seqs, num_docs = struct.unpack_from("<QQ", header, 18)
        if version != VERSION:
            raise IndexedDatasetError(
                f"{idx_path}: unsupported index version {version} (this reader knows {VERSION})"
            )
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(
                f"{idx_path}: unknown dtype code {code} (valid codes: 1..8, e.g. 8 uint16, 4 int32)"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_BYTES + 12 * num_seqs + 8 * num_docs
        if idx_size < expected:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index: {idx_size} bytes, but {num_seqs} sequences and "
                f"{num_docs} document entries need {expected}"
            )
        if idx_size not in (expected, expected + num_seqs):  # + S: Megatron's multimodal modes
            raise IndexedDatasetError(
                f"{idx_path}: {idx_size - expected} unexpected bytes after the document indices "
                f"({num_seqs} sequences, {num_docs} document entries need {expected} bytes)"
            )
        if num_docs < 1:
            raise IndexedDatasetError(
                f"{idx_path}: document count is 0; the document index always starts with 0"
            )
        idx_map = np.asarray(np.memmap(idx_path, dtype=np.uint8, mode="r"))  # ndarray view
        off = HEADER_BYTES
        self.sequence_lengths = idx_map[off : off + 4 * num_seqs].view(np.int32)
        off += 4 * num_seqs
        self.sequence_pointers = idx_map[off : off + 8 * num_seqs].view(np.int64)
        off += 8 * num_seqs
        self.document_indices = idx_map[off : off + 8 * num_docs].view(np.int64)
        if self.document_indices[0] != 0 or self.document_indices[-1] != num_seqs:
            raise IndexedDatasetError(
                f"{idx_path}: document indices run from {self.document_indices[0]} to "
                f"{self.document_indices[-1]}, expected 0 to the sequence count {num_seqs}"
            )
        bin_size = os.path.getsize(bin_path)
        want = 0
        if num_seqs:
            want = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * (
                self.dtype.itemsize
            )
        if bin_size != want:
            raise IndexedDatasetError(
                f"{bin_path}: {bin_size} bytes, but its index {idx_path} describes {want} "
                f"({num_seqs} sequences of {self.dtype}); the .bin is truncated or the pair "
                "comes from different runs"
            )
        self._bin_map = None
        if bin_size:
            with open(bin_path, "rb") as f:
                self._bin_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (a read-only view)."""
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence {i} of {size}")
        if length == 0:
            return np.empty(0, dtype=self.dtype)
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(int(i))

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()


class IndexedDatasetBuilder:
    """Writes ``prefix.bin`` / ``prefix.idx`` with O(1) memory, under temporary names.

    Call ``add_item`` (one sequence) then ``end_document`` as Megatron's builder does, or
    ``add_documents`` for many one-sequence documents at once; ``finalize()`` writes the complete
    index under its temporary name and ``commit()`` renames both files into place (removing an old
    ``prefix.idx`` first, renaming ``.bin`` then ``.idx``, so no crash leaves a mismatched pair that
    looks valid). ``abort()`` removes everything written. Used as a context manager it commits on
    success and aborts on an exception.
    """

    def __init__(self, prefix: str, *, dtype: np.dtype | type = np.int32):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        tag = f".tmp-{os.getpid()}-{id(self):x}"
        self._bin_tmp = self.prefix + ".bin" + tag
        self._idx_tmp = self.prefix + ".idx" + tag
        self._sizes_tmp = self.prefix + ".sizes" + tag
        self._docs_tmp = self.prefix + ".docs" + tag
        self._bin = open(self._bin_tmp, "wb")
        self._sizes = open(self._sizes_tmp, "wb")
        self._docs = open(self._docs_tmp, "wb")
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0
        self._finalized = False

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence (any integer array-like; checked to fit the dtype)."""
        arr = self._as_dtype(tokens)
        self._bin.write(arr.tobytes())
        self._sizes.write(np.int32(arr.size).tobytes())
        self.num_sequences += 1
        self.num_tokens += int(arr.size)

    def end_document(self) -> None:
        self._docs.write(np.int64(self.num_sequences).tobytes())
        self.num_documents += 1

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        self.add_item(tokens)
        self.end_document()

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` one-sequence documents; ``tokens`` holds them concatenated."""
        arr = self._as_dtype(tokens)
        lengths = np.asarray(lengths, dtype=np.int32)
        if int(lengths.sum(dtype=np.int64)) != arr.size:
            raise ValueError(
                f"lengths sum to {int(lengths.sum())} but {arr.size} tokens were given"
            )
        self._bin.write(arr.tobytes())
        self._sizes.write(lengths.tobytes())
        ends = self.num_sequences + np.arange(1, lengths.size + 1, dtype=np.int64)
        self._docs.write(ends.tobytes())
        self.num_sequences += int(lengths.size)
        self.num_documents += int(lengths.size)
        self.num_tokens += int(arr.size)

    def add_index(self, prefix: str) -> None:
        """Append every sequence and document of the dataset at ``prefix`` (same dtype)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{prefix}.idx holds {other.dtype} tokens but the output is {self.dtype}; "
                "merge only datasets tokenised with the same vocabulary size"
            )
        with open(prefix + ".bin", "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)
        for start in range(0, len(other), _CHUNK):
            self._sizes.write(np.asarray(other.sequence_lengths[start : start + _CHUNK]).tobytes())
        docs = other.document_indices
        for start in range(1, docs.shape[0], _CHUNK):
            chunk = np.asarray(docs[start : start + _CHUNK], dtype=np.int64) + self.num_sequences
            self._docs.write(chunk.tobytes())
        self.num_sequences += len(other)
        self.num_documents += other.num_documents
        self.num_tokens += other.num_tokens

    def finalize(self) -> None:
        """Close ``.bin`` and write the whole index under its temporary name (not yet visible)."""
        for f in (self._bin, self._sizes, self._docs):
            f.close()
        with open(self._idx_tmp, "wb") as out:
            out.write(MAGIC)
            out.write(struct.pack("<Q", VERSION))
            out.write(struct.pack("<B", self._code))
            out.write(struct.pack("<QQ", self.num_sequences, self.num_documents + 1))
            with open(self._sizes_tmp, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
            running = 0  # byte offset of the next sequence in .bin
            for sizes in _read_chunks(self._sizes_tmp, np.int32):
                ptr = np.cumsum(sizes, dtype=np.int64) * self.dtype.itemsize
                starts = np.empty_like(ptr)
                starts[0] = running
                starts[1:] = running + ptr[:-1]
                out.write(starts.tobytes())
                running += int(ptr[-1])
            out.write(np.int64(0).tobytes())  # document indices start with 0
            with open(self._docs_tmp, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
        for path in (self._sizes_tmp, self._docs_tmp):
            os.remove(path)
        self._finalized = True

    def commit(self) -> None:
        """Move the finished pair into place: drop an old ``.idx``, move ``.bin``, then ``.idx``."""
        if not self._finalized:
            self.finalize()
        if os.path.exists(self.prefix + ".idx"):
            os.remove(self.prefix + ".idx")
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(self._idx_tmp, self.prefix + ".idx")

    def abort(self) -> None:
        """Close and remove every temporary file (safe to call more than once)."""
        for f in (self._bin, self._sizes, self._docs):
            f.close()
        for path in (self._bin_tmp, self._idx_tmp, self._sizes_tmp, self._docs_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def _as_dtype(self, tokens: Iterable[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            if arr.size and np.issubdtype(self.dtype, np.integer):
                info = np.iinfo(self.dtype)
                lo, hi = int(arr.min()), int(arr.max())
                if lo < info.min or hi > info.max:
                    raise IndexedDatasetError(
                        f"token ids span [{lo}, {hi}], outside {self.dtype} [{info.min}, "
                        f"{info.max}] of {self.prefix}; build it with a wider dtype"
                    )
            arr = arr.astype(self.dtype)
        return np.ascontiguousarray(arr.reshape(-1))


def merge_datasets(prefixes: list[str], output_prefix: str) -> IndexedDataset:
    """Concatenate the datasets at ``prefixes`` (in order) into ``output_prefix`` atomically."""
    if not prefixes:
        raise IndexedDatasetError("nothing to merge: no input dataset prefixes")
    dtype = IndexedDataset(prefixes[0]).dtype
    builder = IndexedDatasetBuilder(output_prefix, dtype=dtype)
    with builder:
        for p in prefixes:
            builder.add_index(p)
    return IndexedDataset(output_prefix)


def _read_chunks(path: str, dtype: type) -> Iterable[np.ndarray]:
    itemsize = np.dtype(dtype).itemsize
    with open(path, "rb") as f:
        while True:
            buf = f.read(_CHUNK * itemsize)
            if not buf:
                return
            yield np.frombuffer(buf, dtype=dtype)
