"""Length bucketing (dspark/training/batching.py) and the single-device training step / FLOPs accounting
(dspark/training/loop.py) on real tiny objects."""
import random

import numpy as np
import pytest
import torch

from dspark.training.batching import (bucketed_batches, collate, padding_fraction, regroup_by_length, reshuffled_epoch,
                                     sequence_limit)
from dspark.drafters import DrafterConfig, build_drafter
from dspark.training.loop import FlopsModel, LocalTrainer, Throughput, autocast, resolve_precision
from dspark.training.config import OptimSection
from tests.tiny_models import build_tiny_model


def lengths(n=256, seed=0):
    rng = random.Random(seed)
    return [rng.randint(20, 400) for _ in range(n)]


def test_bucketing_keeps_every_row_once_and_cuts_padding_below_ten_percent():
    lens = lengths()
    order = list(range(len(lens)))
    random.Random(1).shuffle(order)
    plain = bucketed_batches(order, lens, 8, window=1, seed=0)
    bucketed = bucketed_batches(order, lens, 8, window=16, seed=0)
    assert sorted(i for b in bucketed for i in b) == sorted(order)
    assert all(len(b) == 8 for b in bucketed) and len(bucketed) == len(plain)
    assert padding_fraction(plain, lens) > 0.3  # random lengths 20..400: a third or more is padding
    assert padding_fraction(bucketed, lens) < 0.10
    assert bucketed == bucketed_batches(order, lens, 8, window=16, seed=0)  # deterministic
    assert bucketed != bucketed_batches(order, lens, 8, window=16, seed=1)  # batch order follows the seed
    assert padding_fraction([[0, 1]], [3, 5], max_len=4) == pytest.approx(1 - 7 / 8)


def test_regroup_by_length_on_column_batches():
    lens = lengths(48, seed=2)
    rows = [np.arange(n) for n in lens]
    batches = [{"input_ids": _ragged(rows[i:i + 4]), "loss_mask": _ragged(rows[i:i + 4]),
                "split": np.array(["train"] * 4)} for i in range(0, 48, 4)]
    out = list(regroup_by_length(iter(batches), window=4, seed=0))
    assert len(out) == len(batches) and all(len(b["input_ids"]) == 4 for b in out)
    assert sorted(len(x) for b in out for x in b["input_ids"]) == sorted(lens)
    assert all(len(a) == len(m) for b in out for a, m in zip(b["input_ids"], b["loss_mask"]))
    pad = lambda bs: sum(max(map(len, b["input_ids"])) * 4 - sum(map(len, b["input_ids"])) for b in bs)  # noqa: E731
    assert pad(out) < pad(batches) / 2
    collate(out[0], 512, 0)  # the regrouped batch is still a valid collate input
    assert list(regroup_by_length(iter(batches), window=1, seed=0)) == batches


def test_reshuffled_epoch_keeps_rows_and_batch_sizes_in_a_new_order():
    rows = [np.arange(n) for n in lengths(24, seed=3)]
    kept = [{"input_ids": _ragged(rows[i:i + 4]), "loss_mask": _ragged(rows[i:i + 4])} for i in range(0, 24, 4)]
    out = reshuffled_epoch(kept, seed=1)
    assert len(out) == len(kept) and all(len(b["input_ids"]) == 4 for b in out)
    key = lambda bs: sorted(tuple(x) for b in bs for x in b["input_ids"])  # noqa: E731
    assert key(out) == key(kept)  # the same rows, each once
    assert [len(x) for b in out for x in b["input_ids"]] != [len(x) for b in kept for x in b["input_ids"]]
    assert all((a == m).all() for b in out for a, m in zip(b["input_ids"], b["loss_mask"]))  # columns stay paired
    flat = lambda bs: [list(x) for b in bs for x in b["input_ids"]]  # noqa: E731
    assert flat(reshuffled_epoch(kept, seed=1)) == flat(out)
    assert flat(reshuffled_epoch(kept[::-1], seed=1)) == flat(out), "the order depends on the rows, not their order"
    assert flat(reshuffled_epoch(kept, seed=2)) != flat(out)
    assert reshuffled_epoch([], seed=0) == []


def test_workers_replay_small_shards_only_when_the_run_has_a_second_epoch():
    from types import SimpleNamespace

    from jobs.train_worker import replays_in_memory

    cfg = lambda mb: SimpleNamespace(data=SimpleNamespace(max_seq_len=1024, replay_in_memory_mb=mb))  # noqa: E731
    plan = lambda rows, total, per_epoch: SimpleNamespace(train_rows=rows, total_steps=total,  # noqa: E731
                                                          steps_per_epoch=per_epoch)
    assert replays_in_memory(cfg(512), plan(1000, 30, 10))  # 1000 x 1024 x 16 B = 15.6 MB
    assert not replays_in_memory(cfg(512), plan(1000, 10, 10))  # one epoch: nothing to replay
    assert not replays_in_memory(cfg(10), plan(1000, 30, 10))  # over the budget: re-read every epoch
    assert not replays_in_memory(cfg(0), plan(1, 30, 10))


def _ragged(items):
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=16)


