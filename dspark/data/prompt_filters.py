"""Quality filters for a prompt corpus (synthesized or read from a dataset). Pure Python, no Ray.

A prompt is a list of user turns; every filter looks at the turns joined by "\\n". The filters run in
a fixed order and the first one that rejects a prompt names the reason (see FILTER_ORDER):

- `length`:      too few/many characters or words (`min_chars`, `max_chars`, `min_words`);
- `degenerate`:  chat-template tokens leaking into the text (`<|im_start|>` ...), repetitive text (share
                 of repeated word n-grams), non-text (control characters, U+FFFD from broken byte
                 sequences, private-use or unassigned code points), or text that is mostly not letters;
- `contaminated`: shares a word n-gram (n = 13 by default) with any evaluation prompt, or equals a
                 short evaluation prompt (fewer than n words) after normalisation. Benchmark boilerplate
                 ("... please reason step by step, and put your final answer within \\boxed{}") is no
                 evidence: word k-grams (k = ceil(n/2)) found in more than `decontam_max_ngram_prompts`
                 evaluation prompts are boilerplate, and a shared n-gram counts only if at least k of its
                 words lie outside boilerplate (so a few content words next to a shared instruction do
                 not match, while a copied problem statement does);
- `duplicate`:   the normalised text (lower case, whitespace collapsed, punctuation dropped) hashes like an
                 earlier kept prompt;
- `near_duplicate`: MinHash (datasketch) of word shingles; LSH finds an earlier kept prompt whose
                 estimated Jaccard similarity is >= `near_dup_threshold`.
Dedup keeps the first occurrence, so the result depends on the input order: callers pass prompts in a
deterministic order (e.g. sorted by id) to get the same corpus on every run.
"""
from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from pydantic import Field, model_validator

from dspark.config import StrictModel

FILTER_ORDER = ("length", "degenerate", "contaminated", "duplicate", "near_duplicate")
TEMPLATE_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>",
                    "[INST]", "[/INST]", "<s>", "</s>", "<|eot_id|>", "<|start_header_id|>")
_WORD = re.compile(r"\w+", re.UNICODE)


class FilterConfig(StrictModel):
    min_chars: int = Field(16, ge=0, description="drop prompts shorter than this (characters, turns joined)")
    max_chars: int = Field(4000, ge=1, description="drop prompts longer than this (characters)")
    min_words: int = Field(3, ge=0, description="drop prompts with fewer words than this")
    repetition_ngram: int = Field(3, ge=1, description="word n-gram size of the repetition check")
    max_repeated_ngram_share: float = Field(
        0.35, ge=0, le=1, description="drop when more than this share of the word n-grams are repeats of earlier ones")
    max_nontext_share: float = Field(
        0.01, ge=0, le=1, description="drop when more than this share of the characters are control characters, "
                                      "U+FFFD or private-use/unassigned code points")
    min_alpha_share: float = Field(
        0.4, ge=0, le=1, description="drop when fewer than this share of the non-space characters are letters "
                                     "(LaTeX-heavy math and code-heavy prompts sit near 0.5)")
    drop_template_markers: bool = Field(True, description="drop prompts containing chat-template tokens")
    decontam_ngram: int = Field(13, ge=1, description="word n-gram size of the decontamination check")
    decontam_max_ngram_prompts: int = Field(
        3, ge=1, description="word k-grams (k = ceil(n/2)) in more evaluation prompts than this are boilerplate")
    exact_dedup: bool = Field(True, description="drop prompts whose normalised text was already kept")
    near_dedup: bool = Field(True, description="drop near duplicates (MinHash/LSH)")
    near_dup_threshold: float = Field(0.8, gt=0, le=1, description="estimated Jaccard similarity that counts as "
                                                                   "a near duplicate")
    near_dup_shingle: int = Field(3, ge=1, description="word shingle size of the MinHash")
    num_perm: int = Field(128, ge=16, description="MinHash permutations")

    @model_validator(mode="after")
    def _bounds(self) -> "FilterConfig":
        if self.min_chars > self.max_chars:
            raise ValueError(f"min_chars ({self.min_chars}) must be <= max_chars ({self.max_chars})")
        return self


