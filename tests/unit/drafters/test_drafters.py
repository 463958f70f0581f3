"""Drafter architecture tests on a micro target (vocabulary 16): attention masks, anchor sampling,
train/inference agreement, the sequential heads, calibration, and a learning-signal smoke per algo."""
import pytest
import torch

from dspark.drafters.anchors import block_mask, eligible_anchors, packed_mask, sample_anchors
from dspark.drafters import DrafterConfig, build_drafter
from dspark.decoding.sampling import SamplingParams, to_probs
from dspark.training.loss import drafter_loss
from tests.tiny_models import build_tiny_model

VARIANTS = [("dflash", "markov"), ("dspark", "markov"), ("dspark", "rnn"), ("eagle3", "markov")]


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=16)


def make(target, algo="dspark", head="markov", seed=0, **kw):
    torch.manual_seed(seed)
    if algo != "eagle3":
        kw.setdefault("num_layers", 2)
    return build_drafter(DrafterConfig(algo=algo, head=head, rank=8, block_size=4, ttt_steps=4, **kw), target)


def features(target, drafter, ids):
    return target.forward(ids, layer_ids=drafter.layer_ids, logits_at=None).features


# ---------------------------------------------------------------- anchors and masks
def test_block_mask_matches_rule_on_hand_example():
    # T = 5 context positions (position 4 is padding), two blocks of 2 slots anchored at t = 1 and t = 3
    anchors, ctx_valid = torch.tensor([[1, 3]]), torch.tensor([[1, 1, 1, 1, 0]])
    m = block_mask(anchors, ctx_valid, block_len=2)[0, 0].int().tolist()
    #        ctx 0 1 2 3 4 | block a0 a0 a1 a1
    assert m == [[1, 0, 0, 0, 0, 1, 1, 0, 0],  # block a0 (t=1): context < 1, its own block both ways
                 [1, 0, 0, 0, 0, 1, 1, 0, 0],
                 [1, 1, 1, 0, 0, 0, 0, 1, 1],  # block a1 (t=3): context 0..2, never the anchor's own position 3
                 [1, 1, 1, 0, 0, 0, 0, 1, 1]]
    causal = block_mask(anchors, ctx_valid, block_len=2, causal=True)[0, 0].int().tolist()
    assert causal[0][5:] == [1, 0, 0, 0] and causal[1][5:] == [1, 1, 0, 0]


def test_packed_mask_step_queries():
    # eagle3 step 2: one query per block, keys = context + steps 1..2 of both blocks (step-major)
    anchors = torch.tensor([[2, 4]])
    q = torch.arange(2)
    m = packed_mask(anchors, torch.ones(1, 5), q, torch.full_like(q, 1), q.repeat(2),
                    torch.arange(2).repeat_interleave(2), causal=True)[0, 0].int().tolist()
    assert m == [[1, 1, 0, 0, 0, 1, 0, 1, 0], [1, 1, 1, 1, 0, 0, 1, 0, 1]]


def test_anchor_sampling_rule_and_determinism():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]])
    attention = torch.ones_like(loss_mask)
    assert eligible_anchors(loss_mask, attention).nonzero().tolist() == [[0, 1], [0, 2], [0, 5], [1, 0]]
    a1, v1 = sample_anchors(loss_mask, attention, 2, torch.Generator().manual_seed(3))
    a2, v2 = sample_anchors(loss_mask, attention, 2, torch.Generator().manual_seed(3))
    assert torch.equal(a1, a2) and torch.equal(v1, v2)
    assert v1.tolist() == [[True, True], [True, False]]
    assert set(a1[0].tolist()) <= {1, 2, 5} and a1[0, 0] < a1[0, 1] and a1[1, 0] == 0
    everything, _ = sample_anchors(loss_mask, attention, 10, None)
    assert everything.tolist() == [[1, 2, 5], [0, 0, 0]]


