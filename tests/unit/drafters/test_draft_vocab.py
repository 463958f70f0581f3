"""Draft vocabulary (Eagle3's d2t/t2d): frequency counting over rollouts, the maps and their vLLM
convention, drafting on the subset (= the training math, zero outside), losses against the full target
distribution, checkpoint round trip, vLLM export, and the training job's driver step.
Losslessness through decoding is tested with χ² in test_specdec.py and test_engine.py."""
import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from dspark.drafters import draft_vocab as dv
from dspark.drafters import DrafterConfig, build_drafter, load_drafter, save_drafter
from dspark.export.vllm import export_vllm
from dspark.training.losses import tv_l1
from dspark.decoding.sampling import SamplingParams
from dspark.training.loss import drafter_loss
from tests.tiny_models import build_tiny_model

V = 16
DRAFT_IDS = [0, 2, 3, 5, 8, 9, 12, 15]
VARIANTS = [("dflash", "markov"), ("dspark", "markov"), ("dspark", "rnn"), ("eagle3", "markov")]


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=V)


def make(target, algo, head="markov", ids=DRAFT_IDS, **kw):
    torch.manual_seed(0)
    if algo != "eagle3":
        kw.setdefault("num_layers", 2)
    cfg = DrafterConfig(algo=algo, head=head, rank=8, block_size=4, ttt_steps=4, draft_vocab_size=len(ids), **kw)
    return build_drafter(cfg, target, draft_ids=torch.tensor(ids))


# ---------------------------------------------------------------- counting and maps
def test_counts_only_supervised_tokens_and_name_bad_rows():
    rows = [([1, 2, 2, 3], [0, 1, 1, 1]), ([3, 3, 1], [1, 1, 0])]
    assert dv.count_token_frequencies(rows, 5).tolist() == [0, 0, 2, 3, 0]
    with pytest.raises(ValueError, match="row 1: input_ids has 2 tokens but loss_mask has 3"):
        dv.count_token_frequencies([([1], [1]), ([1, 2], [1, 1, 1])], 5)
    with pytest.raises(ValueError, match="row 0: input_ids holds token id 7, outside the target vocabulary"):
        dv.count_token_frequencies([([7], [1])], 5)


def test_parquet_counts_follow_the_split_and_the_mask(tmp_path):
    table = pa.table({"split": ["train", "eval", "train"], "input_ids": [[4, 4, 1], [2, 2, 2], [1, 4, 6]],
                      "loss_mask": [[0, 1, 1], [1, 1, 1], [1, 1, 0]]})
    pq.write_table(table, tmp_path / "a.parquet")
    counts = dv.count_parquet_frequencies([str(tmp_path / "a.parquet")], None, "train")
    assert counts.tolist() == [0, 2, 0, 0, 2]  # token 6 is unsupervised, the eval row is skipped
    assert dv.count_parquet_frequencies([str(tmp_path / "a.parquet")], 8, None).tolist() == [0, 2, 3, 0, 2, 0, 0, 0]
    bad = pa.table({"split": ["train"], "input_ids": [[1, 2]], "loss_mask": [[1]]})
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="bad.parquet row 0 of a batch: input_ids and loss_mask differ"):
        dv.count_parquet_frequencies([str(tmp_path / "bad.parquet")], None, "train")


def test_parquet_counts_skip_empty_batches(tmp_path):
    """An empty shard (a chunk whose rows all failed) and a shard whose rows the split filter removes
    give empty record batches: they count nothing and are not length mismatches."""
    schema = pa.schema([("split", pa.string()), ("input_ids", pa.list_(pa.int64())),
                        ("loss_mask", pa.list_(pa.int64()))])
    pq.write_table(schema.empty_table(), tmp_path / "empty.parquet")
    pq.write_table(pa.table({"split": ["eval"], "input_ids": [[1, 2]], "loss_mask": [[1, 1]]}, schema=schema),
                   tmp_path / "eval_only.parquet")
    pq.write_table(pa.table({"split": ["train"], "input_ids": [[3, 3]], "loss_mask": [[0, 1]]}, schema=schema),
                   tmp_path / "train.parquet")
    paths = [str(tmp_path / n) for n in ("empty.parquet", "eval_only.parquet", "train.parquet")]
    assert dv.count_parquet_frequencies(paths, 5, "train").tolist() == [0, 0, 0, 1, 0]
    assert dv.count_parquet_frequencies(paths, None, "train").tolist() == [0, 0, 0, 1]


