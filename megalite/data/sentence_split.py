"""``tools/preprocess_data.py --split-sentences``: NLTK's punkt sentence splitter, as Megatron-LM
uses it (``--lang``, default english; ``--keep-newlines`` keeps the whitespace after a sentence
with the sentence, so newlines between sentences survive in the tokens).

NLTK is optional and nothing is downloaded here (Megatron's tool fetches punkt at run time):
without NLTK the run stops with one line saying how to install it. With NLTK but without its
trained punkt model for ``--lang``, the splitter is NLTK's ``PunktSentenceTokenizer()`` with its
default, untrained parameters (it still splits at ". ", "? ", "! " before a new sentence, but
knows no abbreviations: "Dr. Smith" becomes two sentences where the trained english model keeps
one), said in one warning line; the files then differ from Megatron's wherever that matters.

    splitter = PunktSplitter("english")
    splitter("One. Two.")   # -> ["One.", "Two."]
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from megalite.errors import UserError

logger = logging.getLogger(__name__)

INSTALL_MODEL = (
    "python -m nltk.downloader punkt_tab (or set NLTK_DATA to a folder holding "
    "tokenizers/punkt_tab)"
)
INSTALL = f"pip install nltk, then fetch its punkt model once: {INSTALL_MODEL}"


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
        """Load the model now: one error line naming the fix without NLTK, one warning line
        when the trained punkt model is absent (module doc)."""
        _punkt(self.lang, self.keep_newlines)
        if not _trained(self.lang):
            logger.warning(
                "--split-sentences --lang %s: NLTK's trained punkt model for %s is not installed "
                "(nothing is downloaded here): splitting with an untrained "
                "PunktSentenceTokenizer(), which knows no abbreviations, so sentences may differ "
                "from Megatron's; to match them: %s",
                self.lang,
                self.lang,
                INSTALL_MODEL,
            )


def _trained(lang: str) -> bool:
    """Whether NLTK's trained punkt model for ``lang`` is installed (else: the untrained one)."""
    return _model(lang)[1]


@functools.cache
def _model(lang: str):
    """(NLTK's punkt tokenizer for ``lang``, whether it is the trained model)."""
    try:
        import nltk
        from nltk.tokenize import punkt
    except ImportError:
        raise SentenceSplitError(
            f"--split-sentences needs NLTK, which is not installed; {INSTALL}"
        ) from None
    try:  # NLTK >= 3.9: the punkt_tab model
        return nltk.tokenize.PunktTokenizer(lang), True
    except (AttributeError, LookupError, OSError, ValueError):
        pass
    try:  # older NLTK: the pickled punkt model
        return nltk.data.load(f"tokenizers/punkt/{lang}.pickle"), True
    except (LookupError, OSError, ValueError):
        return punkt.PunktSentenceTokenizer(), False  # untrained: default PunktParameters()


@functools.cache
def _punkt(lang: str, keep_newlines: bool):
    tokenizer = _model(lang)[0]
    if not keep_newlines:
        return tokenizer
    from nltk.tokenize import punkt

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
