"""jsonl -> Megatron indexed datasets, the work behind ``tools/preprocess_data.py``.

The input (``.jsonl``, ``.json`` lines or ``.jsonl.gz``) is read in chunks of lines; chunks are
tokenised in ``workers`` processes (in the main process when workers == 1; ``ChunkWorkers``: one
chunk per worker in flight, the workers killed on any exit), and written in input order, so memory
stays bounded whatever the input size and any worker count gives the same bytes. For each JSON key
the output is ``{output_prefix}_{key}_document.bin/.idx``: one sequence per document, dtype uint16
when the vocabulary is under 65,500 ids, else int32. Files are written under temporary names and
renamed only when everything succeeded.

``sentence_splitter`` (``--split-sentences``, ``sentence_split.PunktSplitter``): each document's
text is split into sentences, each sentence is one sequence of its document (empty ones dropped;
the eod, with ``append_eod``, ends the last), and the output is
``{output_prefix}_{key}_sentence.bin/.idx``, as Megatron writes it.

Bad input: a line that is not JSON, not an object, lacks a key, has a non-string value or fails to
tokenise is an error naming the file and line (PreprocessError), or, with ``skip_bad_lines``, is
skipped whole and counted. Blank lines are skipped and counted; a document with no tokens (before
the eod) is skipped and counted per key.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from megalite.data.chunk_workers import ChunkWorkers
from megalite.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from megalite.data.tokenizer_base import Tokenizer
from megalite.errors import UserError, check_writable_dir, path_problem, read_error

logger = logging.getLogger(__name__)


class PreprocessError(UserError, ValueError):
    """Bad input or arguments; the message names the file (and line) and the fix."""


@dataclass
class PreprocessStats:
    lines: int = 0
    bytes_read: int = 0
    blank_lines: int = 0
    bad_lines: int = 0
    documents: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    empty_documents: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    outputs: dict[str, str] = field(default_factory=dict)  # key -> output prefix


@dataclass
class _ChunkResult:
    lines: int
    bytes_read: int
    blank_lines: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)
    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    lengths: dict[str, np.ndarray] = field(default_factory=dict)
    empty: dict[str, int] = field(default_factory=dict)
    sentences: dict[str, np.ndarray] = field(default_factory=dict)  # per document (splitting)


def output_prefix_for(output_prefix: str, key: str, level: str = "document") -> str:
    """Megatron's naming: ``{output_prefix}_{key}_{level}``, level ``document`` or
    ``sentence`` (``--split-sentences``)."""
    return f"{output_prefix}_{key}_{level}"


def _open_input(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _read_chunks(
    path: str, chunk_lines: int, chunk_bytes: int
) -> Iterator[tuple[int, list[bytes]]]:
    """(1-based number of the first line, lines) chunks, each at most chunk_lines / ~chunk_bytes.
    A truncated or corrupt input is a UserError naming the file and the last line read."""
    number = 0
    try:
        with _open_input(path) as f:
            lines: list[bytes] = []
            first, size = 1, 0
            for number, line in enumerate(f, start=1):
                lines.append(line)
                size += len(line)
                if len(lines) >= chunk_lines or size >= chunk_bytes:
                    yield first, lines
                    lines, first, size = [], number + 1, 0
            if lines:
                yield first, lines
    except (EOFError, OSError, zlib.error) as e:
        raise read_error(path, e, line=number) from None


def _tokenize_in_worker(state: tuple, chunk: tuple) -> _ChunkResult:
    tokenizer, task = state
    first_line, lines = chunk
    return tokenize_chunk(tokenizer, first_line, lines, **task)


def tokenize_chunk(
    tokenizer: Tokenizer,
    first_line: int,
    lines: list[bytes],
    *,
    json_keys: list[str],
    append_eod: bool,
    skip_bad_lines: bool,
    dtype: str,
    sentence_splitter=None,
) -> _ChunkResult:
    """Parse and tokenise one chunk; stops at the first bad line unless ``skip_bad_lines``.
    With ``sentence_splitter`` each document's sequences are its sentences."""
    out = _ChunkResult(lines=len(lines), bytes_read=sum(len(x) for x in lines))
    texts: dict[str, list[str]] = {k: [] for k in json_keys}
    numbers: list[int] = []
    for number, raw in enumerate(lines, start=first_line):
        if not raw.strip():
            out.blank_lines += 1
            continue
        problem = None
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as e:
            problem = f"malformed JSON ({e.msg} at character {e.pos + 1})"
        except ValueError as e:  # UnicodeDecodeError
            problem = f"malformed JSON ({e})"
        else:
            if not isinstance(doc, dict):
                problem = f"expected a JSON object, got {type(doc).__name__}"
            else:
                for k in json_keys:
                    if k not in doc:
                        problem = f"missing key {k!r} (keys present: {sorted(doc)[:8]})"
                        break
                    if not isinstance(doc[k], str):
                        problem = f"key {k!r} holds {type(doc[k]).__name__}, expected a string"
                        break
        if problem is not None:
            out.bad.append((number, problem))
            if not skip_bad_lines:
                return out
            continue
        numbers.append(number)
        for k in json_keys:
            texts[k].append(doc[k])
    if sentence_splitter is not None:
        return _sentences_chunk(
            tokenizer,
            texts,
            numbers,
            out,
            splitter=sentence_splitter,
            append_eod=append_eod,
            skip_bad_lines=skip_bad_lines,
            dtype=dtype,
        )
    ids = {k: _tokenize_all(tokenizer, texts[k], numbers, out) for k in json_keys}
    if out.bad and not skip_bad_lines:
        return out
    bad_numbers = {n for n, _ in out.bad}
    for k in json_keys:
        docs = [d for d, n in zip(ids[k], numbers) if n not in bad_numbers]
        kept = [d for d in docs if len(d)]
        out.empty[k] = len(docs) - len(kept)
        lengths = np.fromiter((len(d) for d in kept), np.int64, len(kept))
        flat = np.fromiter(chain.from_iterable(kept), np.int64, int(lengths.sum()))
        if append_eod:
            lengths += 1
            eods = np.cumsum(lengths) - 1  # where each document's eod goes
            with_eod = np.full(int(lengths.sum()), tokenizer.eod, dtype=np.int64)
            keep = np.ones(with_eod.size, dtype=bool)
            keep[eods] = False
            with_eod[keep] = flat
            flat = with_eod
        out.tokens[k] = flat.astype(dtype)
        out.lengths[k] = lengths.astype(np.int32)
    return out