def test_top_ids_and_the_vllm_offset_convention():
    counts = torch.tensor([5, 0, 9, 5, 1, 0, 7])
    ids = dv.top_token_ids(counts, 4)
    assert ids.tolist() == [0, 2, 3, 6]  # 9, 7, then the tie 5/5 by lower id; ascending order
    assert dv.top_token_ids(counts, 6, vocab_size=9).tolist() == [0, 1, 2, 3, 4, 6]  # unseen: lower id first
    d2t, t2d = dv.d2t_from_ids(ids), dv.t2d_from_ids(ids, 7)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    assert (torch.arange(4) + d2t).tolist() == ids.tolist()  # target_id = draft_id + d2t[draft_id]
    assert t2d.tolist() == [True, False, True, True, False, False, True]
    assert torch.equal(dv.check_maps(d2t, t2d), ids)
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        dv.check_maps(d2t, dv.t2d_from_ids(torch.tensor([0, 1, 2, 6]), 7))
    with pytest.raises(ValueError, match="strictly ascending"):
        dv.check_draft_ids(torch.tensor([3, 1]), 7)
    with pytest.raises(ValueError, match="draft_vocab_size=8 must be in 1..7"):
        dv.top_token_ids(counts, 8)
    labels = torch.tensor([6, 1, 0, 3])
    assert dv.draft_labels(labels, t2d).tolist() == [3, dv.IGNORE_LABEL, 0, 2]
    assert dv.coverage(counts, ids) == pytest.approx(26 / 27)


def test_build_needs_ids_with_the_size_and_rejects_too_large(target):
    with pytest.raises(ValueError, match="draft_vocab_size and draft_ids go together"):
        build_drafter(DrafterConfig(draft_vocab_size=4), target)
    with pytest.raises(ValueError, match="got 3 draft token ids but draft_vocab_size=4"):
        build_drafter(DrafterConfig(draft_vocab_size=4), target, draft_ids=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="exceeds the target vocabulary"):
        build_drafter(DrafterConfig(draft_vocab_size=V + 1), target, draft_ids=torch.arange(V + 1))


# ---------------------------------------------------------------- drafting on the subset
def features(target, drafter, ids):
    return target.forward(ids, layer_ids=drafter.layer_ids, logits_at=None).features


@pytest.mark.parametrize("algo,head", VARIANTS)
def test_proposals_live_on_the_subset_and_equal_the_training_math(target, algo, head):
    """Incremental drafting gives, on the draft tokens, exactly the teacher-forced training
    distribution (softmax over the N draft logits) and zero on every other token."""
    drafter = make(target, algo, head)
    assert drafter.lm_logits(torch.randn(2, target.hidden_size)).shape == (2, len(DRAFT_IDS))
    ids = torch.randint(0, V, (1, 14), generator=torch.Generator().manual_seed(5))
    t = 6
    state = drafter.new_state()
    drafter.extend_context(state, features(target, drafter, ids)[0, :t], ids[0, :t])
    proposal = drafter.propose(state, int(ids[0, t]), 4, SamplingParams(), torch.Generator().manual_seed(1))
    assert set(proposal.tokens.tolist()) <= set(DRAFT_IDS) and proposal.probs.shape == (4, V)
    outside = [i for i in range(V) if i not in DRAFT_IDS]
    assert proposal.probs[:, outside].abs().sum() == 0
    forced = ids.clone()
    forced[0, t + 1:t + 5] = proposal.tokens
    out = drafter(features(target, drafter, forced), forced, torch.ones_like(forced, dtype=torch.bool),
                  torch.tensor([[t]]), torch.ones(1, 1, 4, dtype=torch.bool))
    assert out.logits.shape == (4, len(DRAFT_IDS))
    assert torch.allclose(torch.softmax(out.logits, -1), proposal.probs[:, DRAFT_IDS], atol=1e-5)
    greedy = drafter.propose(state, int(ids[0, t]), 4, SamplingParams(temperature=0.0), None)
    assert set(greedy.tokens.tolist()) <= set(DRAFT_IDS) and torch.equal(greedy.probs.sum(-1), torch.ones(4))


def test_markov_w2_and_lm_head_act_on_the_subset(target):
    drafter = make(target, "dspark")
    assert drafter.markov_head.markov_w1.weight.shape == (V, 8)  # reads target ids (anchor and drafts)
    assert drafter.markov_head.markov_w2.weight.shape == (len(DRAFT_IDS), 8)
    h = torch.randn(3, target.hidden_size)
    full = target.lm_logits(h)
    assert torch.allclose(drafter.lm_logits(h), full[:, DRAFT_IDS], atol=1e-6)


