"""Parity of the speculators-format export with the `speculators` library's own model code.

Each drafter is exported (--format speculators) for the tiny target, loaded with speculators 0.9.0's
classes (`SpeculatorModel.from_pretrained`, which also reloads the verifier's embedding, LM head and
norm from the target directory, as its training does), and run on the same target features. Draft
logits, hidden states, DSpark's Markov bias and confidence logits must agree to 1e-4 in fp32.

speculators pins transformers<=5.19 and datasets<=5.1, so it never enters the project environment:
its wheel (and the pure-Python modules it imports that the project does not ship: loguru,
hs-connectors, pydantic-settings with python-dotenv) is downloaded once into $DSPARK_CACHE/wheels and
installed with `pip install --no-deps --target <tmp>`; the test skips, saying why, when PyPI cannot
be reached and the wheels are not cached. Its model modules import under the project's transformers
5.24; one shim (in load_speculators): 5.24 leaves weights missing from a checkpoint uninitialised
where <=5.19 kept speculators' NaN sentinel, so Eagle3's reload-if-NaN of embed_tokens is forced
with speculators' own `_load_verifier_weights(overwrite_embed_tokens=True)`. Its forwards end in a
loss (`compute_metrics`); the test replaces that one function with a recorder of the logits it is
given, so everything before it is speculators' code.

Semantic differences, and what the export or the test does about them:
- layer ids: speculators counts hidden_states index 0 as the embeddings -> aux = our id + 1 (export).
- anchor slot: DFlash slot 0 = anchor (sample_from_anchor=false, block γ+1); DSpark slot 0 predicts
  t+1 and its previous token is the anchor (sample_from_anchor=true, block γ) (export).
- MASK: speculators reloads embed_tokens from the verifier, so a learned MASK vector cannot be
  expressed; the export refuses naming mask_token_id (test below), these drafters use a vocab id.
- Eagle3 entry 0: our context entry 0 is (x_0, zero feature); speculators feeds (x_j, f_j) at
  position j, so the test passes it our pairing (features shifted by one, a zero row first). vLLM's
  EAGLE prefill pairs x_{j+1} with f_j and has no entry for x_0: a served Eagle3 drafter sees one
  context key fewer than in our training/inference (not convertible; named here).
- positions: speculators' Eagle3 counts from 1; RoPE is relative, so outputs are unchanged.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter
from dspark.export import export_drafter
from dspark.models.target import load_target

WHEELS = ("speculators==0.9.0", "loguru==0.7.3", "hs-connectors==0.9.0", "pydantic-settings==2.16.3",
          "python-dotenv==1.2.4")
TOL = 1e-4
T = 24
ANCHORS = [3, 9, 14]


def wheel_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")) / "wheels"


def pip(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def speculators(tmp_path_factory):
    """speculators 0.9.0 importable from a temporary --target dir (never the project venv)."""
    wheels = wheel_dir()
    wheels.mkdir(parents=True, exist_ok=True)
    site = tmp_path_factory.mktemp("speculators-site")
    install = ["install", "-q", "--no-deps", "--no-index", "--find-links", str(wheels), "--target", str(site), *WHEELS]
    if pip(*install).returncode != 0:
        try:
            got = pip("download", "-q", "--no-deps", "-d", str(wheels), *WHEELS)
        except subprocess.TimeoutExpired:
            pytest.skip("speculators 0.9.0 is not cached and PyPI timed out; it is needed for the parity test")
        if got.returncode != 0:
            errors = [line for line in got.stderr.splitlines() if line.startswith("ERROR")] or [got.stderr[-300:]]
            pytest.skip(f"speculators 0.9.0 is not cached under {wheels} and PyPI is unreachable: {errors[-1]}")
        done = pip(*install)
        assert done.returncode == 0, done.stderr
    sys.path.insert(0, str(site))
    try:
        import speculators.models  # noqa: F401  registers dflash/dspark/eagle3

        yield importlib.import_module("speculators.model").SpeculatorModel
    finally:
        sys.path.remove(str(site))


@pytest.fixture(scope="module")
def target():
    return load_target("tiny")


@pytest.fixture(scope="module")
def batch(target):
    ids = torch.randint(0, target.vocab_size, (1, T), generator=torch.Generator().manual_seed(3))
    return ids


def make(target, algo, **kw):
    torch.manual_seed(0)
    base = dict(algo=algo, block_size=4, rank=8, ttt_steps=3, mask_token_id=target.pad_token_id)
    if algo != "eagle3":
        base["num_layers"] = 2
    drafter = build_drafter(DrafterConfig(**{**base, **kw}), target)
    with torch.no_grad():  # norms at 1 hide misplaced norms: make every weight informative
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return drafter.eval()


def load_speculators(SpeculatorModel, path):
    from speculators import SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = "eager"  # CPU: dense masks, no flex attention
    model = SpeculatorModel.from_pretrained(str(path), config=config)
    if type(model).__name__ == "Eagle3DraftModel":
        # Shim (transformers 5.24 vs the <=5.19 speculators pins): weights missing from a checkpoint are
        # now materialised uninitialised instead of keeping speculators' NaN sentinel, so Eagle3's
        # "reload embed_tokens only if NaN" can skip the reload. Reload it with speculators' own helper.
        model._load_verifier_weights(overwrite_embed_tokens=True)
    return model.float().eval()


def assert_verifier_weights(model, target):
    """embed_tokens / lm_head hold the target's rows (full-vocabulary exports)."""
    assert torch.equal(model.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)


