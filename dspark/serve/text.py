"""Incremental detokenization for streaming: `tokenizers`' DecodeStream turns each new token into text,
stop strings are searched only in the new text, and only a tail that could still become a stop string
is held back."""
from __future__ import annotations


# ---- text assembly (incremental detokenization + stop strings) -----------------------------------------
class TextAssembler:
    """Token stream -> text deltas. Each new token is detokenized once, incrementally, with `tokenizers`'
    DecodeStream (which holds back an incomplete UTF-8 sequence until it completes); stop strings are
    searched only in the text the new token could have completed, and any tail that could still grow
    into a stop string is held back. `update(tokens, final)` -> (delta, stopped); after it, `text` is
    the answer so far (cut before a stop string, or after it with include_stop) and `n_tokens` the
    tokens it took, i.e. up to the one that completed the stop string (what `usage.completion_tokens`
    counts). A token in `hidden_ids` (the engine's stop tokens: necessarily the last one) is counted
    but its text is not shown. skip_special_tokens: as in `tokenizer.decode`."""

    def __init__(self, tokenizer, stops: list[str] | None, *, include_stop: bool = False,
                 skip_special_tokens: bool = True, hidden_ids: frozenset[int] = frozenset()):
        from tokenizers.decoders import DecodeStream

        self.backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer is not None else None
        if tokenizer is not None and self.backend is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no `tokenizers` backend (a fast tokenizer "
                             "is needed for incremental detokenization)")
        self.skip_special_tokens, self.include_stop, self.hidden_ids = skip_special_tokens, include_stop, hidden_ids
        self.decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stops = list(stops or [])
        self.full = ""  # detokenized text of every token fed
        self.ids: list[int] = []  # tokens fed
        self.pending = 0  # tokens fed since the decoder last produced text (an incomplete UTF-8 tail)
        self.n_tokens = 0
        self.n_hidden = 0  # hidden tokens counted (at most the last one)
        self.cut: int | None = None  # where a stop string starts (the answer ends there)
        self.sent = 0  # characters already returned as deltas

    @property
    def stopped(self) -> bool:
        return self.cut is not None

    @property
    def text(self) -> str:
        return self.full if self.cut is None else self.full[: self.cut]

    @property
    def fed(self) -> int:
        return len(self.ids)

    def update(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        for token in tokens[self.fed + self.n_hidden:]:
            if self.stopped:
                break
            if int(token) in self.hidden_ids:
                self.n_hidden += 1
                self.n_tokens = self.fed + self.n_hidden
                continue
            self._feed(int(token))
        if final and self.pending and not self.stopped and self.backend is not None:  # an incomplete tail decodes as U+FFFD, as in decode()
            self._flush()
        visible = len(self.text) if (final or self.stopped) else len(self.full) - self._held_back()
        delta = self.full[self.sent: visible] if visible > self.sent else ""
        self.sent = max(self.sent, visible)
        return delta, self.stopped

    def _feed(self, token: int) -> None:
        self.ids.append(token)
        self.n_tokens = self.fed
        piece = self.decoder.step(self.backend, token) if self.backend is not None else None
        if not piece:
            self.pending += 1
            return
        self.pending = 0
        self._extend(piece)

    def _flush(self) -> None:
        whole = self.backend.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if whole.startswith(self.full) and len(whole) > len(self.full):
            self._extend(whole[len(self.full):])
        self.pending = 0

    def _extend(self, piece: str) -> None:
        before = len(self.full)
        self.full += piece
        # a stop string completed by this piece ends somewhere in it: search from len(stop)-1 before it
        hits = [(at, stop) for stop in self.stops if (at := self.full.find(stop, max(0, before - len(stop) + 1))) >= 0]
        if hits:
            at, stop = min(hits, key=lambda h: h[0])
            self.cut = at + len(stop) if self.include_stop else at

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.full)), longest, -1):
                if self.full.endswith(stop[:k]):
                    longest = k
                    break
        return longest
