"""Export as a first-class step: `dspark export`, the SGLang layouts (checked against what SGLang's
loaders read), the MASK placement rules, reduced vocabularies and refusals that name the field.
Numerical parity with the engines' model code is in tests/test_export_parity.py."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file

from dspark.cli import main
from dspark.drafters import DrafterConfig, build_drafter, save_drafter
from dspark.export.vllm import ExportError, export_vllm
from dspark.export import export_drafter
from dspark.models.target import load_target
from dspark.config import read_yaml
from tests.mlflow_store import new_sqlite_store
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def micro():
    return build_tiny_model(vocab_size=16, num_layers=6)


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny")


def make(target, algo, draft_ids=None, **kw):
    torch.manual_seed(0)
    base = dict(algo=algo, block_size=4, rank=8, ttt_steps=3) if "block_size" not in kw else dict(algo=algo)
    base["mask_token_id"] = None  # these tests place a learned MASK; the library default (auto) is tested below
    if algo != "eagle3":
        base["num_layers"] = 2
    return build_drafter(DrafterConfig(**{**base, **kw}), target, draft_ids=draft_ids)


def read(path):
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


# ---------------------------------------------------------------- CLI
def test_cli_exports_a_saved_drafter_in_every_format_it_fits(tmp_path, tiny, capsys):
    drafter = make(tiny, "dflash", mask_token_id=tiny.pad_token_id)
    src = save_drafter(drafter, str(tmp_path / "ckpt"))
    for fmt in ("vllm", "speculators", "sglang"):
        assert main(["export", "--format", fmt, src, str(tmp_path / fmt)]) == 0
        assert capsys.readouterr().out.strip() == str(tmp_path / fmt)
    vllm, _ = read(tmp_path / "vllm")
    assert vllm["speculators_model_type"] == "dflash" and vllm["aux_hidden_state_layer_ids"] == [
        i + 1 for i in drafter.layer_ids]
    assert vllm["speculators_config"]["verifier"]["name_or_path"] == tiny.model.name_or_path  # openable dir
    sglang, _ = read(tmp_path / "sglang")
    assert sglang["architectures"] == ["DFlashDraftModel"]


def test_cli_resolves_a_registered_model_reference(tmp_path, tiny, monkeypatch, capsys):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", new_sqlite_store(tmp_path))
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    drafter = make(tiny, "dspark")
    src = save_drafter(drafter, str(tmp_path / "ckpt"))
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    mlflow.create_experiment("exp", artifact_location=(tmp_path / "artifacts").as_uri())
    with mlflow.start_run(experiment_id=mlflow.get_experiment_by_name("exp").experiment_id) as run:
        mlflow.log_artifacts(src, "drafter")
    client = mlflow.MlflowClient()
    client.create_registered_model("export-test")
    client.create_model_version("export-test", f"runs:/{run.info.run_id}/drafter", run.info.run_id)
    assert main(["export", "--format", "vllm", "--dtype", "fp32", "models:/export-test/1", str(tmp_path / "out")]) == 0
    cfg, weights = read(tmp_path / "out")
    assert cfg["speculators_model_type"] == "dspark" and cfg["mask_token_id"] == tiny.vocab_size  # added row
    assert torch.equal(weights["embed_tokens.weight"][-1], drafter.mask_embedding.detach())


def test_cli_refusal_names_the_field_and_exits_1(tmp_path, tiny, capsys):
    src = save_drafter(make(tiny, "dspark"), str(tmp_path / "ckpt"))  # learned MASK vector
    assert main(["export", "--format", "speculators", src, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "error: mask_token_id: this drafter learned its own MASK" in err and not (tmp_path / "out").exists()
    assert main(["export", "--format", "sglang", src, str(tmp_path / "out")]) == 1
    assert "error: mask_token_id: SGLang's DSpark embeds" in capsys.readouterr().err
    assert main(["export", "--format", "vllm", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "drafter directory not found" in capsys.readouterr().err


# ---------------------------------------------------------------- SGLang layouts
def eagle3_loader_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The parameters SGLang's LlamaForCausalLMEagle3.load_weights fills from the checkpoint, by the
    checkpoint names it accepts (q/k/v and gate/up are separate tensors it stacks), for this config."""
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    return {"fc.weight": (d, 3 * cfg["target_hidden_size"]), "norm.weight": (d,),
            "midlayer.input_layernorm.weight": (d,), "midlayer.hidden_norm.weight": (d,),
            "midlayer.post_attention_layernorm.weight": (d,),
            "midlayer.self_attn.q_proj.weight": (q, 2 * d), "midlayer.self_attn.k_proj.weight": (kv, 2 * d),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * d), "midlayer.self_attn.o_proj.weight": (d, q),
            "midlayer.mlp.gate_proj.weight": (inter, d), "midlayer.mlp.up_proj.weight": (inter, d),
            "midlayer.mlp.down_proj.weight": (d, inter)}