# ---------------------------------------------------------------- text helpers
def words(text: str) -> list[str]:
    """Lower-cased word tokens of the NFKC text (letters/digits/underscore runs)."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


def normalised_key(text: str) -> str:
    """Hash of the word sequence: case, whitespace and punctuation differences collapse."""
    return hashlib.sha1(" ".join(words(text)).encode("utf-8")).hexdigest()


def ngrams(tokens: Sequence[str], n: int) -> Iterable[tuple[str, ...]]:
    return (tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def repeated_ngram_share(tokens: Sequence[str], n: int) -> float:
    """Share of word n-grams that repeat an earlier one (0 = all distinct, -> 1 = one n-gram looped)."""
    grams = list(ngrams(tokens, n))
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def alpha_share(text: str) -> float:
    """Share of letters among the non-whitespace characters (1.0 for an empty text)."""
    chars = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in chars) / len(chars) if chars else 1.0


NONTEXT_CATEGORIES = {"Cc", "Co", "Cn", "Cs"}


def nontext_share(text: str) -> float:
    """Share of characters that are not text: controls other than tab/newline, U+FFFD (a decoder's
    replacement for broken bytes), private-use, unassigned and surrogate code points."""
    if not text:
        return 0.0
    bad = sum(c == "\ufffd" or (c not in "\t\n\r" and unicodedata.category(c) in NONTEXT_CATEGORIES) for c in text)
    return bad / len(text)


def prompt_text(turns: Sequence[str]) -> str:
    return "\n".join(turns)


# ---------------------------------------------------------------- single-prompt checks
def length_reason(text: str, cfg: FilterConfig) -> str | None:
    n_words = len(words(text))
    if len(text) < cfg.min_chars:
        return f"{len(text)} characters < min_chars {cfg.min_chars}"
    if len(text) > cfg.max_chars:
        return f"{len(text)} characters > max_chars {cfg.max_chars}"
    if n_words < cfg.min_words:
        return f"{n_words} words < min_words {cfg.min_words}"
    return None


def degenerate_reason(text: str, cfg: FilterConfig) -> str | None:
    if cfg.drop_template_markers:
        marker = next((m for m in TEMPLATE_MARKERS if m in text), None)
        if marker:
            return f"contains the chat-template token {marker!r}"
    share = repeated_ngram_share(words(text), cfg.repetition_ngram)
    if share > cfg.max_repeated_ngram_share:
        return f"{share:.2f} of the word {cfg.repetition_ngram}-grams repeat (> {cfg.max_repeated_ngram_share})"
    odd = nontext_share(text)
    if odd > cfg.max_nontext_share:
        return f"{odd:.2f} of the characters are not text (controls, U+FFFD, unassigned; > {cfg.max_nontext_share})"
    letters = alpha_share(text)
    if letters < cfg.min_alpha_share:
        return f"only {letters:.2f} of the characters are letters (< {cfg.min_alpha_share})"
    return None


# ---------------------------------------------------------------- decontamination
@dataclass
class EvalIndex:
    """Word n-grams of every evaluation prompt, and the whole word sequence of prompts shorter than n."""

    n: int
    max_prompts_per_gram: int = 3
    grams: dict[tuple[str, ...], str] = field(default_factory=dict)  # n-gram -> "file:line" of its first use
    half_prompts: Counter = field(default_factory=Counter)  # k-gram -> evaluation prompts containing it
    short: dict[str, str] = field(default_factory=dict)  # normalised_key -> "file:line"
    prompts: int = 0

    def add(self, text: str, where: str) -> None:
        tokens = words(text)
        self.prompts += 1
        if len(tokens) < self.n:
            self.short.setdefault(normalised_key(text), where)
        for gram in set(ngrams(tokens, self.n)):
            self.grams.setdefault(gram, where)
        self.half_prompts.update(set(ngrams(tokens, self.k)))

    @property
    def k(self) -> int:
        return -(-self.n // 2)

    def _boilerplate_mask(self, tokens: list[str]) -> list[bool]:
        """mask[i] is True when word i lies inside a k-gram shared by many evaluation prompts."""
        mask = [False] * len(tokens)
        for i, gram in enumerate(ngrams(tokens, self.k)):
            if self.half_prompts[gram] > self.max_prompts_per_gram:
                mask[i:i + self.k] = [True] * self.k
        return mask

    def match(self, text: str) -> str | None:
        """-> a description of the first overlap with an evaluation prompt, or None."""
        hit = self.short.get(normalised_key(text))
        if hit:
            return f"equals the evaluation prompt at {hit}"
        tokens = words(text)
        mask = self._boilerplate_mask(tokens)
        for i, gram in enumerate(ngrams(tokens, self.n)):
            # invariant: a counted match has >= k words of specific (non-boilerplate) text
            if gram in self.grams and self.n - sum(mask[i:i + self.n]) >= self.k:
                return f"shares the {self.n}-gram {' '.join(gram)!r} with the evaluation prompt at {self.grams[gram]}"
        return None


def eval_turns_of_line(line: str) -> list[str]:
    """The user text of one evaluation JSONL record: `turns`, `messages`/`conversations` user turns or
    `prompt`/`question`/`instruction`. Unknown records give [] (the caller reports them)."""
    record = json.loads(line)
    if not isinstance(record, dict):
        return []
    if isinstance(record.get("turns"), list):
        return [t for t in record["turns"] if isinstance(t, str)]
    for key, role_key, text_key in (("messages", "role", "content"), ("conversations", "from", "value")):
        if isinstance(record.get(key), list):
            return [m.get(text_key) for m in record[key] if isinstance(m, dict)
                    and m.get(role_key) in ("user", "human") and isinstance(m.get(text_key), str)]
    return [record[k] for k in ("prompt", "question", "instruction") if isinstance(record.get(k), str)][:1]


def build_eval_index(files: dict[str, str], n: int, max_prompts_per_gram: int = 3) -> EvalIndex:
    """files: name -> JSONL text. Raises ValueError naming the file and line of a record it cannot use."""
    index = EvalIndex(n, max_prompts_per_gram)
    for name, text in files.items():
        for lineno, line in enumerate(text.split("\n"), 1):  # "\n" only: U+2028 may sit inside a string
            if not line.strip():
                continue
            try:
                turns = eval_turns_of_line(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{name}:{lineno}: evaluation file line is not valid JSON ({err.msg})") from None
            if not turns:
                raise ValueError(f"{name}:{lineno}: evaluation record has no turns/messages/prompt field")
            for turn in turns:
                index.add(turn, f"{name}:{lineno}")
    return index


# ---------------------------------------------------------------- the filter chain
@dataclass
class Verdict:
    reason: str | None  # None = kept, else one of FILTER_ORDER
    detail: str = ""


class PromptFilter:
    """Stateful chain: `check` each prompt in order; kept prompts feed the dedup indexes."""

    def __init__(self, cfg: FilterConfig, eval_index: EvalIndex | None = None):
        self.cfg = cfg
        self.eval_index = eval_index
        self.seen: dict[str, str] = {}  # normalised key -> id of the kept prompt
        self.lsh = self.minhashes = None
        if cfg.near_dedup:
            from datasketch import MinHashLSH

            self.lsh = MinHashLSH(threshold=cfg.near_dup_threshold, num_perm=cfg.num_perm)
        self.kept: Counter = Counter()
        self.dropped: Counter = Counter()

    def _minhash(self, text: str):
        from datasketch import MinHash

        tokens = words(text)
        shingles = {" ".join(g) for g in ngrams(tokens, min(self.cfg.near_dup_shingle, max(1, len(tokens))))}
        mh = MinHash(num_perm=self.cfg.num_perm, seed=1)  # fixed seed: same hashes on every run
        for s in sorted(shingles):
            mh.update(s.encode("utf-8"))
        return mh

    def _verdict(self, prompt_id: str, text: str) -> Verdict:
        for reason, check in (("length", length_reason), ("degenerate", degenerate_reason)):
            detail = check(text, self.cfg)
            if detail:
                return Verdict(reason, detail)
        if self.eval_index is not None:
            detail = self.eval_index.match(text)
            if detail:
                return Verdict("contaminated", detail)
        key = normalised_key(text)
        if self.cfg.exact_dedup and key in self.seen:
            return Verdict("duplicate", f"same normalised text as {self.seen[key]}")
        if self.lsh is not None:
            mh = self._minhash(text)
            similar = sorted(self.lsh.query(mh))
            if similar:
                return Verdict("near_duplicate", f"MinHash Jaccard >= {self.cfg.near_dup_threshold} with {similar[0]}")
            self.lsh.insert(prompt_id, mh)
        self.seen.setdefault(key, prompt_id)
        return Verdict(None)

    def check(self, prompt_id: str, turns: Sequence[str], domain: str = "") -> Verdict:
        verdict = self._verdict(prompt_id, prompt_text(turns))
        if verdict.reason is None:
            self.kept[domain] += 1
        else:
            self.dropped[verdict.reason] += 1
        return verdict

    def counts(self) -> dict:
        """{"kept": n, "kept_by_domain": {...}, "dropped": {reason: n for every filter}}."""
        return {"kept": sum(self.kept.values()), "kept_by_domain": dict(sorted(self.kept.items())),
                "dropped": {reason: self.dropped.get(reason, 0) for reason in FILTER_ORDER}}
