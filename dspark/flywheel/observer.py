"""What the OpenAI service calls per request (`submitted`, `finished`): resolve the request's domain,
count its acceptance, and hand a capture row to the writer when the capture policy picks it.
No Ray: the Serve deployment subscribes to `listeners` to export Prometheus metrics."""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Callable

from dspark.flywheel import domain as domains
from dspark.flywheel.acceptance import AcceptanceStats
from dspark.flywheel.config import FlywheelConfig

log = logging.getLogger("dspark.flywheel")


@dataclass
class RequestContext:
    domain: str
    domain_source: str
    messages: list[dict] | None  # chat requests only (kept for capture)


Listener = Callable[[str, object], None]  # (domain, engine RequestStats) of a finished request


class Flywheel:
    """Per-replica flywheel state. `served`: target, target_revision, drafter (pinned ref), drafter_version."""

    def __init__(self, cfg: FlywheelConfig, served: dict, tokenizer=None, writer=None):
        self.cfg, self.served, self.tokenizer = cfg, served, tokenizer
        self.stats = AcceptanceStats()
        self.writer = writer
        if writer is None and cfg.output:
            from dspark.flywheel.capture import FlywheelWriter

            self.writer = FlywheelWriter(cfg, self.stats, served).start()
        self.listeners: list[Listener] = []
        self._pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine Request -> context

    def submitted(self, req, body) -> None:
        """Right after the engine accepted `req` for the request body `body` (ChatBody | CompletionBody)."""
        messages = None
        if hasattr(body, "messages"):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        else:
            text = " ".join(p for p in body.prompts() if isinstance(p, str))
        name, source = domains.resolve(body.metadata, body.user, text, domains.request_shape(body))
        self._pending[req] = RequestContext(name, source, messages)

    def finished(self, req) -> None:
        """Once per request, when the service is done with it (any outcome)."""
        ctx = self._pending.pop(req, None)
        if ctx is None or req.finish_reason == "error":
            return
        self.stats.record(ctx.domain, req.stats, len(req.tokens))
        for fn in self.listeners:
            try:
                fn(ctx.domain, req.stats)
            except Exception:  # noqa: BLE001 - metrics never fail a request
                log.exception("flywheel listener failed")
        self._maybe_capture(req, ctx)

    def _maybe_capture(self, req, ctx: RequestContext) -> None:
        # chat only (a conversation to store); a stop string cancels the request: its tokens are still
        # the target's samples, but only whole answers (stop / length) are captured
        if self.writer is None or ctx.messages is None or req.finish_reason not in ("stop", "length"):
            return
        if not self.writer.wants(ctx.domain):
            return
        from dspark.flywheel.capture import capture_row

        answer = self.tokenizer.decode(req.tokens, skip_special_tokens=True) if self.tokenizer else ""
        self.writer.offer(capture_row(req, ctx.messages, answer, ctx.domain, ctx.domain_source, self.served,
                                      self.cfg.capture.holdout_fraction))

    def capture_counts(self) -> dict:
        return vars(self.writer.counts) if self.writer is not None else {}

    def close(self, timeout_s: float = 30.0) -> None:
        if self.writer is not None:
            self.writer.close(timeout_s)


def pin_drafter(ref: str | None) -> tuple[str | None, str]:
    """(the reference pinned to a concrete version, that version or ""): the Serve app resolves an alias
    (`models:/x@serving`) once when it is deployed (dspark.serve.deployment.pinned_config) and every replica
    serves that version until the app is redeployed."""
    if not ref:
        return ref, ""
    from dspark.io.drafter_source import resolve_ref

    pinned = resolve_ref(ref)
    return pinned.uri, pinned.model_version if pinned.kind == "model" else ""


def build_flywheel(cfg, engine) -> Flywheel:
    """The replica's Flywheel for a ServeConfig whose model.drafter is already pinned."""
    served = {"target": cfg.model.target, "target_revision": engine.target.revision,
              "drafter": cfg.model.drafter if engine.drafting else None,
              "drafter_version": pin_version(cfg.model.drafter) if engine.drafting else ""}
    return Flywheel(cfg.flywheel, served, tokenizer=engine.target.tokenizer)


def pin_version(pinned_ref: str | None) -> str:
    from dspark.io.drafter_source import parse_ref

    ref = parse_ref(pinned_ref) if pinned_ref else None
    return ref.model_version if ref is not None and ref.kind == "model" else ""