# ---------------------------------------------------------------- inference = training math
@pytest.mark.parametrize("t", [0, 6])
@pytest.mark.parametrize("algo,head", VARIANTS)
def test_proposal_probs_equal_teacher_forced_training_probs(target, algo, head, t):
    """Incremental drafting (cached context K/V, two extend calls) gives exactly the distributions the
    packed training forward computes for the same anchor when the drafted tokens are teacher-forced
    (t = 0: empty context)."""
    drafter = make(target, algo, head)
    ids = torch.randint(0, 16, (1, 14), generator=torch.Generator().manual_seed(5))
    feats = features(target, drafter, ids)
    state = drafter.new_state()
    cut = min(3, t)
    drafter.extend_context(state, feats[0, :cut], ids[0, :cut])
    drafter.extend_context(state, feats[0, cut:t], ids[0, cut:t])
    assert state.length == t
    proposal = drafter.propose(state, int(ids[0, t]), 4, SamplingParams(), torch.Generator().manual_seed(1))
    forced = ids.clone()
    forced[0, t + 1:t + 5] = proposal.tokens
    K = drafter.config.train_steps
    out = drafter(features(target, drafter, forced), forced, torch.ones_like(forced, dtype=torch.bool),
                  torch.tensor([[t]]), torch.ones(1, 1, K, dtype=torch.bool))
    assert torch.allclose(torch.softmax(out.logits[:4], -1), proposal.probs, atol=1e-5)
    if algo == "dspark":
        assert torch.allclose(torch.sigmoid(out.conf_logits[:4]), proposal.confidences, atol=1e-5)
    else:
        assert proposal.confidences is None


@pytest.mark.parametrize("algo", ["dflash", "eagle3"])
def test_context_may_be_extended_in_any_chunks(target, algo):
    drafter = make(target, algo)
    ids = torch.randint(0, 16, (1, 9), generator=torch.Generator().manual_seed(2))
    feats = features(target, drafter, ids)
    one, many = drafter.new_state(), drafter.new_state()
    drafter.extend_context(one, feats[0, :8], ids[0, :8])
    for lo, hi in [(0, 1), (1, 5), (5, 5), (5, 8)]:
        drafter.extend_context(many, feats[0, lo:hi], ids[0, lo:hi])
    sp = SamplingParams()
    a = drafter.propose(one, int(ids[0, 8]), 3, sp, torch.Generator().manual_seed(0))
    b = drafter.propose(many, int(ids[0, 8]), 3, sp, torch.Generator().manual_seed(0))
    assert one.length == many.length == 8
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.probs, b.probs, atol=1e-6)


@pytest.mark.parametrize("algo", ["dflash", "dspark", "eagle3"])
def test_extend_contexts_equals_one_extend_context_per_request(target, algo):
    """The engine's batched catch-up: R requests (held contexts and new chunks of different lengths,
    one empty) in one call give the same states as extend_context request by request."""
    drafter = make(target, algo)
    ids = torch.randint(0, 16, (3, 10), generator=torch.Generator().manual_seed(5))
    feats = features(target, drafter, ids)
    held, new = [2, 0, 5], [(2, 9), (0, 0), (5, 6)]
    batched, single = [drafter.new_state() for _ in range(3)], [drafter.new_state() for _ in range(3)]
    for r in range(3):
        for states in (batched, single):
            drafter.extend_context(states[r], feats[r, :held[r]], ids[r, :held[r]])
    drafter.extend_contexts(batched, [feats[r, lo:hi] for r, (lo, hi) in enumerate(new)],
                            [ids[r, lo:hi] for r, (lo, hi) in enumerate(new)])
    for r, (lo, hi) in enumerate(new):
        drafter.extend_context(single[r], feats[r, lo:hi], ids[r, lo:hi])
    for a, b in zip(batched, single):
        assert a.length == b.length
        for buf_a, buf_b in zip(a.kv, b.kv):
            like = torch.empty(drafter.config.num_kv_heads, 0, drafter.config.head_dim)
            for x, y in zip(buf_a.view(like), buf_b.view(like)):
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