def dflash_loader_shapes(cfg: dict, m: int) -> dict[str, tuple[int, ...]]:
    """SGLang DFlashDraftModel's parameters (checkpoint names) for this config with m context layers."""
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    out = {"fc.weight": (d, m * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                    p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                    p + "mlp.down_proj.weight": (d, inter)})
    return out


def test_sglang_eagle3_layout_is_what_its_loader_reads(tmp_path, tiny):
    drafter = make(tiny, "eagle3")
    drafter.calibration = None
    export_drafter(drafter, str(tmp_path / "s"), "sglang", dtype="fp32")
    cfg, weights = read(tmp_path / "s")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert "draft_vocab_size" not in cfg  # absent -> the loader shares the target's LM head
    assert cfg["vocab_size"] == tiny.vocab_size and cfg["target_hidden_size"] == tiny.hidden_size
    # SGLang's capture hook adds 1 itself: the ids stay ours (output of decoder layer i)
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": drafter.layer_ids, "use_aux_hidden_state": True}
    assert {k: tuple(v.shape) for k, v in weights.items()} == eagle3_loader_shapes(cfg)
    own = drafter.state_dict()
    assert all(torch.equal(weights[k], own[k]) for k in weights)


def test_sglang_dflash_layout_is_what_its_loader_reads(tmp_path, tiny):
    drafter = make(tiny, "dflash", mask_token_id=tiny.pad_token_id)
    export_drafter(drafter, str(tmp_path / "s"), "sglang")
    cfg, weights = read(tmp_path / "s")
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"target_layer_ids": drafter.layer_ids, "block_size": 5,
                                    "mask_token_id": tiny.pad_token_id}  # anchor + γ masks
    assert cfg["num_target_layers"] == tiny.num_layers and cfg["hidden_act"] == "silu"
    assert {k: tuple(v.shape) for k, v in weights.items()} == dflash_loader_shapes(cfg, len(drafter.layer_ids))


def test_sglang_refuses_what_its_loaders_cannot_express(tmp_path, tiny, micro):
    with pytest.raises(ExportError, match="^mask_token_id:"):
        export_drafter(make(tiny, "dflash"), str(tmp_path / "a"), "sglang")
    with pytest.raises(ExportError, match="^target_layer_ids:.*exactly 3"):
        export_drafter(make(tiny, "eagle3", num_context_layers=2), str(tmp_path / "b"), "sglang")
    with pytest.raises(ExportError, match="^head='none': SGLang's Qwen3DSparkModel requires a Markov head"):
        export_drafter(make(tiny, "dspark", head="none", mask_token_id=0), str(tmp_path / "c"), "sglang")
    assert not any((tmp_path / x).exists() for x in "abc")


