"""dspark/models/precision.py: "auto" is bfloat16 only where the device computes bf16 natively, and every
config that loads a target resolves it there, on the worker, through this one resolver."""
from __future__ import annotations

import pytest
import torch

from dspark.models import precision
from dspark.models.precision import resolve_dtype, torch_dtype


@pytest.fixture
def native(monkeypatch):
    """native(True): a CPU with avx512_bf16/AMX (or a bf16 GPU); native(False): an AVX2-only CPU."""
    def set_native(value: bool):
        monkeypatch.setattr(precision, "bf16_is_native", lambda device: value)
    return set_native


def test_auto_follows_the_hardware(native):
    native(True)
    assert resolve_dtype("auto", "cpu") == "bfloat16" and resolve_dtype(None, "cpu") == "bfloat16"
    assert torch_dtype("auto", "cuda") is torch.bfloat16
    native(False)  # emulated bf16 is slower than fp32 there
    assert resolve_dtype("auto", "cpu") == "float32" and resolve_dtype(None, "cuda") == "float32"
    assert torch_dtype("auto", "cpu") is torch.float32


def test_an_explicit_dtype_is_kept_and_a_bad_one_refused(native):
    native(False)
    for dtype in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(dtype, "cpu") == dtype and torch_dtype(dtype, "cpu") is getattr(torch, dtype)
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("fp8", "cpu")


def test_bf16_is_native_reads_the_cpu_flags_and_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert not precision.bf16_is_native("cpu") and resolve_dtype("auto", "cpu") == "float32"  # AVX2 only
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert precision.bf16_is_native("cpu") and resolve_dtype("auto", torch.device("cpu")) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    assert precision.bf16_is_native("cuda:1")  # asks for native bf16, not emulation
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert not precision.bf16_is_native("cuda") and resolve_dtype("auto", "cuda") == "float32"
    assert not precision.bf16_is_native("meta")


def test_the_old_import_places_use_the_one_resolver():
    from dspark.models.target import bf16_is_native
    from dspark.serve.config import resolve_dtype as serve_resolve

    assert bf16_is_native is precision.bf16_is_native and serve_resolve is resolve_dtype


def test_a_rollout_replica_resolves_auto_on_its_own_device(native):
    """The driver ships "auto" in the actor spec; the actor, where the device is, picks the dtype."""
    from dspark.data.rollout_engine import RolloutActor
    from pipelines.generate import RolloutConfig, rollout_actor_spec

    cfg = RolloutConfig.model_validate({"target": "tiny", "sources": [{"uri": "data/train/chat.jsonl"}],
                                        "output": "/tmp/unused", "compute": {"torch_threads": 1}})
    spec = rollout_actor_spec(cfg)
    assert spec["dtype"] == "auto" and spec["device"] == "cpu"
    threads = torch.get_num_threads()
    try:
        native(True)
        assert RolloutActor(spec).engine.target.dtype == torch.bfloat16
        native(False)
        assert RolloutActor(spec).engine.target.dtype == torch.float32
    finally:
        torch.set_num_threads(threads)


def test_an_eval_worker_resolves_auto_on_its_own_device(native):
    from dspark.eval.evaluate import DecodeSettings
    from pipelines.eval_decode import EvalWorker, WorkersConfig, worker_spec

    spec = worker_spec("tiny", {}, DecodeSettings(), 0, WorkersConfig(num_workers=0))
    assert spec["dtype"] == "auto"
    threads = torch.get_num_threads()
    try:
        native(True)
        assert EvalWorker(spec).target.dtype == torch.bfloat16
        native(False)
        assert EvalWorker(spec).target.dtype == torch.float32
    finally:
        torch.set_num_threads(threads)
