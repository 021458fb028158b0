"""Sentence splitting for `scripts/preprocess_data.py --split-sentences` (BERT and T5 data).

Megatron splits with NLTK's trained punkt model for --lang. That model is data that NLTK downloads separately
(`python -m nltk.downloader punkt_tab`), so it may be absent on an offline machine. `--sentence-splitter`:
  * punkt (default): the trained model; when its data is missing, one error line naming the download and the
    other choice. Not a silent fallback: the sentence boundaries decide the samples, and data made with other
    boundaries than Megatron's should be a decision, not an accident of what is installed.
  * rules: NLTK's Punkt algorithm with no trained parameters: it splits after . ! ? followed by space where the next
    word could start a sentence, but knows no abbreviations ("Dr. Smith" becomes two sentences). Needs no download.
    The log says which splitter ran, and the .stats.json records it.
"""
from __future__ import annotations

from typing import Callable

SPLITTERS = ("punkt", "rules")


def _punkt_language_data(lang: str):
    """The trained punkt parameters for `lang` (punkt_tab, NLTK >= 3.9), or None when not installed."""
    import nltk

    for resource in ("tokenizers/punkt_tab", "tokenizers/punkt"):
        try:
            nltk.data.find(f"{resource}/{lang}/" if resource.endswith("tab") else f"{resource}/{lang}.pickle")
            return resource
        except LookupError:
            continue
    return None


def build_splitter(kind: str = "punkt", lang: str = "english") -> tuple[Callable[[str], list[str]], str]:
    """(text -> sentences, a description for the log and stats)."""
    try:
        import nltk  # noqa: F401
        from nltk.tokenize.punkt import PunktSentenceTokenizer
    except ImportError:
        raise ImportError("--split-sentences needs NLTK: pip install nltk") from None
    if kind not in SPLITTERS:
        raise ValueError(f"--sentence-splitter={kind!r}: expected one of {', '.join(SPLITTERS)}")
    if kind == "rules":
        return PunktSentenceTokenizer().tokenize, "rules (NLTK Punkt, untrained: no abbreviation list)"
    found = _punkt_language_data(lang)
    if found is None:
        raise ValueError(f"--split-sentences: NLTK's punkt data for --lang={lang} is not installed; run `python -m "
                         "nltk.downloader punkt_tab` (as Megatron needs), or pass --sentence-splitter rules for the "
                         "untrained splitter (no abbreviation list)")
    if found.endswith("tab"):
        from nltk.tokenize.punkt import PunktTokenizer

        return PunktTokenizer(lang).tokenize, f"punkt ({lang}, {found})"
    import nltk

    return nltk.data.load(f"{found}/{lang}.pickle").tokenize, f"punkt ({lang}, {found})"
