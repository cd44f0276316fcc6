"""Byte-level BPE, the two published merge rules: GPT-2's (ranked pairs of symbols, from a
``merges.txt``) and tiktoken's (ranked byte strings, from a rank file).

Text is first cut into pieces by a regular expression (``GPT2_PATTERN`` or a tiktoken pattern, which
need the ``regex`` package for ``\\p{L}``-style classes); each piece's UTF-8 bytes are then merged:

* ``merge_symbol_pairs`` (GPT-2): the piece is a list of one-character symbols (each byte through
  ``byte_to_unicode``); repeatedly take the adjacent pair with the lowest merge rank and join every
  occurrence of it, left to right, until no adjacent pair has a rank.
* ``merge_byte_pairs`` (tiktoken): the piece is a list of single bytes; repeatedly join the leftmost
  adjacent pair whose concatenation has the lowest rank, until no concatenation has one.
"""

from __future__ import annotations

# GPT-2's pre-tokenisation: contractions, optional-space letter runs, digit runs, other symbols,
# then whitespace (a run before a non-space keeps its last space for the next piece).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def compile_pattern(pattern: str, *, tokenizer_type: str):
    """``pattern`` compiled with the ``regex`` package (Python's ``re`` has no ``\\p{L}``)."""
    try:
        import regex
    except ImportError:
        raise ImportError(
            f"--tokenizer-type {tokenizer_type} needs the 'regex' package for its Unicode "
            "classes: pip install regex (transformers and tiktoken install it too)"
        ) from None
    return regex.compile(pattern)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map.

    The 188 bytes that print as themselves ('!'..'~', '¡'..'¬', '®'..'ÿ') keep their code point;
    the other 68 (controls, space, DEL, NBSP, soft hyphen) take chr(256), chr(257), ... in byte
    order, so a space is 'Ġ' and a newline 'Ċ'.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def merge_symbol_pairs(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """GPT-2's rule: join every occurrence of the lowest-ranked adjacent pair until none ranks."""
    while len(symbols) > 1:
        best, best_rank = None, None
        for pair in zip(symbols, symbols[1:]):
            rank = ranks.get(pair)
            if rank is not None and (best_rank is None or rank < best_rank):
                best, best_rank = pair, rank
        if best is None:
            break
        first, second = best
        merged: list[str] = []
        i = 0
        while i < len(symbols):
            if i + 1 < len(symbols) and symbols[i] == first and symbols[i + 1] == second:
                merged.append(first + second)
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return symbols


def merge_byte_pairs(piece: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """tiktoken's rule: join the leftmost lowest-ranked adjacent concatenation until none ranks."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_i, best_rank = -1, None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_i, best_rank = i, rank
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts
