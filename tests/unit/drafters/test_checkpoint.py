"""Drafter checkpoints (save -> load is exact, target verified, s3 path) and the vLLM export."""
import json
import os
import shutil
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from dspark.drafters import DrafterConfig, build_drafter, load_drafter, save_drafter
from dspark.export.vllm import export_vllm
from tests.tiny_models import build_tiny_model

VARIANTS = [("dflash", "markov"), ("dspark", "markov"), ("dspark", "rnn"), ("eagle3", "markov")]


@pytest.fixture(scope="module")
def target():
    return build_tiny_model(vocab_size=16)


def make(target, algo, head="markov", **kw):
    torch.manual_seed(0)
    if algo != "eagle3":
        kw.setdefault("num_layers", 2)
    return build_drafter(DrafterConfig(algo=algo, head=head, rank=8, block_size=4, ttt_steps=3, **kw), target)


def train_logits(drafter, target):
    ids = torch.randint(0, 16, (1, 12), generator=torch.Generator().manual_seed(1))
    feats = target.forward(ids, layer_ids=drafter.layer_ids, logits_at=None).features
    K = drafter.config.train_steps
    with torch.no_grad():
        out = drafter(feats, ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([[3, 7]]),
                      torch.ones(1, 2, K, dtype=torch.bool))
    return out.logits, out.conf_logits


@pytest.mark.parametrize("algo,head", VARIANTS)
def test_save_load_round_trip_is_exact(tmp_path, target, algo, head):
    drafter = make(target, algo, head)
    drafter.calibration = [1.5, 1.0, 0.8, 1.2]
    drafter.draft_temperature = 0.7
    save_drafter(drafter, str(tmp_path / "ckpt"))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.json", "model.safetensors"]
    loaded = load_drafter(str(tmp_path / "ckpt"), target=target)
    assert type(loaded) is type(drafter) and loaded.config == drafter.config
    assert loaded.target_meta == drafter.target_meta and loaded.calibration == drafter.calibration
    assert loaded.draft_temperature == 0.7
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (la, ca), (lb, cb) = train_logits(drafter, target), train_logits(loaded, target)
    assert torch.equal(la, lb) and (ca is None or torch.equal(ca, cb))
    stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert stored.keys() == a.keys()  # drafter weights only: no embedding / LM head of the target
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["format"] == "dspark-drafter" and config["format_version"] == 1
    assert config["target_meta"]["layer_ids"] == drafter.layer_ids and config["algo"] == algo


def test_load_without_target_then_attach(tmp_path, target):
    drafter = make(target, "dspark")
    save_drafter(drafter, str(tmp_path / "c"))
    loaded = load_drafter(str(tmp_path / "c"))
    with pytest.raises(RuntimeError, match="no target attached"):
        train_logits(loaded, target)
    loaded.attach_target(target)
    assert torch.equal(train_logits(loaded, target)[0], train_logits(drafter, target)[0])


def test_load_rejects_a_different_target(tmp_path, target):
    save_drafter(make(target, "dspark"), str(tmp_path / "c"))
    with pytest.raises(ValueError, match="vocab_size 16 != 32"):
        load_drafter(str(tmp_path / "c"), target=build_tiny_model(vocab_size=32))
    other_seed = build_tiny_model(vocab_size=16, seed=1)
    with pytest.raises(ValueError, match="check_name=False"):
        load_drafter(str(tmp_path / "c"), target=other_seed)
    assert load_drafter(str(tmp_path / "c"), target=other_seed, check_name=False).target is other_seed
    with pytest.raises(FileNotFoundError, match="not a dspark drafter checkpoint"):
        load_drafter(str(tmp_path / "missing"))


def test_save_and_load_through_s3_uris(tmp_path, target, monkeypatch):
    """s3:// goes through dspark.io (drafter_source -> storage.upload_dir / local_copy; a local fake
    stands in for S3); the drafters package itself only takes local directories."""
    from dspark.io import drafter_source

    bucket = tmp_path / "bucket"

    def local(uri):
        return str(bucket / uri.removeprefix("s3://"))

    fake = types.SimpleNamespace(upload_dir=lambda src, uri: shutil.copytree(src, local(uri)),
                                 local_copy=local, is_s3=lambda uri: uri.startswith("s3://"))
    monkeypatch.setattr("dspark.io.storage", fake, raising=False)
    monkeypatch.setitem(sys.modules, "dspark.io.storage", fake)
    drafter = make(target, "dspark")
    drafter_source.save_drafter_to(drafter, "s3://dspark/ckpts/run1")
    assert (bucket / "dspark/ckpts/run1/model.safetensors").exists()
    loaded = load_drafter(local("s3://dspark/ckpts/run1"), target=target)
    assert torch.equal(train_logits(loaded, target)[0], train_logits(drafter, target)[0])
    with pytest.raises(ValueError, match="drafter_source.save_drafter_to"):
        save_drafter(drafter, "s3://dspark/ckpts/run2")
    with pytest.raises(ValueError, match="drafter_source.load_drafter_ref"):
        load_drafter("s3://dspark/ckpts/run1", target=target)


# ---------------------------------------------------------------- vLLM export
def read_export(path):
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("algo", ["dflash", "dspark", "eagle3"])
def test_export_writes_every_weight_and_config_field(tmp_path, target, algo):
    drafter = make(target, algo)
    drafter.calibration = [1.0, 1.1, 1.2, 1.3]
    export_vllm(drafter, str(tmp_path / "vllm"))
    config, weights = read_export(tmp_path / "vllm")
    own = {k.replace("midlayer.", "layers.0.", 1): v for k, v in drafter.state_dict().items()}
    expected = set(own) - {"mask_embedding"}
    assert expected <= set(weights)
    for name in expected - {"markov_head.markov_w1.weight"}:
        assert torch.equal(weights[name], own[name]), name
    V, d, ids = target.vocab_size, target.hidden_size, drafter.layer_ids
    spec = config["speculators_config"]
    assert config["speculators_model_type"] == spec["algorithm"] == algo
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"]["name_or_path"] == target.name
    layer = config["transformer_layer_config"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "rope_parameters"):
        assert key in layer, key
    assert layer["hidden_size"] == d and layer["num_hidden_layers"] == drafter.config.depth
    assert config["draft_vocab_size"] == V and config["target_hidden_size"] == d
    assert config["dspark_calibration"] == drafter.calibration
    if algo == "eagle3":
        assert layer["model_type"] == "llama" and config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]
        assert config["norm_before_residual"] is True
        assert set(weights) == expected
        return
    # learned MASK -> expanded input vocabulary: row V of embed_tokens is the MASK vector
    assert layer["model_type"] == "qwen3" and layer["vocab_size"] == V + 1 and config["mask_token_id"] == V
    assert torch.equal(weights["embed_tokens.weight"][:V], target.embed_tokens.weight)
    assert torch.equal(weights["embed_tokens.weight"][V], own["mask_embedding"])
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in ids]
    assert set(weights) == expected | {"embed_tokens.weight"}
    if algo == "dflash":
        assert config["block_size"] == 5  # anchor + γ masks
    else:
        assert config["block_size"] == 4 and config["sample_from_anchor"] is True
        assert config["markov_rank"] == 8 and config["markov_head_type"] == "vanilla"
        assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
        w1 = weights["markov_head.markov_w1.weight"]
        assert w1.shape == (V + 1, 8) and torch.equal(w1[:V], own["markov_head.markov_w1.weight"])


def test_export_with_a_vocab_mask_token_writes_no_embedding(tmp_path, target):
    drafter = make(target, "dspark", mask_token_id=3)
    export_vllm(drafter, str(tmp_path / "v"))
    config, weights = read_export(tmp_path / "v")
    assert config["mask_token_id"] == 3 and config["transformer_layer_config"]["vocab_size"] == 16
    assert "embed_tokens.weight" not in weights and set(weights) == set(drafter.state_dict())


def test_export_fails_loudly_on_unmapped_weights(tmp_path, target):
    with pytest.raises(ValueError, match="joint_proj"):
        export_vllm(make(target, "dspark", "rnn"), str(tmp_path / "rnn"))
    drafter = make(target, "dflash")
    drafter.register_parameter("extra_scale", torch.nn.Parameter(torch.ones(1)))
    with pytest.raises(ValueError, match="extra_scale"):
        export_vllm(drafter, str(tmp_path / "extra"))
    with pytest.raises(ValueError, match="cannot be exported as vLLM eagle3"):
        export_vllm(make(target, "dflash"), str(tmp_path / "x"), method="eagle3")
    assert not (tmp_path / "rnn").exists() and not (tmp_path / "extra").exists()


def test_draft_temperature_defaults_to_one_and_rejects_bad_values(tmp_path, target):
    save_drafter(make(target, "dspark"), str(tmp_path / "ckpt"))
    path = tmp_path / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    assert config["draft_temperature"] == 1.0
    del config["draft_temperature"]  # a checkpoint written before the field existed
    path.write_text(json.dumps(config))
    assert load_drafter(str(tmp_path / "ckpt")).draft_temperature == 1.0
    for bad in (0, -1.0, "hot", True):
        path.write_text(json.dumps({**config, "draft_temperature": bad}))
        with pytest.raises(ValueError, match="draft_temperature .* must be a number > 0"):
            load_drafter(str(tmp_path / "ckpt"))


def test_a_corrupt_drafter_checkpoint_fails_naming_the_file_and_what_is_wrong(target, tmp_path):
    """A tensor of the wrong shape, a truncated weights file, a missing one, another target: one ValueError
    each, naming the checkpoint and the problem (not a raw state-dict traceback)."""
    from safetensors.torch import save_file

    path = save_drafter(make(target, "dspark"), str(tmp_path / "d"))
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    name = next(k for k, v in state.items() if v.dim() == 2)
    save_file({**state, name: state[name][:, :-1].contiguous()}, weights)
    with pytest.raises(ValueError, match=f"{path}: model.safetensors does not match its config.json.*{name}"):
        load_drafter(path, target)
    save_file(state, weights)
    whole = open(weights, "rb").read()
    open(weights, "wb").write(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=f"{path}: model.safetensors is unreadable.*corrupt or truncated"):
        load_drafter(path, target)
    os.remove(weights)
    with pytest.raises(ValueError, match=f"{path}: model.safetensors is missing"):
        load_drafter(path, target)
    other = save_drafter(make(build_tiny_model(vocab_size=24), "dspark"), str(tmp_path / "other"))
    with pytest.raises(ValueError, match="trained for another target.*vocab_size 24 != 16"):
        load_drafter(other, target)