class Recorder:
    """Stands in for speculators' compute_metrics: keeps the logits it is handed."""

    def __init__(self, kind: str):
        self.kind, self.calls = kind, []

    def __call__(self, logits, targets, *args, **kwargs):
        conf = args[0] if self.kind == "dspark" else None  # dspark's 3rd argument: confidence logits
        self.calls.append((logits.detach(), None if conf is None else conf.detach()))
        return torch.zeros(()), {}


def record(monkeypatch, module: str, kind: str) -> Recorder:
    rec = Recorder(kind)
    monkeypatch.setattr(importlib.import_module(module), "compute_metrics", rec)
    return rec


def capture(module: torch.nn.Module) -> list:
    out = []
    module.register_forward_hook(lambda m, i, o: out.append(o.detach()))
    return out


def assert_close(ours, theirs, what):
    diff = (ours.float() - theirs.float()).abs().max().item()
    print(f"{what}: max abs diff {diff:.2e}")  # shown with -s: the parity figures
    assert diff <= TOL, f"{what}: max abs diff {diff:.3g} > {TOL}"


def ours_block(drafter, feats, ids):
    """Our teacher-forced training forward at ANCHORS: logits [N, K, V], conf [N, K] and normed hidden."""
    hidden = capture(drafter.norm)
    anchors = torch.tensor([ANCHORS])
    K = drafter.config.train_steps
    with torch.no_grad():
        out = drafter(feats, ids, torch.ones_like(ids, dtype=torch.bool), anchors, torch.ones(1, len(ANCHORS), K,
                                                                                               dtype=torch.bool))
    conf = None if out.conf_logits is None else out.conf_logits.view(len(ANCHORS), K)
    return out.logits.view(len(ANCHORS), K, -1), conf, hidden


def theirs_block(model, monkeypatch, feats, ids, algo):
    """speculators' DFlash/DSpark forward with exactly ANCHORS as the anchors (loss mask = anchors)."""
    rec = record(monkeypatch, f"speculators.models.{algo}.core", algo)
    hidden = capture(model.norm)
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, ANCHORS] = 1  # select_anchors keeps every valid position when max_anchors = their count
    with torch.no_grad():
        model(hidden_states=feats, input_ids=ids, loss_mask=loss_mask,
              verifier_last_hidden_states=torch.zeros(1, T, feats.shape[-1] // len(model.target_layer_ids)),
              document_ids=torch.zeros_like(ids), max_anchors=len(ANCHORS))
    (logits, conf), = rec.calls
    block = model.block_size
    return logits.view(len(ANCHORS), block, -1), None if conf is None else conf.view(len(ANCHORS), block), hidden


BLOCK_VARIANTS = {"dflash": dict(algo="dflash"),
                  "dspark-markov": dict(algo="dspark", head="markov"),
                  "dspark-rnn": dict(algo="dspark", head="rnn"),
                  "dspark-nohead": dict(algo="dspark", head="none")}


@pytest.mark.parametrize("variant", list(BLOCK_VARIANTS))
def test_block_drafter_matches_speculators(tmp_path, monkeypatch, speculators, target, batch, variant):
    kw = BLOCK_VARIANTS[variant]
    drafter = make(target, **kw)
    export_drafter(drafter, str(tmp_path / "export"), "speculators", dtype="fp32")
    model = load_speculators(speculators, tmp_path / "export")
    assert type(model).__name__ == {"dflash": "DFlashDraftModel"}.get(kw["algo"], "DSparkDraftModel")
    assert_verifier_weights(model, target)
    feats = target.forward(batch, layer_ids=drafter.layer_ids, logits_at=None).features
    ours_logits, ours_conf, ours_h = ours_block(drafter, feats, batch)
    theirs_logits, theirs_conf, theirs_h = theirs_block(model, monkeypatch, feats, batch, kw["algo"])
    first = drafter.first_pred_slot  # dflash: slot 0 is the anchor; dspark: the anchor slot predicts
    gamma = drafter.config.block_size
    assert_close(ours_h[0].view(len(ANCHORS), -1, drafter.hidden_size)[:, first:first + gamma],
                 theirs_h[0].view(len(ANCHORS), -1, drafter.hidden_size)[:, first:first + gamma], "hidden")
    assert_close(ours_logits, theirs_logits[:, first:first + gamma], f"{variant} draft logits")
    if getattr(drafter, "confidence_head", None) is not None:
        assert_close(ours_conf, theirs_conf, f"{variant} confidence logits")
    if getattr(drafter, "markov_head", None) is not None:  # the bias on its own, from each side's own hidden states
        prev = batch[0, torch.tensor(ANCHORS).unsqueeze(-1) + torch.arange(gamma)]  # x_{k-1} = token t+k-1
        h = ours_h[0].view(len(ANCHORS), gamma, -1)
        with torch.no_grad():
            ours_bias = drafter.markov_head.block_bias(drafter.prev_embed(prev), h)
            theirs_bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=theirs_h[0].view_as(h))
        assert_close(ours_bias, theirs_bias, f"{variant} Markov bias")


