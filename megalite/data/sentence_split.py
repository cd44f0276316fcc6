"""``tools/preprocess_data.py --split-sentences``: NLTK's punkt sentence splitter, as Megatron-LM
uses it (``--lang``, default english; ``--keep-newlines`` keeps the whitespace after a sentence
with the sentence, so newlines between sentences survive in the tokens).

NLTK and its punkt model are optional and never downloaded here: without them the run stops with
one line saying how to install them. There is no other splitter: a regex "fallback" would give
other sentences than Megatron's, and other files.

    splitter = PunktSplitter("english")
    splitter("One. Two.")   # -> ["One.", "Two."]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megalite.errors import UserError

INSTALL = (
    "pip install nltk, then fetch its punkt model once: python -m nltk.downloader punkt_tab "
    "(or set NLTK_DATA to a folder holding tokenizers/punkt_tab)"
)


class SentenceSplitError(UserError, ValueError):
    """NLTK or its punkt model is missing; the message says how to install them."""


@dataclass(frozen=True)
class PunktSplitter:
    """Picklable (the preprocessing workers build their own): text -> its sentences."""

    lang: str = "english"
    keep_newlines: bool = False

    def __call__(self, text: str) -> list[str]:
        return list(_punkt(self.lang, self.keep_newlines).tokenize(text))

    def check(self) -> None:
        """Load the model now (one line naming the fix when it cannot be)."""
        _punkt(self.lang, self.keep_newlines)


@functools.cache
def _punkt(lang: str, keep_newlines: bool):
    try:
        import nltk
        from nltk.tokenize import punkt
    except ImportError:
        raise SentenceSplitError(
            f"--split-sentences needs NLTK, which is not installed; {INSTALL}"
        ) from None
    try:  # NLTK >= 3.9: the punkt_tab model
        tokenizer = nltk.tokenize.PunktTokenizer(lang)
    except (AttributeError, LookupError, OSError, ValueError):
        try:  # older NLTK: the pickled punkt model
            tokenizer = nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
        except (LookupError, OSError, ValueError):
            raise SentenceSplitError(
                f"--split-sentences --lang {lang}: NLTK's punkt model for {lang} is not "
                f"installed; {INSTALL}"
            ) from None
    if not keep_newlines:
        return tokenizer
    return punkt.PunktSentenceTokenizer(
        train_text=tokenizer._params, lang_vars=_keep_newline_vars(punkt)()
    )


def _keep_newline_vars(punkt):
    """Punkt's language variables with the whitespace after a sentence end kept in the sentence
    (zero or more spaces before the next token, where punkt wants one or more and drops them)."""

    class KeepNewlines(punkt.PunktLanguageVars):
        _period_context_fmt = r"""
            \S*                          # a word's characters
            %(SentEndChars)s             # a possible sentence end
            \s*                          # any whitespace, newlines included, stays here
            (?=(?P<after_tok>
                %(NonWord)s              # punctuation follows
                |
                (?P<next_tok>\S+)        # or the next token, right after the whitespace
            ))"""

    return KeepNewlines
