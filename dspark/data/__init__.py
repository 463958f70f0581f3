"""Data: prompt sources and filters, chat/JSONL files, Magpie-style self-prompts, the rollout dataset's
on-disk schema and the rollout engine that fills it."""