def test_dflash_cannot_see_the_anchor_position_or_later(target):
    """Changing target features at or after the anchor leaves the block's logits unchanged."""
    drafter = make(target, "dflash")
    ids = torch.randint(0, 16, (1, 12), generator=torch.Generator().manual_seed(4))
    feats = features(target, drafter, ids)
    changed = feats.clone()
    changed[0, 5:] += 3.0
    sel = torch.ones(1, 1, 4, dtype=torch.bool)
    valid = torch.ones_like(ids, dtype=torch.bool)
    a = drafter(feats, ids, valid, torch.tensor([[5]]), sel).logits
    b = drafter(changed, ids, valid, torch.tensor([[5]]), sel).logits
    c = drafter(changed, ids, valid, torch.tensor([[6]]), sel).logits
    assert torch.allclose(a, b) and not torch.allclose(drafter(feats, ids, valid, torch.tensor([[6]]), sel).logits, c)


# ---------------------------------------------------------------- sequential heads
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_sequential_head_conditions_second_token_on_first(target, head):
    drafter = make(target, "dspark", head)
    u = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    h = torch.randn(4, drafter.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits_a, _ = drafter.sequential_logits(u, h, torch.tensor([7, 2, 5, 9]))
        logits_b, _ = drafter.sequential_logits(u, h, torch.tensor([7, 3, 5, 9]))  # only x_1 differs
    assert torch.allclose(logits_a[0], logits_b[0])  # position 1 depends on the anchor only
    assert not torch.allclose(logits_a[1], logits_b[1], atol=1e-4)  # position 2 depends on x_1
    if head == "markov":  # B(x_1, ·) = W1[x_1]·W2 exactly, and the head is first-order
        w = drafter.markov_head
        assert torch.allclose(logits_a[1] - u[1], w.markov_w2(w.markov_w1(torch.tensor(2))), atol=1e-6)
        assert torch.allclose(logits_a[2], logits_b[2])
    else:  # the recurrent state carries x_1 further along the block
        assert not torch.allclose(logits_a[2], logits_b[2], atol=1e-6)


def test_propose_samples_left_to_right_from_exact_processed_probs(target):
    drafter = make(target, "dspark", "markov")
    ids = torch.randint(0, 16, (1, 8), generator=torch.Generator().manual_seed(8))
    state = drafter.new_state()
    drafter.extend_context(state, features(target, drafter, ids)[0, :7], ids[0, :7])
    sp = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
    p = drafter.propose(state, int(ids[0, 7]), 4, sp, torch.Generator().manual_seed(0))
    h = drafter.block_hidden(state, int(ids[0, 7]))
    with torch.no_grad():
        logits, conf = drafter.sequential_logits(drafter.lm_logits(h), h, torch.cat([ids[0, 7:8], p.tokens[:-1]]))
    assert torch.allclose(p.probs, to_probs(logits, sp), atol=1e-6)
    assert torch.allclose(p.confidences, torch.sigmoid(conf), atol=1e-6)
    assert bool((p.probs[torch.arange(4), p.tokens] > 0).all()) and bool(((p.probs > 0).sum(-1) <= 3).all())
    greedy = drafter.propose(state, int(ids[0, 7]), 4, SamplingParams(temperature=0))
    assert torch.equal(greedy.probs.argmax(-1), greedy.tokens) and torch.equal(greedy.probs.sum(-1), torch.ones(4))


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_shorter_gamma_truncates_the_block(target, algo):
    drafter = make(target, algo)
    ids = torch.randint(0, 16, (1, 6), generator=torch.Generator().manual_seed(9))
    state = drafter.new_state()
    drafter.extend_context(state, features(target, drafter, ids)[0, :5], ids[0, :5])
    sp = SamplingParams(temperature=0)
    full = drafter.propose(state, int(ids[0, 5]), 4, sp)
    short = drafter.propose(state, int(ids[0, 5]), 2, sp)
    assert torch.equal(short.tokens, full.tokens[:2]) and torch.allclose(short.probs, full.probs[:2])
    with pytest.raises(ValueError, match="block_size"):
        drafter.propose(state, int(ids[0, 5]), 5, sp)


def test_calibration_temperatures_scale_confidence_logits(target):
    drafter = make(target, "dspark")
    ids = torch.randint(0, 16, (1, 6), generator=torch.Generator().manual_seed(3))
    state = drafter.new_state()
    drafter.extend_context(state, features(target, drafter, ids)[0, :5], ids[0, :5])
    sp = SamplingParams(temperature=0)
    raw = drafter.propose(state, int(ids[0, 5]), 4, sp).confidences
    drafter.calibration = [2.0, 1.0, 0.5, 4.0]
    cal = drafter.propose(state, int(ids[0, 5]), 4, sp).confidences
    logit = torch.logit(raw)
    assert torch.allclose(cal, torch.sigmoid(logit / torch.tensor([2.0, 1.0, 0.5, 4.0])), atol=1e-5)


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_propose_batch_equals_sequential_proposals(target, algo):
    """Greedy: the batched pass gives each request exactly its own proposal (tests/test_propose_batch.py
    covers sampling, mixed params and gammas)."""
    drafter = make(target, algo)
    ids = torch.randint(0, 16, (2, 7), generator=torch.Generator().manual_seed(6))
    feats = features(target, drafter, ids)
    states = [drafter.new_state() for _ in range(2)]
    for b, n in enumerate([4, 6]):
        drafter.extend_context(states[b], feats[b, :n], ids[b, :n])
    sp = SamplingParams(temperature=0)
    batch = drafter.propose_batch(states, [int(ids[0, 4]), int(ids[1, 6])], 3, sp)
    one = [drafter.propose(states[0], int(ids[0, 4]), 3, sp), drafter.propose(states[1], int(ids[1, 6]), 3, sp)]
    for x, y in zip(batch, one):
        assert torch.equal(x.tokens, y.tokens) and torch.allclose(x.probs, y.probs)


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_target_weights_are_shared_not_owned(target, algo):
    drafter = make(target, algo)
    own = {id(p) for p in drafter.parameters()}
    assert not own & {id(p) for p in target.model.parameters()}
    assert not any("embed_tokens" in k or "lm_head" in k for k in drafter.state_dict())
    shared = [target.embed_tokens.weight, target.lm_head.weight]
    assert not any(v.shape == w.shape and torch.equal(v, w) for v in drafter.state_dict().values() for w in shared)
    assert drafter.target is target


def test_config_errors_are_clear(target):
    with pytest.warns(UserWarning, match="exactly one decoder layer"):
        assert build_drafter(DrafterConfig(algo="eagle3", num_layers=3), target).config.num_layers == 1
    with pytest.raises(ValueError, match="do not exist"):
        build_drafter(DrafterConfig(target_layer_ids=[0, 1, 9]), target)
    with pytest.raises(ValueError, match="num_context_layers"):
        DrafterConfig(target_layer_ids=[0, 1])


# ---------------------------------------------------------------- learning signal
@pytest.mark.parametrize("algo,head", VARIANTS)
def test_a_few_optimizer_steps_lower_the_loss(target, algo, head):
    drafter = make(target, algo, head, anchors_per_seq=6)
    ids = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :3] = 0
    attention = torch.ones_like(ids)
    attention[1, 13:] = 0
    opt = torch.optim.AdamW(drafter.parameters(), lr=5e-3)
    losses = []
    for _ in range(20):
        out = drafter_loss(drafter, target, ids, loss_mask, attention, torch.Generator().manual_seed(0))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert out.metrics["n_anchors"] == 12 and out.metrics["n_supervised"] > 0
    assert losses[-1] < 0.85 * losses[0], losses
    assert all(p.grad is None for p in target.model.parameters())
