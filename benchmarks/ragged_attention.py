"""The ragged forward's attention: grouped query heads (dspark.decoding.batched_cache.grouped_sdpa) against
repeat_kv, which transformers 5.17 (the GPU image's) does whenever a mask is given, through the
continuous-batching generator (rollouts), side by side in one run, interleaved.

    python benchmarks/ragged_attention.py [--target smollm2-135m --rows 32 --tokens 48 --rounds 4 --threads 2]

Each round generates `--tokens` new tokens for `--rows` prompts with each variant in turn (bf16 target,
temperature 1, the same seeds). Printed (last line, JSON): tokens/s per round and variant, the per-round
ratio grouped / repeat_kv and its median.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import dspark.decoding.batched_cache as ragged
from dspark.decoding.generator import BatchGenerator, GeneratorConfig
from dspark.decoding.sampling import SamplingParams
from dspark.models.target import load_target


def repeat_kv_sdpa(query, keys, values, mask, scaling):
    """What transformers 5.17's sdpa_attention_forward does with a mask: every KV head copied per query head."""
    rep = query.shape[1] // keys.shape[1]
    return F.scaled_dot_product_attention(query, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                          attn_mask=mask, scale=scaling).transpose(1, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=torch.bfloat16)
    texts = [f"Question {i}: explain why the sky looks blue at noon and red at sunset." * (1 + i % 3)
             for i in range(args.rows)]
    prompts = [target.chat_ids([{"role": "user", "content": t}]) for t in texts]
    variants = {"grouped_sdpa": ragged.grouped_sdpa, "repeat_kv": repeat_kv_sdpa}
    tok_s = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, attention in variants.items():
            ragged.grouped_sdpa = attention  # the name the ragged attention calls
            gen = BatchGenerator(target, GeneratorConfig(max_batch=args.rows, max_prefill_tokens=1 << 20))
            start = time.perf_counter()
            outs = gen.generate(prompts, SamplingParams(), list(range(args.rows)), args.tokens)
            tok_s[name].append(sum(len(o) for o, _ in outs) / (time.perf_counter() - start))
    ragged.grouped_sdpa = variants["grouped_sdpa"]
    ratios = [a / b for a, b in zip(tok_s["grouped_sdpa"], tok_s["repeat_kv"])]
    print(json.dumps({"benchmark": "ragged_attention", "target": args.target, "rows": args.rows, "tokens": args.tokens,
                      "threads": args.threads, "tokens_per_s": tok_s, "ratio_grouped_over_repeat_kv": ratios,
                      "median_ratio": statistics.median(ratios)}))


if __name__ == "__main__":
    main()