# ---------------------------------------------------------------- training
def test_losses_compare_with_the_full_target_distribution(target, monkeypatch):
    """TV and c* compare p_d (zero outside the subset) with the full target distribution, computed on
    the subset's columns plus the target mass outside them; CE skips labels the drafter cannot produce."""
    import dspark.training.loss as training

    drafter = make(target, "dspark", anchors_per_seq=6)
    seen = {}
    real_tv = training.tv_loss

    def spy_tv(p_draft, p_t_cols, weights, n_blocks, lost):
        seen["p"] = (p_draft.detach(), p_t_cols.detach(), lost.detach())
        return real_tv(p_draft, p_t_cols, weights, n_blocks, lost)

    def spy_ce(logits, labels, weights, n_blocks):
        seen["ce_labels"] = labels
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none").sum() * 0 + logits.sum() * 0

    monkeypatch.setattr(training, "tv_loss", spy_tv)
    monkeypatch.setattr(training, "ce_loss", spy_ce)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    out = drafter_loss(drafter, target, ids, torch.ones_like(ids), None, torch.Generator().manual_seed(0))
    p_draft, p_t_cols, lost = seen["p"]
    assert p_draft.shape[-1] == p_t_cols.shape[-1] == len(DRAFT_IDS)  # no [pairs, V] tensor
    assert torch.allclose(p_draft.sum(-1), torch.ones(len(p_draft)))
    assert (lost > 0).all() and torch.allclose(p_t_cols.sum(-1) + lost, torch.ones(len(lost)), atol=1e-6)
    # the split sum equals ‖p_d − p_t‖₁ over the full vocabulary, p_d extended by zeros
    full_draft = dv.extend_to_vocab(p_draft, torch.tensor(DRAFT_IDS), V)
    full_target = torch.zeros(len(lost), V)
    full_target[:, DRAFT_IDS] = p_t_cols
    outside = [i for i in range(V) if i not in DRAFT_IDS]
    full_target[:, outside] = (lost / len(outside)).unsqueeze(-1)  # any spread of the lost mass gives the same norm
    assert torch.allclose(tv_l1(p_draft, p_t_cols, lost), tv_l1(full_draft, full_target), atol=1e-6)
    labels = seen["ce_labels"]
    assert ((labels == dv.IGNORE_LABEL) | ((labels >= 0) & (labels < len(DRAFT_IDS)))).all()
    assert (labels == dv.IGNORE_LABEL).any() and (labels >= 0).any()
    assert out.loss.isfinite()


