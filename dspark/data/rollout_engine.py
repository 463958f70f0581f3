"""The target side of rollout generation, without Ray: chat templates and loss masks (`ChatRollout`),
answering a batch of prompts with the engine or HF `generate` (`RolloutEngine`), and the Ray Data
callable that wraps it (`RolloutActor`).

Sampling is made per prompt: every row has its own torch.Generator seeded from (seed, prompt_id,
turn), so a prompt's answer does not depend on which batch, actor or run generated it (up to
floating-point differences between batch shapes).
"""
from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Literal

import pyarrow as pa
import torch
from pydantic import Field

from dspark.config import StrictModel
from dspark.decoding.generator import BatchGenerator, GeneratorConfig
from dspark.decoding.sampling import MaxNewTokens, SamplingParams, Temperature, TopK, TopP, to_probs
from dspark.data import schema

SENTINEL = "<<DSPARK-ANSWER-7f3a>>"  # stands in for an answer when rendering the chat template


# ---------------------------------------------------------------- config
class SamplingConfig(StrictModel):
    """How the target answers: the shared sampling fields (dspark.decoding.sampling) plus a seed."""

    temperature: Temperature = 0.7
    top_p: TopP = 0.9
    top_k: TopK = 0
    max_new_tokens: MaxNewTokens = 256
    seed: int = Field(0, description="base seed; each (prompt, turn) gets its own generator derived from it")

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


# ---------------------------------------------------------------- generation core (no Ray)
def row_seed(seed: int, prompt_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}/{prompt_id}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _row_sampler_class():
    from transformers import LogitsProcessor

    class RowSampler(LogitsProcessor):
        """Samples each row from `to_probs(logits)` with that row's own generator and returns
        scores that make greedy decoding pick exactly the sampled token."""

        def __init__(self, sp: SamplingParams, generators: list[torch.Generator]):
            self.sp, self.generators = sp, generators

        def __call__(self, input_ids, scores):
            probs = to_probs(scores, self.sp)
            picks = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.generators)]
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(1, torch.stack(picks).to(scores.device), 0.0)

    return RowSampler


def cut_at_stop(seq: list[int], stops: set[int]) -> list[int]:
    """Generated ids up to and including the first stop token (later ids are padding)."""
    for i, tok in enumerate(seq):
        if tok in stops:
            return seq[: i + 1]
    return seq


@dataclass
class Conversation:
    """One prompt being rolled out: the exact ids so far and which of them the target generated."""

    row: dict
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    error: tuple[str, str] | None = None

    def extend(self, ids: list[int], generated: bool) -> None:
        self.ids.extend(ids)
        self.mask.extend([int(generated)] * len(ids))