def test_a_drafter_with_the_library_defaults_exports_to_every_engine(tmp_path, tiny, micro):
    """DrafterConfig's default MASK ('auto') is the row the target reserves, which every engine embeds; a target
    without a tokenizer (a test model) falls back to a learned MASK."""
    from dspark.drafters.mask_token import reserved_token_id

    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=4, rank=8, num_layers=1), tiny)
    assert drafter.config.mask_token_id == reserved_token_id(tiny) is not None
    for fmt in ("vllm", "speculators", "sglang"):
        export_drafter(drafter, str(tmp_path / fmt), fmt, verifier="org/tiny")
        assert (tmp_path / fmt / "config.json").exists()
    assert build_drafter(DrafterConfig(algo="dflash", block_size=4, num_layers=1), micro).config.mask_token_id is None


# ---------------------------------------------------------------- shapes a format cannot express
@pytest.mark.parametrize("fmt", ["vllm", "speculators", "sglang"])
def test_the_targets_last_layer_is_refused_naming_target_layer_ids(tmp_path, micro, fmt):
    drafter = make(micro, "dflash", mask_token_id=1, num_context_layers=2, target_layer_ids=[1, 5])
    with pytest.raises(ExportError, match=r"^target_layer_ids \[1, 5\] include the target's last layer \(5\)"):
        export_drafter(drafter, str(tmp_path / "x"), fmt)


def test_vllm_refuses_heads_it_does_not_serve_but_speculators_takes_them(tmp_path, tiny):
    rnn = make(tiny, "dspark", head="rnn", mask_token_id=0)
    with pytest.raises(ExportError, match="^head='rnn'.*joint_proj"):
        export_drafter(rnn, str(tmp_path / "v"), "vllm")
    export_drafter(rnn, str(tmp_path / "s"), "speculators")
    cfg, weights = read(tmp_path / "s")
    assert cfg["markov_head_type"] == "rnn" and "markov_head.joint_proj.weight" in weights
    none = make(tiny, "dspark", head="none", mask_token_id=0)
    with pytest.raises(ExportError, match="^head='none'"):
        export_drafter(none, str(tmp_path / "v2"), "vllm")
    export_drafter(none, str(tmp_path / "s2"), "speculators")
    cfg, _ = read(tmp_path / "s2")
    assert cfg["markov_rank"] == 0 and cfg["confidence_head_with_markov"] is False
    assert cfg["enable_confidence_head"] is True


def test_unknown_format_is_an_error(tmp_path, micro):
    with pytest.raises(ExportError, match="unknown export format 'onnx'"):
        export_drafter(make(micro, "dflash"), str(tmp_path / "x"), "onnx")


def test_every_drafter_algorithm_has_export_traits(tmp_path, micro):
    from dspark.drafters.registry import DRAFTER_CLASSES
    from dspark.export.algos import ALGORITHMS

    assert set(ALGORITHMS) == set(DRAFTER_CLASSES)  # the exporters look an algorithm up, never compare its name
    with pytest.raises(ExportError, match="^unknown method 'medusa'"):
        export_vllm(make(micro, "dflash", mask_token_id=1), str(tmp_path / "x"), "medusa")


def test_exported_dspark_config_carries_every_field(tmp_path, tiny):
    drafter = make(tiny, "dspark", mask_token_id=tiny.pad_token_id)
    drafter.calibration = [1.2, 1.1, 1.0, 0.9]
    export_drafter(drafter, str(tmp_path / "s"), "speculators")
    cfg, _ = read(tmp_path / "s")
    assert cfg["sample_from_anchor"] is True and cfg["block_size"] == 4
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.layer_ids]
    assert cfg["markov_rank"] == 8 and cfg["markov_head_type"] == "vanilla"
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    assert cfg["draft_vocab_size"] == tiny.vocab_size and cfg["mask_token_id"] == tiny.pad_token_id
    assert cfg["dspark_calibration"] == drafter.calibration
    assert cfg["dspark_export"]["target_layer_ids"] == drafter.layer_ids


# ---------------------------------------------------------------- MASK placement
class ReservingTokenizer:
    """A tokenizer stand-in: `size` real tokens, optionally a mask token."""

    def __init__(self, size: int, mask_token_id: int | None = None):
        self.size, self.mask_token_id = size, mask_token_id

    def __len__(self) -> int:
        return self.size


@pytest.mark.parametrize("tokenizer,reserved", [(ReservingTokenizer(16, mask_token_id=7), 7),
                                                (ReservingTokenizer(14), 14)])
def test_learned_mask_takes_a_reserved_id_when_the_tokenizer_has_one(tmp_path, tokenizer, reserved):
    target = build_tiny_model(vocab_size=16)
    target.tokenizer = tokenizer  # its mask token, else the first embedding row it never produces
    drafter = make(target, "dspark")
    export_drafter(drafter, str(tmp_path / "v"), "vllm", dtype="fp32")
    cfg, weights = read(tmp_path / "v")
    assert cfg["mask_token_id"] == reserved and cfg["transformer_layer_config"]["vocab_size"] == 16
    assert cfg["dspark_export"]["mask"] == {"id": reserved, "placed_by": "reserved tokenizer id"}
    table = weights["embed_tokens.weight"]
    assert torch.equal(table[reserved], drafter.mask_embedding.detach())
    others = torch.arange(16) != reserved
    assert torch.equal(table[others], target.embed_tokens.weight[others])
    assert weights["markov_head.markov_w1.weight"].shape == (16, 8)


# ---------------------------------------------------------------- reduced draft vocabulary
def with_draft_vocab(target, algo: str, ids: list[int], offsets: bool):
    """A drafter built with a draft vocabulary (`ids`); its d2t holds offsets, or (offsets=False) the
    absolute target ids, a form the exporter also accepts."""
    drafter = make(target, algo, mask_token_id=1, draft_vocab_size=len(ids), draft_ids=torch.tensor(ids))
    if not offsets:
        drafter.d2t.copy_(torch.tensor(ids))
    return drafter


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_reduced_vocabulary_writes_speculators_d2t_t2d_and_lm_head(tmp_path, micro, offsets, fmt):
    ids = [0, 2, 3, 7, 11, 15]
    algo = "eagle3" if fmt == "sglang" else "dspark"
    drafter = with_draft_vocab(micro, algo, ids, offsets)
    export_drafter(drafter, str(tmp_path / "x"), fmt, dtype="fp32")
    cfg, weights = read(tmp_path / "x")
    assert cfg["draft_vocab_size"] == len(ids)
    assert torch.equal(weights["d2t"] + torch.arange(len(ids)), torch.tensor(ids))  # target = draft + d2t
    assert torch.equal(weights["lm_head.weight"], micro.lm_head.weight[ids])
    if fmt == "vllm":
        assert torch.equal(weights["t2d"].nonzero().flatten(), torch.tensor(ids))
        assert weights["markov_head.markov_w2.weight"].shape == (len(ids), 8)


def test_inconsistent_draft_vocabulary_is_refused_naming_d2t(tmp_path, micro):
    drafter = with_draft_vocab(micro, "dspark", [0, 2, 3], offsets=False)
    drafter.d2t.copy_(torch.tensor([2, 0, 3]))  # not ascending: no speculators layout for it
    with pytest.raises(ExportError, match="^d2t:"):
        export_drafter(drafter, str(tmp_path / "x"), "vllm")
    full_bias = with_draft_vocab(micro, "dspark", [0, 2, 3], offsets=False)
    full_bias.markov_head.markov_w2 = torch.nn.Linear(8, 16, bias=False)
    with pytest.raises(ExportError, match="^markov_head.markov_w2 has 16 rows but draft_vocab_size=3"):
        export_drafter(full_bias, str(tmp_path / "y"), "vllm")


# ---------------------------------------------------------------- SGLang DSpark (Qwen3DSparkModel)
def dspark_loader_shapes(cfg: dict, m: int) -> dict[str, tuple[int, ...]]:
    """SGLang Qwen3DSparkModel's parameters (checkpoint names, sglang@01f47623 models/dspark.py): the
    DFlash backbone + VanillaMarkov (markov_w1 Embedding(V, r), markov_w2 Linear(r, V)) or RNNHead (+
    joint_proj Linear(2r + d, 3r)) + DSparkConfidenceHead (proj Linear(d [+ r], 1), bias)."""
    d, r, V = cfg["hidden_size"], cfg["markov_rank"], cfg["vocab_size"]
    out = dflash_loader_shapes(cfg, m)
    out.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)})
    if cfg["markov_head_type"] == "rnn":
        out.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + d), "markov_head.joint_proj.bias": (3 * r,)})
    if cfg["enable_confidence_head"]:
        width = d + (r if cfg["confidence_head_with_markov"] else 0)
        out.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return out


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_sglang_dspark_layout_is_what_its_loader_reads(tmp_path, tiny, head):
    drafter = make(tiny, "dspark", head=head, mask_token_id=tiny.pad_token_id)
    export_drafter(drafter, str(tmp_path / "s"), "sglang", dtype="fp32")
    cfg, weights = read(tmp_path / "s")
    # what parse_dspark_draft_config / DSparkDraftMixin read (sglang@01f47623)
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert "speculators_model_type" not in cfg  # SGLang refuses speculators-convention DSpark configs
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 4  # γ slots: [anchor, MASK × (γ-1)]
    assert cfg["dflash_config"]["target_layer_ids"] == drafter.layer_ids  # ours; SGLang's hook adds 1
    assert 0 <= cfg["dflash_config"]["mask_token_id"] < tiny.vocab_size  # embedded with the target's table
    assert cfg["markov_rank"] == 8 > 0 and cfg["markov_head_type"] == {"markov": "vanilla", "rnn": "rnn"}[head]
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    assert cfg["sample_from_anchor"] is True and cfg["vocab_size"] == tiny.vocab_size
    assert cfg["dspark_export"]["requires"][0]["engine"] == "sglang"
    assert {k: tuple(v.shape) for k, v in weights.items()} == dspark_loader_shapes(cfg, len(drafter.layer_ids))
    own = drafter.state_dict()
    assert all(torch.equal(weights[k], own[k]) for k in weights)


def test_sglang_dspark_refuses_a_learned_mask_and_a_reduced_vocabulary_it_cannot_mask(tmp_path, tiny, micro):
    with pytest.raises(ExportError, match="^mask_token_id: SGLang's DSpark"):
        export_drafter(make(tiny, "dspark"), str(tmp_path / "a"), "sglang")
    rnn = make(micro, "dspark", head="rnn", mask_token_id=1, draft_vocab_size=3, draft_ids=torch.tensor([0, 2, 3]))
    with pytest.raises(ExportError, match="^draft_vocab_size=3: SGLang's DFlash \\(and DSpark with head=rnn\\)"):
        export_drafter(rnn, str(tmp_path / "b"), "sglang")
    with pytest.raises(ExportError, match="^draft_vocab_size=3: SGLang's DFlash"):
        export_drafter(with_draft_vocab(micro, "dflash", [0, 2, 3], offsets=True), str(tmp_path / "c"), "sglang")


def test_sglang_dspark_reduced_vocabulary_gives_sglangs_head_the_same_distribution(tmp_path, micro):
    """SGLang's VanillaMarkov and DSparkConfidenceHead (sglang@01f47623 models/dspark.py: logits = the
    target LM head over all V + markov_w2(markov_w1[prev]); confidence = proj([h; markov_w1[prev]])) on
    the exported weights: the same next-token distribution as ours over the draft vocabulary, zero
    probability elsewhere, the same confidence."""
    ids = torch.tensor([0, 2, 3, 7, 11, 15])
    drafter = with_draft_vocab(micro, "dspark", ids.tolist(), offsets=True)
    export_drafter(drafter, str(tmp_path / "s"), "sglang", dtype="fp32")
    cfg, w = read(tmp_path / "s")
    V, r = micro.vocab_size, drafter.config.rank
    assert cfg["markov_rank"] == r + 1 and "draft_vocab_size" not in cfg and cfg["vocab_size"] == V
    assert cfg["dspark_export"]["draft_vocab_size"] == len(ids)
    assert {k: tuple(v.shape) for k, v in w.items()} == dspark_loader_shapes(cfg, len(drafter.layer_ids))
    torch.manual_seed(1)
    h, prev = torch.randn(5, drafter.hidden_size), torch.tensor([0, 4, 7, 9, 15])  # prev: any target token
    lm = micro.lm_head.weight.detach()
    with torch.no_grad():
        ours = torch.softmax(h @ lm[ids].T + drafter.markov_head.markov_w2(drafter.markov_head.markov_w1(prev)), -1)
        ours_conf = drafter.confidence_head(h, drafter.markov_head.markov_w1(prev))
    e1 = w["markov_head.markov_w1.weight"][prev]
    theirs = torch.softmax(h @ lm.T + e1 @ w["markov_head.markov_w2.weight"].T, -1)
    assert torch.allclose(theirs[:, ids], ours, atol=1e-6)
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert theirs[:, outside].max() == 0
    conf = torch.cat([h, e1], -1) @ w["confidence_head.proj.weight"].T + w["confidence_head.proj.bias"]
    assert torch.allclose(conf.squeeze(-1), ours_conf.reshape(-1), atol=1e-6)