def _sentences_chunk(
    tokenizer: Tokenizer,
    texts: dict[str, list[str]],
    numbers: list[int],
    out: _ChunkResult,
    *,
    splitter,
    append_eod: bool,
    skip_bad_lines: bool,
    dtype: str,
) -> _ChunkResult:
    """``tokenize_chunk`` for ``--split-sentences``: one sequence per non-empty sentence."""
    for k, docs in texts.items():
        per_doc = [splitter(text) for text in docs]
        flat = [sentence for sentences in per_doc for sentence in sentences]
        ids = _tokenize_all(
            tokenizer, flat, [n for n, ss in zip(numbers, per_doc) for _ in ss], out
        )
        if out.bad and not skip_bad_lines:
            return out
        bad = {n for n, _ in out.bad}
        tokens, lengths, counts, at = [], [], [], 0
        out.empty[k] = 0
        for number, sentences in zip(numbers, per_doc):
            doc = [ids[at + i] for i in range(len(sentences)) if len(ids[at + i])]
            at += len(sentences)
            if number in bad:
                continue
            if not doc:
                out.empty[k] += 1
                continue
            if append_eod:
                doc[-1] = [*doc[-1], tokenizer.eod]
            tokens.extend(chain.from_iterable(doc))
            lengths.extend(len(x) for x in doc)
            counts.append(len(doc))
        out.tokens[k] = np.asarray(tokens, dtype=np.int64).astype(dtype)
        out.lengths[k] = np.asarray(lengths, dtype=np.int32)
        out.sentences[k] = np.asarray(counts, dtype=np.int64)
    return out


def _tokenize_all(
    tokenizer: Tokenizer, texts: list[str], numbers: list[int], out: _ChunkResult
) -> list[list[int]]:
    """Batch tokenisation; on failure, line by line to name the bad line(s)."""
    try:
        return [list(x) for x in tokenizer.tokenize_batch(texts)]
    except Exception:  # noqa: BLE001 - find the line to report
        pass
    result = []
    for text, number in zip(texts, numbers):
        try:
            result.append(list(tokenizer.tokenize(text)))
        except Exception as e:  # noqa: BLE001 - reported with the line number
            out.bad.append((number, f"cannot tokenise ({e})"))
            result.append([])
    return result


