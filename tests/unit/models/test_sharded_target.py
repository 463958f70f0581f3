"""dspark/models/sharded_target.py: a target whose decoder layers are split over 2 gloo ranks gives each rank,
on its own differently shaped batch, the features and final states of the whole target, and trains a drafter
to the same losses; each rank holds about half of the layers; a checkpoint that lacks a tensor is refused
by name; the planner's per-worker bytes match what a rank holds. An MoE target (fused experts in the model,
one tensor per expert in the checkpoint) is split by experts, 3 over 2 ranks, with the whole target's features.
Across nodes (4 ranks, 2 shards) the mesh is replicate x shard, with the same results."""
import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from dspark.models import builtin
from dspark.models.sharded_target import load_sharded_target, local_target_bytes, shard_mesh, target_memory_plan
from dspark.models.target import load_target

V, LAYERS = 32, [0, 2]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro")
    builtin.tiny_qwen3(vocab_size=V, seed=3, num_layers=4, hidden_size=48).save_pretrained(out)
    return str(out)


def rank_batch(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    length = 9 + 4 * rank  # the ranks' batches differ in length
    ids = torch.randint(0, V, (2, length), generator=g)
    attention = torch.ones_like(ids)
    attention[1, -3:] = 0
    loss_mask = attention.clone()
    loss_mask[:, :2] = 0
    return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention}


def train_losses(target, batch, steps=3):
    from dspark.drafters import DrafterConfig, build_drafter
    from dspark.training.config import OptimSection
    from dspark.training.loop import LocalTrainer

    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(algo="dspark", block_size=3, num_layers=1, num_context_layers=2, rank=8,
                                          anchors_per_seq=64), target)
    trainer = LocalTrainer("dspark", target, drafter, OptimSection(lr=1e-3), "fp32")
    return [trainer.step(batch, seed=i)["loss"] for i in range(steps)]


def rank_main(rank: int, world: int, port: int, target_dir: str, out_dir: str, shards: int | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sharded = load_sharded_target(target_dir, shard_mesh(shards or world, "cpu"))
        whole = load_target(target_dir)
        b = rank_batch(rank)
        got = sharded.forward(b["input_ids"], attention_mask=b["attention_mask"], layer_ids=LAYERS, logits_at=None)
        ref = whole.forward(b["input_ids"], attention_mask=b["attention_mask"], layer_ids=LAYERS, logits_at=None)
        report = {"features_diff": (got.features - ref.features).abs().max().item(),
                  "final_diff": (got.final_hidden - ref.final_hidden).abs().max().item(),
                  "bytes_sharded": local_target_bytes(sharded), "bytes_whole": local_target_bytes(whole),
                  "losses_sharded": train_losses(sharded, b), "losses_whole": train_losses(whole, b)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target_dir: str, out, world: int = 2, shards: int | None = None, timeout: float = 180.0) -> list[dict]:
    # forked, not spawned: a rank starts from this process's imports (torch, transformers) instead of its own;
    # a rank that hangs is killed at the deadline (a failed rank raises from join)
    ranks = torch.multiprocessing.start_processes(rank_main, args=(world, free_port(), target_dir, str(out), shards),
                                                  nprocs=world, join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ranks.processes:
                proc.kill()
            pytest.fail(f"{world} forked gloo ranks did not finish in {timeout:.0f} s")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.heavy
def test_sharded_moe_target_splits_its_experts(tmp_path):
    from transformers import AutoModelForCausalLM

    from dspark.models.architectures import tiny_config

    config = tiny_config("qwen3-moe", vocab_size=V)
    config.num_experts = 3  # 2 + 1 experts on 2 ranks (FSDP's uneven last chunk)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    reports = run_ranks(str(tmp_path / "moe"), tmp_path)
    for r in reports:
        assert r["features_diff"] == 0.0 and r["final_diff"] == 0.0
        assert r["losses_sharded"] == pytest.approx(r["losses_whole"], rel=1e-6, abs=1e-7)
        assert r["bytes_sharded"] < 0.8 * r["bytes_whole"]


@pytest.mark.heavy
def test_sharded_target_on_two_ranks_is_the_whole_target_with_half_the_layers(target_dir, tmp_path):
    """One run of 2 ranks (one spawn: the checks share it, whichever xdist worker runs them): each rank gets the
    whole target's features and final states, trains to the same losses, and holds the plan's share."""
    from transformers import AutoConfig

    reports = run_ranks(target_dir, tmp_path)
    for r in reports:
        assert r["features_diff"] == 0.0 and r["final_diff"] == 0.0
        assert r["losses_sharded"] == pytest.approx(r["losses_whole"], rel=1e-6, abs=1e-7)
    assert reports[0]["losses_whole"] != reports[1]["losses_whole"]  # two ranks, two batches
    plan = target_memory_plan(AutoConfig.from_pretrained(target_dir), dtype_bytes=4, shards=2)
    for r in reports:
        assert r["bytes_sharded"] < 0.8 * r["bytes_whole"]
        # the plan adds one gathered layer (the forward's transient) to what the rank holds
        layer_bytes = plan["decoder_layer_params"] * 4 / 4
        assert r["bytes_sharded"] == pytest.approx(plan["bytes_per_worker"] - layer_bytes, rel=0.01)
    assert plan["bytes_whole"] == reports[0]["bytes_whole"]


def test_a_checkpoint_without_a_tensor_is_refused_by_name(target_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(target_dir, name)):
            (broken / name).write_text(open(os.path.join(target_dir, name)).read())
    tensors = load_file(os.path.join(target_dir, "model.safetensors"))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
            load_sharded_target(str(broken), shard_mesh(1, "cpu"))
    finally:
        dist.destroy_process_group()


def test_shards_must_divide_the_workers():
    from dspark.training.config import TrainJobConfig

    with pytest.raises(ValueError, match="target_shards=2 must divide scaling.num_workers=3"):
        TrainJobConfig.model_validate({"run_name": "r", "data": {"rollouts": "x.parquet"},
                                       "optim": {"micro_batch_size": 1, "global_batch_size": 3},
                                       "scaling": {"num_workers": 3, "target_shards": 2}})


@pytest.mark.heavy
def test_sharded_target_across_two_nodes_is_one_copy_per_node(target_dir, tmp_path):
    """4 ranks, target_shards 2 (two "nodes" of two workers): a 2-D mesh, replicate x shard; every rank gets the
    whole target's features and losses on its own batch and holds half of the layers, as on one node."""
    reports = run_ranks(target_dir, tmp_path, world=4, shards=2)
    for r in reports:
        assert r["features_diff"] == 0.0 and r["final_diff"] == 0.0
        assert r["losses_sharded"] == pytest.approx(r["losses_whole"], rel=1e-6, abs=1e-7)
        assert r["bytes_sharded"] < 0.8 * r["bytes_whole"]
    assert reports[0]["bytes_sharded"] == reports[2]["bytes_sharded"]  # the same half on both nodes