def test_precision_and_flops_model(target):
    assert resolve_precision("cpu") == "fp32" and resolve_precision("cpu", "bf16") == "bf16"
    with pytest.raises(ValueError, match="precision"):
        resolve_precision("cpu", "fp16")
    drafter = build_drafter(DrafterConfig(algo="dflash", block_size=4, num_layers=1), target)
    fm = FlopsModel.of(target, drafter)
    assert fm.block_slots == 5 and fm.vocab == fm.draft_vocab == 16
    n_t = sum(p.numel() for p in target.model.parameters())
    attn = drafter.layers[0].self_attn
    n_ctx = drafter.fc.weight.numel() + attn.k_proj.weight.numel() + attn.v_proj.weight.numel()
    assert fm.context_params == n_ctx < fm.drafter_params
    # 10 tokens, 2 anchors, 6 supervised: 2·N_t·10 + 2·d·V·6 (p_t) + 6·N_ctx·10 + 6·N_d·(2·5) + 4·d·V·6
    expect = 2 * n_t * 10 + 6 * fm.hidden * 16 * 6 + 6 * n_ctx * 10 + 6 * fm.drafter_params * 10
    assert fm.train_flops(10, 2, 6) == pytest.approx(expect)
    # DSpark's Markov head: its previous-token table is a lookup (no FLOPs); a draft vocabulary shrinks
    # the drafter's head term only (p_t still normalises over the whole target vocabulary)
    ds = build_drafter(DrafterConfig(algo="dspark", block_size=4, num_layers=1, rank=4, draft_vocab_size=8), target,
                       draft_ids=torch.arange(8))
    fm2 = FlopsModel.of(target, ds)
    trainable = sum(p.numel() for p in ds.parameters() if p.requires_grad)
    assert fm2.drafter_params == trainable - ds.markov_head.markov_w1.weight.numel() and fm2.draft_vocab == 8
    assert fm2.train_flops(0, 0, 1) == pytest.approx(2 * fm2.hidden * 16 + 4 * fm2.hidden * 8)
    rates = Throughput("cpu", "fp32").mark(100.0, 1e9)
    assert rates["tokens_per_s"] > 0 and "mfu" not in rates  # no known peak on a CPU


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_local_trainer_steps_and_reports_flops(target, precision):
    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="eagle3", ttt_steps=3, dense_ttt=True, ce_target="soft",
                                          position_weight="geometric"), target)
    trainer = LocalTrainer("eagle3", target, drafter, OptimSection(lr=1e-2, warmup_ratio=0.0), precision)
    trainer.set_schedule(4)
    ids = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids)}
    before = [p.detach().clone() for p in trainer.params]
    first = trainer.step(batch, seed=0)
    for s in range(3):
        last = trainer.step(batch, seed=s)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))
    assert first["tokens"] == 24 and first["flops"] > 0 and last["loss"] < first["loss"]
    with autocast("cpu", precision):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)


def test_chunked_step_accumulates_the_same_rows(target):
    """chunks=2 sees the same rows and, with every anchor taken (no sampling) and the same block count
    per row, gives exactly the gradient of the whole batch."""
    def trainer():
        torch.manual_seed(0)
        d = build_drafter(DrafterConfig(algo="dflash", block_size=2, num_layers=1, anchors_per_seq=16,
                                        loss_norm="block"), target)
        return LocalTrainer("dflash", target, d, OptimSection(lr=1e-2, grad_clip=0.0), "fp32")
    ids = torch.randint(0, 16, (4, 10), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids)}
    grads = []
    for chunks in (1, 2):
        t = trainer()
        t.opt.zero_grad = lambda set_to_none=True: None  # keep the gradients for comparison
        m = t.step(batch, seed=0, update=False, chunks=chunks)
        assert m["tokens"] == 40 and m["n_anchors"] == 4 * 9
        grads.append(torch.cat([p.grad.flatten() for p in t.params]))
    assert grads[0].norm() > 0 and torch.allclose(grads[0], grads[1], atol=1e-6)


def test_train_throughput_compare_reports_padded_and_bucketed_side_by_side():
    from benchmarks import train_throughput as tt

    report = tt.main(["--compare", "--config", "configs/train/tiny-dspark.yaml", "--steps", "3",
                      "--micro-batch", "2", "--seq-len", "48", "--min-len", "8", "--bucket-window", "3"])
    assert set(report["results"]) == {"fp32/padded", "fp32/bucketed"}
    padded, bucketed = report["results"]["fp32/padded"], report["results"]["fp32/bucketed"]
    assert padded["timed_steps"] == bucketed["timed_steps"] == 2
    assert bucketed["padding_fraction"] <= padded["padding_fraction"] and bucketed["tokens_per_s"] > 0


def test_measured_matmul_peak_is_the_mfu_basis():
    from dspark.training.loop import flops_rates, measured_matmul_peak

    peak = measured_matmul_peak("cpu", size=256, seconds=0.05)
    assert 1e8 < peak < 1e14  # a plausible CPU: more than 0.1 GFLOP/s, less than 100 TFLOP/s
    rates = flops_rates(2e9, 1.0, "cpu", "fp32", peak=4e9)
    assert rates["model_tflops_per_s"] == pytest.approx(2e-3) and rates["mfu"] == pytest.approx(0.5)
    assert flops_rates(2e9, 1.0, "cpu", "fp32")["mfu"] is None  # no data-sheet peak for a CPU


def test_long_context_rows_are_cut_to_the_targets_context(capsys):
    class ShortTarget:
        max_positions = 64

    assert sequence_limit(32768, ShortTarget()) == 64
    assert "exceeds the target's context (64 positions)" in capsys.readouterr().out
    assert sequence_limit(32, ShortTarget()) == 32 and not capsys.readouterr().out
    ids = collate({"input_ids": [list(range(100))], "loss_mask": [[1] * 100]}, sequence_limit(4096, ShortTarget()), 0)
    assert ids["input_ids"].shape[-1] == 64