# ---------------------------------------------------------------- dtype, verifier, engine versions
@pytest.mark.parametrize("fmt", ["vllm", "speculators", "sglang"])
@pytest.mark.parametrize("dtype,expected", [(None, torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_export_dtype_defaults_to_bf16_and_is_recorded(tmp_path, tiny, fmt, dtype, expected):
    drafter = make(tiny, "dspark", mask_token_id=tiny.pad_token_id)
    kwargs = {} if dtype is None else {"dtype": dtype}
    export_drafter(drafter, str(tmp_path / "x"), fmt, verifier="org/tiny", **kwargs)
    cfg, weights = read(tmp_path / "x")
    assert cfg["torch_dtype"] == str(expected).removeprefix("torch.")
    assert {w.dtype for w in weights.values() if w.is_floating_point()} == {expected}


def test_cli_dtype_halves_the_export(tmp_path, tiny):
    src = save_drafter(make(tiny, "dflash", mask_token_id=tiny.pad_token_id), str(tmp_path / "ckpt"))
    sizes = {}
    for dtype in ("fp32", "bf16"):
        assert main(["export", "--format", "vllm", "--dtype", dtype, "--verifier", "org/tiny", src,
                     str(tmp_path / dtype)]) == 0
        sizes[dtype] = (tmp_path / dtype / "model.safetensors").stat().st_size
    assert sizes["bf16"] < 0.55 * sizes["fp32"]


def test_a_local_verifier_path_is_warned_about_and_portable_refuses_it(tmp_path, tiny, capsys):
    from dspark.export.vllm import LocalVerifierWarning

    drafter = make(tiny, "dflash", mask_token_id=tiny.pad_token_id)
    with pytest.warns(LocalVerifierWarning, match="local path"):
        export_drafter(drafter, str(tmp_path / "a"), "vllm")  # the built-in target lives in the dspark cache
    with pytest.raises(ExportError, match="^--portable requires --verifier"):
        export_drafter(drafter, str(tmp_path / "b"), "vllm", portable=True)
    with pytest.raises(ExportError, match="is a path on this machine"):
        export_drafter(drafter, str(tmp_path / "c"), "speculators", verifier=str(tmp_path), portable=True)
    export_drafter(drafter, str(tmp_path / "d"), "vllm", verifier="Qwen/Qwen3-4B", portable=True)
    assert read(tmp_path / "d")[0]["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-4B"
    src = save_drafter(drafter, str(tmp_path / "ckpt"))
    assert main(["export", "--format", "vllm", "--portable", src, str(tmp_path / "e")]) == 1
    assert "--portable requires --verifier" in capsys.readouterr().err and not (tmp_path / "e").exists()


def test_dspark_export_states_and_warns_the_vllm_version_it_needs(tmp_path, tiny):
    from dspark.export import EngineVersionWarning

    drafter = make(tiny, "dspark", mask_token_id=tiny.pad_token_id)
    with pytest.warns(EngineVersionWarning, match=r"vllm >= 0\.27\.1.*sample_from_anchor.*tau ~ 1"):
        export_drafter(drafter, str(tmp_path / "v"), "vllm", verifier="org/tiny")
    (need,) = read(tmp_path / "v")[0]["dspark_export"]["requires"]
    assert need["engine"] == "vllm" and need["min_version"] == "0.27.1" and "48639" in need["feature"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineVersionWarning)  # DFlash with a vocab-row MASK: nothing to warn
        export_drafter(make(tiny, "dflash", mask_token_id=0), str(tmp_path / "f"), "vllm", verifier="org/tiny")
    assert read(tmp_path / "f")[0]["dspark_export"]["requires"] == []


def test_dflash_learned_mask_is_written_as_vllms_mask_embedding_override(tmp_path):
    from dspark.export import EngineVersionWarning

    target = build_tiny_model(vocab_size=16)
    target.tokenizer = ReservingTokenizer(14)  # rows 14, 15 are padding: 14 is reserved
    drafter = make(target, "dflash")
    with pytest.warns(EngineVersionWarning, match="mask_embedding.pt"):
        export_drafter(drafter, str(tmp_path / "v"), "vllm", dtype="fp32", verifier="org/t")
    cfg, weights = read(tmp_path / "v")
    assert "embed_tokens.weight" not in weights  # no V x d table: vLLM shares the target's embedding
    assert cfg["mask_token_id"] == 14 and cfg["transformer_layer_config"]["vocab_size"] == 16
    override = torch.load(tmp_path / "v" / "mask_embedding.pt", weights_only=True)
    assert override["mask_token_id"] == 14 and torch.equal(override["embedding"], drafter.mask_embedding.detach())
    assert cfg["dspark_export"]["mask"]["placed_by"] == "mask_embedding.pt"


# ---------------------------------------------------------------- the shipped training configs
def config_drafter(name: str, target):
    """The drafter a training config builds (a draft vocabulary, when configured, of the first N ids)."""
    from tests.paths import REPO

    section = read_yaml(REPO / "configs" / "train" / f"{name}.yaml")["drafter"]
    size = section.get("draft_vocab_size")
    return make(target, draft_ids=torch.arange(size) if size else None, **section)


@pytest.mark.parametrize("name", ["tiny-dspark", "tiny-dflash", "tiny-dflash-tv"])
def test_tiny_training_configs_use_a_reserved_mask_and_export_to_every_format(tmp_path, tiny, name):
    drafter = config_drafter(name, tiny)
    assert drafter.config.mask_token_id == 0 and drafter.mask_embedding is None  # <|endoftext|>: never in chat text
    for fmt in ("vllm", "speculators", "sglang"):
        export_drafter(drafter, str(tmp_path / fmt), fmt, verifier="org/tiny")
        assert read(tmp_path / fmt)[0]["dspark_export"]["algo"] == drafter.algo


@pytest.mark.parametrize("name", ["smollm2-135m-dspark", "smollm2-135m-dflash", "smollm2-135m-dflash-tv"])
def test_smollm2_training_configs_use_a_reserved_mask_and_export_to_every_format(tmp_path, name):
    target = load_target("smollm2-135m")
    drafter = config_drafter(name, target)
    assert target.tokenizer.convert_ids_to_tokens(drafter.config.mask_token_id) == "<empty_output>"
    formats = ("vllm", "speculators") if drafter.algo != "dspark" else ("vllm", "speculators", "sglang")
    for fmt in formats:
        export_drafter(drafter, str(tmp_path / fmt), fmt, verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    if drafter.algo != "dspark":
        # DFlash with the 8k draft vocabulary (the CPU cost lever) has no SGLang layout: its loader always
        # uses the target's full LM head with no bias to mask the rest, and the export says so
        with pytest.raises(ExportError, match="draft_vocab_size=8192"):
            export_drafter(drafter, str(tmp_path / "sglang"), "sglang", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
