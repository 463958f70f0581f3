"""Magpie prompt synthesis without Ray: the domain mix, the deterministic slot plan and the engine that
lets a target write user turns (Xu et al., 2024). pipelines/synthesize.py runs it as a Ray Data job.

Magpie: render the chat template up to where a user turn starts (`<|im_start|>user\\n` for ChatML) and
let the model continue; what it writes until its end-of-turn token is a user prompt drawn from what the
model believes users ask. A domain system prompt (with a seed topic filled into `{topic}`) steers it
per domain. Every slot's domain, topic and seed are pure functions of its index and the sampling seed.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
from pydantic import Field, field_validator, model_validator

from dspark.config import StrictModel
from dspark.data.prompt_filters import FILTER_ORDER
from dspark.data.rollout_engine import SENTINEL, RolloutEngine, SamplingConfig, row_seed

PROMPT_SCHEMA = pa.schema([("prompt_id", pa.string()), ("domain", pa.string()), ("turns", pa.list_(pa.string())),
                           ("source", pa.string()), ("system", pa.string())])
RAW_SCHEMA = pa.schema([("slot", pa.int64()), ("chunk", pa.int32()), ("domain", pa.string()), ("topic", pa.string()),
                        ("text", pa.string()), ("finish_reason", pa.string()), ("num_tokens", pa.int32()),
                        ("error", pa.string())])
DROPPED_SCHEMA = pa.schema([("prompt_id", pa.string()), ("domain", pa.string()), ("turns", pa.list_(pa.string())),
                            ("source", pa.string()), ("location", pa.string()), ("reason", pa.string()),
                            ("detail", pa.string())])
# Reasons a candidate never reaches the filters (Magpie only), then the filters in their order.
DROP_REASONS = ("generation_error", "truncated") + FILTER_ORDER


# ---------------------------------------------------------------- config
class DomainSpec(StrictModel):
    weight: float = Field(gt=0, description="share of the Magpie prompts (weights are normalised)")
    system: str = Field("", description="system prompt that steers the user turns; may contain {topic}; "
                                        "empty = the chat template's own default")
    topics: list[str] = Field(default_factory=list, description="seed topics, one per prompt, filled into {topic}")

    @model_validator(mode="after")
    def _topic_slot(self) -> "DomainSpec":
        if self.topics and "{topic}" not in self.system:
            raise ValueError("topics are given but the system prompt has no {topic} placeholder")
        if "{topic}" in self.system and not self.topics:
            raise ValueError("the system prompt has a {topic} placeholder but no topics are given")
        return self

    def system_for(self, topic: str) -> str:
        return self.system.replace("{topic}", topic)


def _blend(weight: float, task: str, topics: list[str]) -> DomainSpec:
    return DomainSpec(weight=weight, system=f"You are a helpful AI assistant. {task}", topics=topics)


# Open-PerfectBlend shares (math 39.4 / code 38.9 / chat 17.6 / instruction following 4.1 %).
DEFAULT_DOMAINS = {
    "math": _blend(39.4, "The user asks you a math question about {topic} and wants a step-by-step solution.",
                   ["arithmetic word problems", "algebra", "geometry", "probability", "number theory",
                    "percentages and ratios", "sequences and series", "calculus"]),
    "code": _blend(38.9, "The user asks you to write or fix a program about {topic}.",
                   ["Python functions", "string processing", "sorting and searching", "SQL queries",
                    "data structures", "JavaScript", "recursion", "file handling"]),
    "chat": _blend(17.6, "The user chats with you and asks for advice or information about {topic}.",
                   ["travel", "cooking", "health and fitness", "history", "science", "personal finance",
                    "careers", "books and films"]),
    "instruction_following": _blend(
        4.1, "The user gives you a writing task about {topic} with explicit constraints on the answer's format "
             "(a word limit, a bulleted list, JSON, a given number of paragraphs).",
        ["an email", "a product description", "a short story", "a summary", "a poem", "a list of ideas"]),
}


class MagpieSampling(SamplingConfig):
    """Sampling of the user turns; Magpie samples the model's own distribution (temperature 1, no top-p)."""

    temperature: float = Field(1.0, description="1: the model's own distribution")
    top_p: float = Field(1.0, description="1: no nucleus cut")
    max_new_tokens: int = Field(128, description="longest user turn; a turn not ended by then is dropped as truncated")


