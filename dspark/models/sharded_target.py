"""A frozen target partitioned across the workers of a node: each holds 1/N of its decoder layers.

Why FSDP2 (`fully_shard`, gathered layer by layer) and not tensor parallelism: the drafter trains data
parallel, so every worker runs the target on *its own* micro batch. Under FSDP each worker keeps a 1/N
slice (dim 0) of every decoder-layer weight and all-gathers one layer's weights just before that layer
runs, then frees them: the collectives move weights, whose shapes are the same on every rank, so the
ranks' batches may differ in size and length, and features and target distributions reach each drafter
rank exactly as from a whole copy (equal values, not just close: the gathered weights are the weights).
Tensor parallelism would need every rank of a group to feed the same batch (broadcast each rank's
batch, run N forwards) and heads divisible by N. Invariant: per-worker target memory ≈ whole/N for the
layers + one gathered layer + the parts every rank keeps whole.

Kept whole on every rank: the token embedding, the final norm and the LM head. The drafter calls them
on its own rows (its input embedding; its LM head, with gradients flowing through) at times that differ
between ranks, which a sharded module cannot serve without collectives every rank joins.

Across nodes the mesh is 2-D (replicate × shard, HSDP): each node's group holds one sharded copy, and the
drafter's ZeRO data parallelism spans all ranks as before. Every rank of a group must run the target the
same number of times (the trainer runs it on every micro batch; the target memo is off).

Weights are read slice by slice from the checkpoint's safetensors files (`get_slice`): a worker never
holds a whole decoder layer it does not need, not even while loading.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from dspark.models.moe import moe_profile
from dspark.models.target import Target, resolve_model_path, tokenizer_of


def shard_mesh(shards: int, device_type: str):
    """The device mesh of a job whose workers hold 1/`shards` of the target each: 1-D over `shards` ranks,
    or (world/shards replicas) × (shards) for several groups. Ranks r..r+shards-1 form a group (Ray Train
    numbers the workers of a node consecutively)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if shards < 1 or world % shards:
        raise ValueError(f"target_shards={shards} must divide the {world} workers")
    if shards == world:
        return init_device_mesh(device_type, (shards,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world // shards, shards), mesh_dim_names=("replicate", "shard"))


def load_sharded_target(spec: str, mesh, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        local_copy: Callable[[str], str] | None = None) -> Target:
    """`spec` (as load_target) with its decoder layers partitioned over `mesh` (shard_mesh). Collective:
    every rank of the mesh calls it."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(resolve_model_path(spec, local_copy))
    files = safetensors_files(path)
    if torch.device(device).type == "cpu":
        return_large_frees_to_the_os()
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):  # parameters on "meta"; buffers (rotary tables) real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = decoder_layers(model)
    _shard_layers(model, layers, mesh)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)  # allocates the local shards (and whole non-layer parameters)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name].to(device))
    _load_weights(model, files, mesh)
    model.tie_weights()
    tokenizer = tokenizer_of(str(path))
    from dspark.models import builtin as models_builtin

    revision = getattr(config, "_commit_hash", None) or models_builtin.revision_of(spec)
    target = Target(model, tokenizer, name=spec, revision=revision or "")
    target.shards = mesh.size(-1)
    return target


def return_large_frees_to_the_os(threshold: int = 1 << 20) -> bool:
    """glibc's malloc serves blocks under its (adaptive, up to 32 MiB) mmap threshold from the heap and keeps them
    when freed: the layers a CPU rank gathers and frees one after another then grow its heap by about a whole
    target (measured on a 1.1 B Llama over 3 ranks: 1.1 GiB after one forward). Blocks of `threshold` bytes and
    more are mapped and unmapped instead (peak 1.54 vs 2.65 GiB there). False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layer list at .model.layers; this architecture "
                         f"cannot be sharded (use target_shards: 1)")
    return layers


def _shard_layers(model: nn.Module, layers: nn.ModuleList, mesh) -> None:
    """Each decoder layer its own FSDP unit under one root, the base model, whose other parameters (embedding,
    norm) stay whole (`ignored_params`). One root matters: FSDP keeps a root's weights gathered after its
    forward, so layers as roots would each stay whole once run."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)  # gathered before it runs, freed right after
    base = getattr(model, "model", model)
    in_layers = {id(p) for p in layers.parameters()}
    fully_shard(base, mesh=mesh, ignored_params={p for p in base.parameters() if id(p) not in in_layers})


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise ValueError(f"target directory {path} holds no safetensors weights (model.safetensors or an index): a "
                     f"sharded target reads its slices from safetensors; convert it with save_pretrained")


# A fused expert parameter [E, ...] (transformers 5's MoE classes) and, per expert, the checkpoint tensors it
# stacks: Qwen-style names first, Mixtral's (w1 gate, w3 up, w2 down) second. gate_up_proj[e] = cat(gate, up).
FUSED_EXPERTS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}


def _load_weights(model: nn.Module, files: list[Path], mesh) -> None:
    """Each parameter from its checkpoint tensor: the rank's dim-0 slice for a sharded one (FSDP's even
    chunks of ceil(rows / shards); for fused experts, the rank's experts), the whole tensor otherwise. Every
    parameter must be found. Files are mapped one tensor at a time, never all resident beside the shards."""
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(dict(model.named_parameters()))  # tied duplicates count once
    rank, shards = mesh.get_local_rank(mesh.ndim - 1), mesh.size(-1)
    where = checkpoint_index(files)
    for key, param in params.items():
        with torch.no_grad():
            if hasattr(param, "to_local"):  # a DTensor: this rank's slice of dim 0
                local = param.to_local()
                start = rank * math.ceil(param.shape[0] / shards)
                rows = read_rows(where, key, start, local.shape[0]) if local.shape[0] else local
            else:
                rows = read_rows(where, key, 0, param.shape[0] if param.dim() else None)
            if rows is not None:
                (param.to_local() if hasattr(param, "to_local") else param).copy_(rows)
                missing.discard(key)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if missing - tied:
        raise ValueError(f"the target checkpoint holds no tensor for {sorted(missing - tied)[:5]} "
                         f"({len(missing - tied)} parameters): its names differ from the model class's "
                         f"(a converted checkpoint?); use target_shards: 1")


def checkpoint_index(files: list[Path]) -> dict[str, Path]:
    from safetensors import safe_open

    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            where.update(dict.fromkeys(reader.keys(), file))
    return where


def read_rows(where: dict[str, Path], key: str, start: int, count: int | None) -> torch.Tensor | None:
    """Rows start..start+count of parameter `key` from the checkpoint (None if it holds no such tensor): its
    own tensor, or for a fused expert parameter the experts start..start+count, each stacked from its parts."""
    from safetensors import safe_open

    def rows_of(name: str, first: int = 0, n: int | None = None) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as reader:
            return reader.get_tensor(name) if n is None else reader.get_slice(name)[first:first + n]

    if key in where:
        return rows_of(key, start, count)
    prefix, _, fused = key.rpartition(".")
    for parts in FUSED_EXPERTS.get(fused, ()) if prefix.endswith("experts") else ():
        names = [[f"{prefix}.{e}.{part}.weight" for part in parts] for e in range(start, start + count)]
        if all(name in where for expert in names for name in expert):
            return torch.stack([torch.cat([rows_of(name) for name in expert]) for expert in names])
    return None


def local_target_bytes(target: Target) -> int:
    """Bytes of the target's parameters held by this rank (its shards + the whole parts)."""
    total = 0
    for p in target.model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def target_memory_plan(config, dtype_bytes: int, shards: int) -> dict:
    """Per-worker bytes of a target whose decoder layers are split over `shards` workers, from its HF config
    alone (a meta-device model: nothing is allocated): whole, per worker (layers/shards + the parts kept
    whole + one gathered layer, the forward's transient)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    layers = decoder_layers(model)
    layer_params = sum(p.numel() for p in layers.parameters())
    total_params = sum(p.numel() for p in model.parameters())
    whole_parts = total_params - layer_params
    per_layer = layer_params / max(1, len(layers))
    sharded = whole_parts + layer_params / shards + (per_layer if shards > 1 else 0)
    moe = moe_profile(model)
    return {"params": total_params, "decoder_layer_params": layer_params, "shards": shards,
            "moe": moe.as_dict() if moe else None,
            "bytes_whole": total_params * dtype_bytes, "bytes_per_worker": int(sharded * dtype_bytes),
            "ratio": round(sharded / total_params, 4)}