class ChatRollout:
    """Conversation bookkeeping of a rollout, no generation: opens user turns with the exact template
    tokens, records answers and builds result rows. Needs from `target` only its tokenizer side
    (tokenizer, chat_ids, chat_template_kwargs, eos_token_ids, name, revision, max_positions)."""

    def __init__(self, target, sampling: SamplingConfig, max_context_tokens: int | None = None):
        self.target = target
        self.sampling = sampling
        self.sp = sampling.params()
        self.stops = set(target.eos_token_ids)
        if not self.stops:
            raise ValueError(f"target {target.name} has no eos token id; cannot tell where an answer ends")
        self.limit = max_context_tokens or target.max_positions
        self.sampling_json = json.dumps(sampling.model_dump(), sort_keys=True)

    def new_conversation(self, row: dict) -> Conversation:
        return Conversation(row, messages=[{"role": "system", "content": row["system"]}] if row["system"] else [])

    def budget(self, conv: Conversation) -> int:
        """New tokens allowed for the turn being answered (rows near the context limit get fewer)."""
        return min(self.sampling.max_new_tokens, self.limit - len(conv.ids))

    # -- token plumbing
    def decode(self, ids: list[int]) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=False)

    def _next_prompt_ids(self, conv: Conversation, turn: int) -> list[int]:
        """Template tokens that open user turn `turn` and the next assistant answer."""
        user = {"role": "user", "content": conv.row["turns"][turn]}
        if turn == 0:
            return self.target.chat_ids(conv.messages + [user], add_generation_prompt=True)
        history = conv.messages[:-1] + [{"role": "assistant", "content": SENTINEL}, user]
        text = self.target.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True,
                                                         **self.target.chat_template_kwargs)
        if SENTINEL not in text:
            raise ValueError("the chat template dropped an earlier assistant turn")
        suffix = text[text.rindex(SENTINEL) + len(SENTINEL):]
        last = conv.ids[-1]
        stop_text = self.decode([last]) if last in self.stops else ""
        if stop_text and suffix.startswith(stop_text):
            suffix = suffix[len(stop_text):]  # the generated stop token already closes the answer
        return self.target.tokenizer(suffix, add_special_tokens=False)["input_ids"]

    def open_turn(self, conv: Conversation, turn: int) -> None:
        try:
            prompt = self._next_prompt_ids(conv, turn)
        except ValueError as err:
            conv.error = ("template_error", f"turn {turn}: {err}")
            return
        conv.extend(prompt, generated=False)
        conv.messages.append({"role": "user", "content": conv.row["turns"][turn]})
        if len(conv.ids) >= self.limit:
            conv.error = ("prompt_too_long", f"turn {turn}: the prompt is {len(conv.ids)} tokens, the context "
                                             f"limit is {self.limit} (raise max_context_tokens or shorten the prompt)")

    def add_answer(self, conv: Conversation, new: list[int]) -> None:
        """Append one generated answer (stop token kept, if any) to a conversation."""
        stopped = bool(new) and new[-1] in self.stops
        conv.extend(new, generated=True)
        conv.finish.append("stop" if stopped else "length")
        content = new[:-1] if stopped else new
        conv.messages.append({"role": "assistant", "content": self.decode(content)})

    def result(self, conv: Conversation) -> dict:
        row = conv.row
        ok = conv.error is None
        generated = sum(conv.mask) if ok else 0
        return {
            "prompt_id": row["prompt_id"], "source": row["source"], "domain": row["domain"], "split": row["split"],
            "messages": conv.messages if ok else [], "input_ids": conv.ids if ok else [],
            "loss_mask": conv.mask if ok else [], "num_prompt_tokens": len(conv.ids) - generated if ok else 0,
            "num_generated_tokens": generated, "num_turns": len(conv.finish) if ok else 0,
            "finish_reason": ("length" if "length" in conv.finish else "stop") if ok else "",
            "turn_finish_reasons": conv.finish if ok else [], "target": self.target.name,
            "target_revision": self.target.revision, "sampling": self.sampling_json, "chunk": row.get("chunk", 0),
            "error_reason": None if ok else conv.error[0], "error_detail": None if ok else conv.error[1],
            "location": row.get("location", ""),
            "raw": None if ok else json.dumps({"system": row["system"], "turns": row["turns"]},
                                              ensure_ascii=False)[:schema.RAW_LIMIT],
        }


class RolloutEngine(ChatRollout):
    """Batched multi-turn generation on one target replica, by continuous batching (backend engine)
    or HF generate on fixed batches (backend transformers). Mutates the target's default generation
    config to a neutral one so that nothing but `to_probs` shapes the sampling."""

    def __init__(self, target, sampling: SamplingConfig, max_context_tokens: int | None = None,
                 backend: Literal["engine", "transformers"] = "engine", engine: GeneratorConfig | None = None):
        from transformers import GenerationConfig

        if backend not in ("engine", "transformers"):
            raise ValueError(f"RolloutEngine runs backend 'engine' or 'transformers', not {backend!r}")
        super().__init__(target, sampling, max_context_tokens)
        self.backend = backend
        self.generator = BatchGenerator(target, engine) if backend == "engine" else None
        target.model.generation_config = GenerationConfig(eos_token_id=sorted(self.stops),
                                                          pad_token_id=target.pad_token_id)
        self._sampler = _row_sampler_class()

    def sample(self, prompts: list[list[int]], seeds: list[int], max_new_tokens: int) -> list[list[int]]:
        """Left-padded batched generation with KV cache; each row sampled with its own seed."""
        from transformers import GenerationConfig, LogitsProcessorList

        device = self.target.device
        width = max(len(p) for p in prompts)
        pad = self.target.pad_token_id
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                   eos_token_id=sorted(self.stops), pad_token_id=pad)
        with torch.no_grad():
            out = self.target.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=gen_cfg,
                logits_processor=LogitsProcessorList([self._sampler(self.sp, generators)]))
        return [cut_at_stop(seq, self.stops) for seq in out[:, width:].tolist()]

    def _answer_turn(self, convs: list[Conversation], turn: int) -> None:
        budgets = [self.budget(c) for c in convs]
        seeds = [row_seed(self.sampling.seed, c.row["prompt_id"], turn) for c in convs]
        if self.generator is not None:
            results = self.generator.generate([c.ids for c in convs], self.sp, seeds, budgets, sorted(self.stops))
            answers = [tokens for tokens, _ in results]
        else:
            answers = self._sample_by_budget([c.ids for c in convs], seeds, budgets)
        for conv, new in zip(convs, answers):
            self.add_answer(conv, new)

    def _sample_by_budget(self, prompts: list[list[int]], seeds: list[int], budgets: list[int]) -> list[list[int]]:
        """HF generate once per distinct token budget (a fixed batch shares max_new_tokens)."""
        groups = defaultdict(list)
        for i, budget in enumerate(budgets):
            groups[budget].append(i)
        answers: list[list[int]] = [[] for _ in prompts]
        for budget, rows in groups.items():
            for i, new in zip(rows, self.sample([prompts[i] for i in rows], [seeds[i] for i in rows], budget)):
                answers[i] = new
        return answers

    def run(self, rows: list[dict]) -> list[dict]:
        """Rows with prompt_id, source, domain, split, system, turns, chunk (+ location) ->
        RESULT_SCHEMA rows, one per input row, in input order."""
        convs = [self.new_conversation(row) for row in rows]
        for turn in range(max((len(c.row["turns"]) for c in convs), default=0)):
            active = [c for c in convs if c.error is None and turn < len(c.row["turns"])]
            for conv in active:
                self.open_turn(conv, turn)
            active = [c for c in active if c.error is None]
            if active:
                self._answer_turn(active, turn)
        return [self.result(c) for c in convs]