class MagpieConfig(StrictModel):
    num_prompts: int = Field(ge=1, description="user turns to generate (candidates, before filtering)")
    domains: dict[str, DomainSpec] = Field(default_factory=lambda: dict(DEFAULT_DOMAINS),
                                           description="domain -> weight, steering system prompt and seed topics")
    sampling: MagpieSampling = Field(default_factory=MagpieSampling, description="sampling of the user turns")

    @field_validator("domains")
    @classmethod
    def _some(cls, v: dict) -> dict:
        if not v:
            raise ValueError("give at least one domain")
        return v


# ---------------------------------------------------------------- plan
@dataclass
class Slot:
    slot: int
    domain: str
    topic: str
    system: str
    seed: int

    def as_row(self) -> dict:
        return {"slot": self.slot, "domain": self.domain, "topic": self.topic, "system": self.system,
                "seed": self.seed}


def domain_counts(domains: dict[str, DomainSpec], n: int) -> dict[str, int]:
    """Largest-remainder apportionment: counts sum to n and each is within 1 of n * share."""
    total = sum(d.weight for d in domains.values())
    exact = {name: n * d.weight / total for name, d in domains.items()}
    counts = {name: int(x) for name, x in exact.items()}
    by_remainder = sorted(exact, key=lambda name: (-(exact[name] - counts[name]), name))
    for name in by_remainder[: n - sum(counts.values())]:
        counts[name] += 1
    return counts


def domain_sequence(domains: dict[str, DomainSpec], n: int) -> list[str]:
    """Interleave the domains: the j-th of c prompts of a domain sits at (j + 1/2) / c of the way,
    so any prefix of the slots follows the mix too."""
    placed = [((j + 0.5) / c, name) for name, c in domain_counts(domains, n).items() for j in range(c)]
    return [name for _, name in sorted(placed)]


def magpie_slots(cfg: MagpieConfig) -> list[Slot]:
    slots = []
    for i, domain in enumerate(domain_sequence(cfg.domains, cfg.num_prompts)):
        spec = cfg.domains[domain]
        topic = spec.topics[row_seed(cfg.sampling.seed, f"topic-{i}", 0) % len(spec.topics)] if spec.topics else ""
        slots.append(Slot(i, domain, topic, spec.system_for(topic), row_seed(cfg.sampling.seed, f"magpie-{i}", 0)))
    return slots


# ---------------------------------------------------------------- generation (no Ray)
class MagpieEngine:
    """Writes user turns on one target replica, reusing the rollout engine's per-row-seeded sampler."""

    def __init__(self, target, sampling: SamplingConfig, max_context_tokens: int | None = None):
        self.rollout = RolloutEngine(target, sampling, max_context_tokens)
        self.target, self.sampling = target, sampling
        self._prefixes: dict[str, list[int]] = {}

    def user_prefix_ids(self, system: str) -> list[int]:
        """Template tokens up to where the user's text starts (system turn, if any, included)."""
        if system not in self._prefixes:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": SENTINEL}]
            text = self.target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                             **self.target.chat_template_kwargs)
            if SENTINEL not in text:
                raise ValueError("the chat template does not render the user turn's content")
            prefix = text[:text.index(SENTINEL)]
            self._prefixes[system] = self.target.tokenizer(prefix, add_special_tokens=False)["input_ids"]
        return self._prefixes[system]

    def run(self, rows: list[dict]) -> list[dict]:
        """Slot rows (+ chunk) -> RAW_SCHEMA rows, in input order."""
        out: list[dict | None] = [None] * len(rows)
        groups: dict[int, list[int]] = {}
        prompts = []
        for i, row in enumerate(rows):
            prompts.append(self.user_prefix_ids(row["system"]))
            budget = min(self.sampling.max_new_tokens, self.rollout.limit - len(prompts[i]))
            if budget < 1:
                out[i] = self._raw(row, "", "", 0, f"the user prefix is {len(prompts[i])} tokens, the context limit "
                                                   f"is {self.rollout.limit}")
                continue
            groups.setdefault(budget, []).append(i)
        for budget, members in groups.items():
            new = self.rollout.sample([prompts[i] for i in members], [rows[i]["seed"] for i in members], budget)
            for i, ids in zip(members, new):
                stopped = bool(ids) and ids[-1] in self.rollout.stops
                text = self.target.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
                out[i] = self._raw(rows[i], text.strip(), "stop" if stopped else "length", len(ids))
        return out

    @staticmethod
    def _raw(row: dict, text: str, finish: str, num_tokens: int, error: str | None = None) -> dict:
        return {"slot": row["slot"], "chunk": row["chunk"], "domain": row["domain"], "topic": row["topic"],
                "text": text, "finish_reason": finish, "num_tokens": num_tokens, "error": error}
