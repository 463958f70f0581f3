"""Chat-template variables: which extra variables (`chat_template_kwargs`) a template reads, so a
variable it would ignore is refused instead of silently dropped."""
from __future__ import annotations

import functools
import logging

log = logging.getLogger("dspark.serve")

# Variables apply_chat_template or this server sets: a request cannot override them.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "add_generation_prompt", "continue_final_message", "tools", "documents", "tokenize",
    "return_dict", "return_assistant_tokens_mask", "chat_template", "bos_token", "eos_token", "pad_token",
    "unk_token", "raise_exception", "strftime_now"})


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str] | None:
    """The free variables a Jinja chat template reads (e.g. enable_thinking), parsed with the same
    Jinja environment transformers renders it with; None when it cannot be parsed (then every variable
    is passed through)."""
    import jinja2
    from jinja2 import meta

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(template).environment
    except Exception:  # another transformers layout: a plain environment with HF's loop controls
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError as err:
        log.warning("cannot parse the chat template (%s): chat_template_kwargs are passed unchecked", err)
        return None