@pytest.mark.parametrize("algo", ["dspark", "eagle3"])
def test_a_few_optimizer_steps_lower_the_loss(target, algo):
    drafter = make(target, algo, anchors_per_seq=6)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=5e-3)
    losses, accept = [], []
    for _ in range(60):
        out = drafter_loss(drafter, target, ids, torch.ones_like(ids), None, torch.Generator().manual_seed(0))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
        accept.append(out.metrics["expected_accept_len"])
    print(f"\n[draft vocab] {algo} loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"expected accept len {accept[0]:.3f} -> {accept[-1]:.3f}")
    # half the vocabulary is left out: the TV term has a floor (the target mass outside the subset)
    assert losses[-1] < 0.85 * losses[0] and accept[-1] > accept[0] + 0.3, (losses, accept)
    assert drafter.d2t.requires_grad is False and torch.equal(drafter.draft_ids, torch.tensor(DRAFT_IDS))


# ---------------------------------------------------------------- checkpoint and export
@pytest.mark.parametrize("algo", ["dspark", "eagle3"])
def test_checkpoint_round_trip_keeps_the_maps(tmp_path, target, algo):
    drafter = make(target, algo)
    save_drafter(drafter, str(tmp_path / "ckpt"))
    stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert stored["d2t"].dtype == torch.long and stored["t2d"].dtype == torch.bool
    assert "draft_ids" not in stored  # derived from d2t on load
    loaded = load_drafter(str(tmp_path / "ckpt"), target=target, dtype=torch.bfloat16)
    assert loaded.config.draft_vocab_size == len(DRAFT_IDS) and loaded.d2t.dtype == torch.long
    assert torch.equal(loaded.draft_ids, torch.tensor(DRAFT_IDS))
    state = drafter.new_state()
    ids = torch.tensor([1, 4, 7, 2])
    feats = features(target, drafter, ids[None])[0]
    other = loaded.to(torch.float32)
    other_state = other.new_state()
    drafter.extend_context(state, feats, ids)
    other.extend_context(other_state, feats, ids)
    sp = SamplingParams()
    a = drafter.propose(state, 3, 4, sp, torch.Generator().manual_seed(0))
    b = other.propose(other_state, 3, 4, sp, torch.Generator().manual_seed(0))
    assert set(b.tokens.tolist()) <= set(DRAFT_IDS) and a.probs.shape == b.probs.shape


def test_corrupt_maps_fail_on_load(tmp_path, target):
    drafter = make(target, "dflash")
    drafter.t2d[1] = True  # token 1 is not in the draft vocabulary
    save_drafter(drafter, str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        load_drafter(str(tmp_path / "bad"), target=target)


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_vllm_export_in_the_speculators_layout(tmp_path, target, algo):
    drafter = make(target, algo)
    export_vllm(drafter, str(tmp_path / "v"), dtype=torch.bfloat16)
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    weights = load_file(str(tmp_path / "v" / "model.safetensors"))
    N = len(DRAFT_IDS)
    assert config["draft_vocab_size"] == N
    d2t, t2d = weights["d2t"], weights["t2d"]
    assert d2t.dtype == torch.long and d2t.shape == (N,) and t2d.dtype == torch.bool
    assert (torch.arange(N) + d2t).tolist() == DRAFT_IDS
    verifier_vocab = config["transformer_layer_config"]["vocab_size"]
    assert t2d.shape == (verifier_vocab,) and int(t2d.sum()) == N  # + a False MASK row when expanded
    assert torch.equal(t2d.nonzero().flatten(), torch.tensor(DRAFT_IDS))
    head = weights["lm_head.weight"]
    assert head.shape == (N, target.hidden_size) and head.dtype == torch.bfloat16
    assert torch.equal(head, target.lm_head.weight.detach()[DRAFT_IDS].to(torch.bfloat16))
    if algo == "dspark":
        assert weights["markov_head.markov_w2.weight"].shape == (N, 8)


# ---------------------------------------------------------------- training job driver
def test_training_job_builds_the_vocab_from_the_rollouts(tmp_path):
    from dspark.drafters.draft_vocab import DraftVocabPlan
    from dspark.training.config import TrainJobConfig
    from jobs.train import build_draft_vocab

    rows = {"split": ["train", "train", "eval"], "input_ids": [[1, 3, 3, 3, 9], [9, 9, 2], [5, 5, 5]],
            "loss_mask": [[0, 1, 1, 1, 1], [1, 1, 1], [1, 1, 1]]}
    pq.write_table(pa.table(rows), tmp_path / "r.parquet")
    base = {"run_name": "v", "target": "tiny", "data": {"rollouts": str(tmp_path / "r.parquet")}}
    full = build_draft_vocab(TrainJobConfig.model_validate(base), [str(tmp_path / "r.parquet")])
    assert full == DraftVocabPlan() and full.ids() is None
    cfg = TrainJobConfig.model_validate({**base, "drafter": {"draft_vocab_size": 3}})
    vocab = build_draft_vocab(cfg, [str(tmp_path / "r.parquet")])
    assert vocab.draft_ids == (2, 3, 9)  # 3 and 9 thrice, then 2 (1 is unsupervised, 5 is eval)
    assert vocab.coverage == 1.0 and torch.equal(vocab.ids(), torch.tensor([2, 3, 9]))
    assert pickle.loads(pickle.dumps(vocab)) == vocab  # it crosses into the Ray Train workers


# ---------------------------------------------------------------- benchmark smoke run
def test_draft_cost_benchmark_quick_run(tmp_path):
    from benchmarks.draft_cost import main

    out = main(["--quick", "--reps", "2", "--warmup", "0", "--out", str(tmp_path / "cost.json")])
    assert json.loads((tmp_path / "cost.json").read_text()) == json.loads(json.dumps(out))
    rows = {r["draft_vocab_size"]: r for r in out["variants"]}
    assert set(rows) == {"full", 256, 64} and out["target_step_ms"] > 0
    for row in rows.values():
        assert row["ratio"] == pytest.approx(row["propose_ms"] / out["target_step_ms"], rel=1e-2)
        assert set(row["breakdown_ms"]) == {"backbone", "lm_head", "sequential"}
    assert rows["full"]["coverage"] == 1.0 and rows[64]["coverage"] <= rows[256]["coverage"] <= 1.0


def test_soft_ce_with_a_draft_vocabulary_targets_the_renormalised_subset(target):
    """Eagle3 as the reference trains it (dense TTT, soft CE) with a draft vocabulary: the soft targets
    are p_t on the subset, renormalised — finite, and a few steps lower the loss."""
    from dspark.training.loss import soft_targets

    p = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(1)), -1)
    ids = torch.tensor(DRAFT_IDS)
    sub = soft_targets(p[:, ids], subset=True)
    assert torch.allclose(sub.sum(-1), torch.ones(3)) and torch.allclose(sub, p[:, ids] / p[:, ids].sum(-1, keepdim=True))
    drafter = make(target, "eagle3", dense_ttt=True, ce_target="soft", position_weight="geometric")
    ids_in = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([q for q in drafter.parameters() if q.requires_grad], lr=5e-3)
    losses = []
    for _ in range(20):
        out = drafter_loss(drafter, target, ids_in, torch.ones_like(ids_in), None, torch.Generator().manual_seed(0))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