def stream_rollouts(target, prompts: list, sampling: SamplingConfig, engine: GeneratorConfig | None = None,
                    stop=None, max_context_tokens: int | None = None):
    """First-turn answers to `prompts` (dspark.data.prompts.Prompt) by continuous batching, cycling through
    the prompts with fresh seeds (cycle c: seed row_seed(sampling.seed + c, ...)), each cycle shortest
    prompt first, until `stop()` (checked before every decoding step: a deadline, a token goal) — or for
    one cycle when `stop` is None. Yields training rows {prompt_id ("<id>#c<cycle>"), input_ids,
    loss_mask (1 on the answer), num_generated_tokens, finish_reason} as answers finish; answers cut by
    `stop` are kept (a prefix of a target sample is a valid one)."""
    import itertools

    from dspark.decoding.generator import PromptJob

    limit = max_context_tokens or target.max_positions
    ids = {}
    for p in prompts:
        chat = target.chat_ids(([{"role": "system", "content": p.system}] if p.system else [])
                               + [{"role": "user", "content": p.turns[0]}])
        if len(chat) < limit:
            ids[p.prompt_id] = chat
    order = sorted(ids, key=lambda pid: len(ids[pid]))
    if not order:
        raise ValueError(f"none of the {len(prompts)} prompts fits the context limit ({limit} tokens)")
    cycles = itertools.count() if stop is not None else range(1)
    requests = (PromptJob(f"{pid}#c{c}", ids[pid], row_seed(sampling.seed + c, pid, 0),
                        min(sampling.max_new_tokens, limit - len(ids[pid])))
                for c in cycles for pid in order)
    generator = BatchGenerator(target, engine)
    generator.check_kv_fits([PromptJob(pid, ids[pid], 0, min(sampling.max_new_tokens, limit - len(ids[pid])))
                             for pid in order])
    for request, tokens, finish in generator.stream(requests, sampling.params(), sorted(target.eos_token_ids), stop):
        if tokens:
            yield {"prompt_id": request.key, "input_ids": list(request.prompt) + tokens,
                   "loss_mask": [0] * len(request.prompt) + [1] * len(tokens), "num_generated_tokens": len(tokens),
                   "finish_reason": finish}


def results_table(results: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(results, schema=schema.RESULT_SCHEMA)


class RolloutActor:
    """A Ray Data actor: one target replica generating for whole batches. `local_copy` copies an
    s3:// target here (pipelines.generate passes dspark.io.storage.local_copy)."""

    def __init__(self, spec: dict, local_copy: Callable[[str], str] | None = None):
        from dspark.models.precision import torch_dtype
        from dspark.models.target import load_target

        torch.set_num_threads(spec["threads"])
        # "auto" resolves here, on the replica's own device (bf16 only where it is native)
        target = load_target(spec["target"], dtype=torch_dtype(spec["dtype"], spec["device"]), device=spec["device"],
                             local_copy=local_copy)
        self.engine = RolloutEngine(target, SamplingConfig(**spec["sampling"]), spec["max_context_tokens"],
                                    spec["backend"], GeneratorConfig(**spec["engine"]))

    def __call__(self, batch: pa.Table) -> pa.Table:
        return results_table(self.engine.run(batch.to_pylist()))