def test_eagle3_matches_speculators(tmp_path, monkeypatch, speculators, target, batch):
    drafter = make(target, "eagle3")
    export_drafter(drafter, str(tmp_path / "export"), "speculators", dtype="fp32")
    model = load_speculators(speculators, tmp_path / "export")
    assert type(model).__name__ == "Eagle3DraftModel"
    assert_verifier_weights(model, target)
    feats = target.forward(batch, layer_ids=drafter.layer_ids, logits_at=None).features
    ours_logits, _, _ = ours_block(drafter, feats, batch)  # [N, K, V]: step k of anchor t predicts t+k+1
    rec = record(monkeypatch, "speculators.models.eagle3.core", "eagle3")
    shifted = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)  # our entry j: (x_j, f_{j-1})
    with torch.no_grad():
        model(hidden_states=shifted, input_ids=batch, document_ids=torch.zeros_like(batch),
              verifier_last_hidden_states=torch.zeros(1, T, drafter.hidden_size), ttt_steps=drafter.config.ttt_steps)
    assert len(rec.calls) == drafter.config.ttt_steps
    for k, (logits, _) in enumerate(rec.calls):  # their step k at position t = our step k of anchor t
        assert_close(ours_logits[:, k], logits[0, ANCHORS], f"eagle3 step {k} logits")


def test_learned_mask_is_refused_for_speculators_naming_the_field(tmp_path, target):
    drafter = make(target, "dspark", mask_token_id=None)
    with pytest.raises(ValueError, match="mask_token_id"):
        export_drafter(drafter, str(tmp_path / "x"), "speculators", dtype="fp32")
    assert not (tmp_path / "x").exists()


def load_like_vllm(path, target):
    """A vllm-flavor export in speculators' modules, loaded by vLLM's rules: the checkpoint's
    embed_tokens when it has one (its expanded input vocabulary included), else the target's; the
    target's LM head. Every exported tensor must land on a parameter of the same shape."""
    import json

    from safetensors.torch import load_file
    from speculators import SpeculatorModelConfig
    from speculators.model import SpeculatorModel

    config = SpeculatorModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    config.transformer_layer_config._attn_implementation = "eager"
    config.speculators_config.verifier.name_or_path = None  # vLLM shares the target's weights itself
    model = SpeculatorModel.registered_model_class_from_config(config)(config)
    weights = load_file(str(path / "model.safetensors"))
    own = model.state_dict()
    assert all(own[k].shape == v.shape for k, v in weights.items()), {k: v.shape for k, v in weights.items()}
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        if "embed_tokens.weight" not in weights:
            model.embed_tokens.weight.copy_(target.embed_tokens.weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
    return model.float().eval()


@pytest.mark.parametrize("algo", ["dflash", "dspark"])
def test_learned_mask_vllm_export_matches_speculators_modules(tmp_path, monkeypatch, speculators, target, batch,
                                                              algo):
    """The tiny tokenizer reserves no id, so the learned MASK becomes an added embedding row V."""
    drafter = make(target, algo, mask_token_id=None)
    export_drafter(drafter, str(tmp_path / "export"), "vllm", dtype="fp32")
    model = load_like_vllm(tmp_path / "export", target)
    V = target.vocab_size
    assert model.config.mask_token_id == V and model.embed_tokens.weight.shape[0] == V + 1
    feats = target.forward(batch, layer_ids=drafter.layer_ids, logits_at=None).features
    ours_logits, ours_conf, _ = ours_block(drafter, feats, batch)
    theirs_logits, theirs_conf, _ = theirs_block(model, monkeypatch, feats, batch, algo)
    first, gamma = drafter.first_pred_slot, drafter.config.block_size
    assert_close(ours_logits, theirs_logits[:, first:first + gamma], f"{algo} learned-MASK draft logits")
    if algo == "dspark":
        assert_close(ours_conf, theirs_conf, "dspark learned-MASK confidence logits")