# ---------------------------------------------------------------- moving a trained drafter to a new vocabulary
NEW_IDS = [0, 1, 3, 5, 8, 10, 12, 15]  # shares 0, 3, 5, 8, 12, 15 with DRAFT_IDS; 1 and 10 are new


def test_carry_rows_keeps_shared_tokens_and_zeroes_new_ones():
    rows = torch.arange(8.0).unsqueeze(1).repeat(1, 3)  # row i = i: the draft id in the old vocabulary
    moved = dv.carry_rows(rows, dv.t2d_from_ids(torch.tensor(DRAFT_IDS), V), torch.tensor(NEW_IDS))
    expect = [DRAFT_IDS.index(t) if t in DRAFT_IDS else 0.0 for t in NEW_IDS]
    assert moved[:, 0].tolist() == expect and moved.shape == (8, 3)
    assert moved[NEW_IDS.index(1)].abs().sum() == 0 and moved[NEW_IDS.index(10)].abs().sum() == 0


@pytest.mark.parametrize("algo,head", VARIANTS + [("dspark", "none")])
def test_change_draft_vocab_keeps_the_logits_of_shared_tokens(target, algo, head):
    """After the move, every token in both vocabularies has the logit it had; a new token has the frozen
    target head's logit plus a zero sequential bias; the maps and a save/load follow the new ids."""
    drafter = make(target, algo, head)
    with torch.no_grad():
        for p in drafter.parameters():  # non-zero sequential bias, so carrying rows is what is tested
            p.add_(0.05 * torch.randn_like(p))
    n = len(DRAFT_IDS)
    listed = set(drafter.draft_vocab_rows)
    assert listed == {name for name, p in drafter.named_parameters() if p.shape[0] == n}
    ids = torch.randint(0, V, (1, 14), generator=torch.Generator().manual_seed(5))
    args = (features(target, drafter, ids), ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([[6]]),
            torch.ones(1, 1, 4, dtype=torch.bool))
    before = drafter(*args).logits
    drafter.change_draft_vocab(torch.tensor(NEW_IDS))
    after = drafter(*args).logits
    assert drafter.draft_ids.tolist() == NEW_IDS and drafter.t2d.nonzero().flatten().tolist() == NEW_IDS
    for t in set(DRAFT_IDS) & set(NEW_IDS):
        assert torch.allclose(after[:, NEW_IDS.index(t)], before[:, DRAFT_IDS.index(t)], atol=1e-5)
    if listed:
        w2 = drafter.get_parameter(next(iter(listed)))
        assert w2[NEW_IDS.index(1)].abs().sum() == 0 and w2[NEW_IDS.index(10)].abs().sum() == 0


def test_change_draft_vocab_refuses_a_full_vocabulary_drafter_and_a_wrong_size(target):
    full = build_drafter(DrafterConfig(algo="dspark", rank=8, block_size=4, num_layers=1), target)
    with pytest.raises(ValueError, match="full target vocabulary"):
        full.change_draft_vocab(torch.tensor(NEW_IDS))
    with pytest.raises(ValueError):
        make(target, "dspark").change_draft_vocab(torch.tensor(NEW_IDS[:-1]))


def test_a_plan_of_in_memory_rows_holds_the_most_frequent_supervised_tokens():
    """DraftVocabPlan.of_rows: what the GPU recipe, the learning curve and the training benchmarks plan from
    the rows they hold, the same rule jobs.train applies to Parquet rollouts."""
    from dspark.drafters.draft_vocab import DraftVocabPlan

    rows = [([9, 9, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1]),  # 9 is prompt only
            ([3, 2, 1], [0, 1, 1])]
    plan = DraftVocabPlan.of_rows(rows, 2, vocab_size=10)
    assert plan.ids().tolist() == [1, 2] and plan.coverage == 1.0
    assert DraftVocabPlan.of_rows(rows, None, vocab_size=10).ids() is None