def preprocess_jsonl(
    input_path: str,
    output_prefix: str,
    tokenizer: Tokenizer,
    *,
    json_keys: list[str] | tuple[str, ...] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 1000,
    skip_bad_lines: bool = False,
    chunk_lines: int = 512,
    chunk_bytes: int = 4 << 20,
    sentence_splitter=None,
) -> PreprocessStats:
    """Tokenise ``input_path`` into one indexed dataset per JSON key; see the module docstring.
    ``sentence_splitter`` (picklable when ``workers`` > 1): ``--split-sentences``."""
    if not os.path.isfile(input_path):
        raise PreprocessError(f"--input {input_path}: no such file")
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    if log_interval < 1:
        raise PreprocessError(f"--log-interval must be >= 1 documents, got {log_interval}")
    json_keys = list(json_keys)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    check_writable_dir(out_dir, flag="--output-prefix", what="tokenised dataset")
    dtype = optimal_dtype(tokenizer.vocab_size)
    stats = PreprocessStats()
    builders: dict[str, IndexedDatasetBuilder] = {}
    start = time.perf_counter()
    next_log = log_interval
    try:
        for k in json_keys:
            level = "document" if sentence_splitter is None else "sentence"
            stats.outputs[k] = output_prefix_for(output_prefix, k, level)
            builders[k] = IndexedDatasetBuilder(stats.outputs[k], dtype=dtype)
            stats.documents[k] = stats.tokens[k] = stats.empty_documents[k] = 0
        task = dict(
            json_keys=json_keys,
            append_eod=append_eod,
            skip_bad_lines=skip_bad_lines,
            dtype=dtype.str,
            sentence_splitter=sentence_splitter,
        )
        chunks = _read_chunks(input_path, chunk_lines, chunk_bytes)

        def handle(result: _ChunkResult) -> None:
            nonlocal next_log
            _absorb(result, stats, builders, input_path, skip_bad_lines)
            docs = stats.documents[json_keys[0]]
            if docs >= next_log:
                next_log = (docs // log_interval + 1) * log_interval
                _log_progress(stats, docs, time.perf_counter() - start)

        if workers == 1:
            for first, lines in chunks:
                handle(tokenize_chunk(tokenizer, first, lines, **task))
        else:  # any exit of the with kills the workers: nothing waits on them
            with ChunkWorkers(workers, _tokenize_in_worker, (tokenizer, task)) as pool:
                for result in pool.map(chunks):
                    handle(result)
        for b in builders.values():
            b.finalize()
        for b in builders.values():
            b.commit()
    except BaseException as e:
        for b in builders.values():
            b.abort()
        if isinstance(e, OSError):  # writing the outputs (reading errors are UserErrors already)
            raise UserError(
                f"--output-prefix {output_prefix}: cannot write the dataset ({path_problem(e)} in "
                f"{out_dir}); nothing was kept; free space or choose another folder"
            ) from None
        raise
    stats.elapsed_s = time.perf_counter() - start
    _log_summary(stats)
    return stats


def _absorb(
    result: _ChunkResult,
    stats: PreprocessStats,
    builders: dict[str, IndexedDatasetBuilder],
    input_path: str,
    skip_bad_lines: bool,
) -> None:
    if result.bad and not skip_bad_lines:
        number, problem = result.bad[0]
        raise PreprocessError(
            f"{input_path}:{number}: {problem}; fix the line or pass --skip-bad-lines to skip "
            "such lines"
        )
    stats.lines += result.lines
    stats.bytes_read += result.bytes_read
    stats.blank_lines += result.blank_lines
    stats.bad_lines += len(result.bad)
    for number, problem in result.bad[:3]:
        logger.warning("skipping %s:%d: %s", input_path, number, problem)
    for k, b in builders.items():
        if k in result.sentences:  # --split-sentences: documents of several sequences
            _add_sentence_documents(b, result.tokens[k], result.lengths[k], result.sentences[k])
            stats.documents[k] += int(result.sentences[k].size)
            stats.tokens[k] += int(result.tokens[k].size)
            stats.empty_documents[k] += result.empty[k]
            continue
        b.add_documents(result.tokens[k], result.lengths[k])
        stats.documents[k] += int(result.lengths[k].size)
        stats.tokens[k] += int(result.tokens[k].size)
        stats.empty_documents[k] += result.empty[k]


def _add_sentence_documents(
    builder: IndexedDatasetBuilder, tokens: np.ndarray, lengths: np.ndarray, counts: np.ndarray
) -> None:
    ends = np.cumsum(lengths)
    seq = 0
    for count in counts:
        for _ in range(int(count)):
            builder.add_item(tokens[ends[seq] - lengths[seq] : ends[seq]])
            seq += 1
        builder.end_document()


def _log_progress(stats: PreprocessStats, docs: int, elapsed: float) -> None:
    logger.info(
        "processed %d documents (%.1f docs/s, %.2f MB/s), elapsed %.1f s",
        docs,
        docs / max(elapsed, 1e-9),
        stats.bytes_read / 1e6 / max(elapsed, 1e-9),
        elapsed,
    )


def _log_summary(stats: PreprocessStats) -> None:
    t = max(stats.elapsed_s, 1e-9)
    for k, prefix in stats.outputs.items():
        logger.info(
            "wrote %s.bin/.idx: %d documents, %d tokens (%d empty documents skipped)",
            prefix,
            stats.documents[k],
            stats.tokens[k],
            stats.empty_documents[k],
        )
    first = next(iter(stats.documents.values()), 0)
    logger.info(
        "done: %d lines (%d blank, %d bad skipped), %.1f MB in %.1f s: %.1f docs/s, %.2f MB/s",
        stats.lines,
        stats.blank_lines,
        stats.bad_lines,
        stats.bytes_read / 1e6,
        t,
        first / t,
        stats.bytes_read / 1e6 / t,
    )
