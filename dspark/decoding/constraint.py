"""Structured output: a request's grammar (a JSON schema, any JSON object), as a token mask per position.

A constrained request decodes from the target's distribution restricted to the tokens the grammar allows next,
p_c(x | prefix) ∝ p(x | prefix) · allowed(x | prefix) (llguidance computes `allowed` from the tokenizer).
Speculative decoding stays exact for p_c: the drafts are not constrained; verification masks the target's
row k with the grammar's state after the prefix AND drafts 1..k-1 (`masks_along`), i.e. exactly p_c given the
prefix that row k is conditioned on, so the usual acceptance rule keeps p_c and a draft the grammar forbids is
simply rejected (p_c = 0 there) and replaced by a draw from the residual, which lies inside the grammar.
Invariant: the matcher has consumed exactly the request's emitted tokens (`commit`); `masks_along` leaves it so.
"""
from __future__ import annotations

import functools
import json
from typing import Any

import torch
from torch import Tensor


class TokenConstraint:
    """One request's grammar state (an llguidance LLMatcher over the target's tokenizer)."""

    def __init__(self, matcher, vocab_size: int, device):
        self.matcher, self.vocab_size, self.device = matcher, vocab_size, torch.device(device)

    @classmethod
    def json(cls, target, schema: dict | None = None) -> TokenConstraint:
        """Output that is one JSON value of `schema` (None: any JSON object), written compactly (no free
        whitespace between tokens). ValueError for a schema the grammar compiler refuses, naming why."""
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                     defaults={"whitespace_flexible": False})  # compact JSON
        matcher = LLMatcher(_tokenizer(target), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the JSON schema cannot be used for structured output: {matcher.get_error()}")
        return cls(matcher, target.vocab_size, target.device)

    def allowed(self) -> Tensor:
        """bool [V]: the tokens the grammar allows next."""
        import numpy as np  # here: the engine imports this module on machines without numpy (the GPU image)

        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return torch.from_numpy(mask).to(self.device)

    def masks_along(self, drafts: list[int]) -> Tensor:
        """bool [len(drafts) + 1, V]: row k = the allowed tokens after drafts[:k]. Rows past a draft the grammar
        refuses repeat that row's mask (acceptance stops there). The matcher is left where it was."""
        rows, consumed = [self.allowed()], 0
        for token in drafts:
            if not rows[-1][token] or not self.matcher.consume_token(int(token)):
                break
            consumed += 1
            rows.append(self.allowed())
        if consumed:
            self.matcher.rollback(consumed)
        rows += [rows[-1]] * (len(drafts) + 1 - len(rows))
        return torch.stack(rows)

    def commit(self, tokens: list[int]) -> None:
        """The request emitted `tokens`: advance the grammar (the end-of-sequence token ends it)."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            self.matcher.consume_token(int(token))

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()


def constrain(logits: Tensor, constraint: TokenConstraint | None, drafts: Tensor | None = None) -> Tensor:
    """logits [n, V] with the tokens the grammar forbids at each row set to -inf (rows after drafts[:k]);
    unchanged without a constraint (and then the drafts are never read back to the host)."""
    if constraint is None:
        return logits
    masks = constraint.masks_along([] if drafts is None else drafts.tolist())[: logits.shape[0]]
    return logits.masked_fill(~masks.to(logits.device), float("-inf"))


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(tokenizer, vocab_size: int):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)


def _tokenizer(target):
    """The llguidance view of the target's tokenizer (~0.5 s to build: cached per loaded tokenizer)."""
    return _cached_tokenizer(target.tokenizer, target.vocab_size)


def response_format_constraint(target, response_format: dict[str, Any] | None) -> TokenConstraint | None:
    """OpenAI's `response_format`: {"type": "text"} (none), {"type": "json_object"} (any JSON object) or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return TokenConstraint.json(target)
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object, got "
                             f"{json.dumps(schema)[:200]}")
        return TokenConstraint.json(target, schema)
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
