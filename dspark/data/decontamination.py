"""Keep evaluation prompts out of training data: word n-gram overlap (the usual benchmark-contamination
check, e.g. 13-grams in the GPT-3 / Llama reports; shorter n for short prompts).

A training prompt is contaminated iff it shares at least one word n-gram with any evaluation prompt,
or (for prompts shorter than n words) its whole normalised text occurs in one. Normalisation:
lower-case, every run of non-alphanumeric characters becomes one space. N-grams found in
`template_min_docs` or more evaluation prompts are instructions shared by a whole benchmark
("Please reason step by step, and put your final answer within \boxed{}"), not content: they are
ignored, or every math prompt with the same instruction would count as contaminated.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Sequence

_NON_WORD = re.compile(r"[^0-9a-z]+")


def words(text: str) -> list[str]:
    return _NON_WORD.sub(" ", text.lower()).split()


def ngrams(tokens: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


class Decontaminator:
    """Index of the evaluation texts' content n-grams; `contaminated(text)` tests one training text."""

    def __init__(self, eval_texts: Iterable[str], n: int = 8, template_min_docs: int = 3):
        if n < 1:
            raise ValueError(f"n-gram size must be >= 1, got {n}")
        self.n = n
        texts = [words(t) for t in eval_texts]
        docs: Counter = Counter()
        for w in texts:
            docs.update(ngrams(w, n))
        self.template = {g for g, count in docs.items() if count >= template_min_docs}
        self.grams: set[tuple[str, ...]] = set()
        self.joined: list[str] = []
        for w in texts:
            for seg in self.segments(w):
                self.grams |= ngrams(seg, n)
                self.joined.append(" " + " ".join(seg) + " ")

    def segments(self, w: list[str]) -> list[list[str]]:
        """The runs of words not covered by any template n-gram (the text's own content)."""
        covered = [False] * len(w)
        for i in range(len(w) - self.n + 1):
            if tuple(w[i:i + self.n]) in self.template:
                covered[i:i + self.n] = [True] * self.n
        out, run = [], []
        for word, cov in zip(w, covered):
            if cov:
                if run:
                    out.append(run)
                run = []
            else:
                run.append(word)
        return out + ([run] if run else [])

    def contaminated(self, text: str) -> bool:
        for seg in self.segments(words(text)):
            if len(seg) < self.n:
                needle = " " + " ".join(seg) + " "
                if any(needle in hay for hay in self.joined):
                    return True
            elif not self.grams.isdisjoint(ngrams(seg, self.n)):
                return True
        return False

    def split(self, items: Sequence, text_of) -> tuple[list, list]:
        """(kept, dropped) items, `text_of(item)` giving the text to test."""
        kept, dropped = [], []
        for item in items:
            (dropped if self.contaminated(text_of(item)) else kept).append(item)
        return kept, dropped
