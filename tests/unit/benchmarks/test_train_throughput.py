"""benchmarks/train_throughput.py --compare builds the config's draft vocabulary from its rows (it failed
with "draft_vocab_size and draft_ids go together" once the smollm2 configs set one)."""
from types import SimpleNamespace

from benchmarks.train_throughput import draft_ids_of


def config(size):
    return SimpleNamespace(drafter=SimpleNamespace(draft_vocab_size=size))


def test_the_draft_vocabulary_holds_the_most_frequent_supervised_tokens():
    rows = [{"input_ids": [9, 9, 1, 1, 1, 2], "loss_mask": [0, 0, 1, 1, 1, 1]},  # 9 is prompt only
            {"input_ids": [3, 2, 1], "loss_mask": [0, 1, 1]}]
    assert draft_ids_of(config(2), rows, vocab=10).tolist() == [1, 2]
    assert draft_ids_of(config(None), rows, vocab=10) is None
