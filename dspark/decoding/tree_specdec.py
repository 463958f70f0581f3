"""Batch-1 speculative decoding that verifies a tree of drafts per round (SpecInfer-style), lossless.

A tree "branching" (n_1, n_2, ...) gives every node at depth k−1 (the anchor at depth 0) n_k distinct
children drawn without replacement from the drafter's q_k(· | its path); below the tuple, one. Per
round, with `anchor` the last token the target produced (in no cache yet):
  1. `draft_tree`: one drafter backbone pass gives the block's hidden states, `sample_tree` grows the tree,
     each child keeping the row q^(j) it was drawn from (q_k without its earlier siblings, renormalised);
  2. the target scores [anchor, every node] in ONE forward: node i sits at position L + depth(i) and
     attends to the cache, the anchor and its own ancestors only (a 4D mask);
  3. `accept_tree` walks down from the anchor: among the current node's children, in the order drawn,
     child j is accepted with probability min(1, r_j(x_j) / q^(j)(x_j)), where r_1 = p(· | path) and
     r_{j+1} = norm((r_j − q^(j))+); below an accepted child the walk goes on; where no child is accepted
     (or at a leaf) the next token is drawn from the last r (at a leaf: p itself, the bonus);
  4. the cache keeps [prefix, anchor, accepted path] (the other nodes' keys and values are dropped), the
     drafter's context grows by the same positions' target features, and the drawn token is the new anchor.
Invariant (lossless, multi-round rejection sampling): stage j of a node emits r_j whatever the earlier
siblings were (min(r_j, q^(j)) + (1 − Σ min(r_j, q^(j))) · r_{j+1} = r_j), so the walk emits
p(· | emitted prefix); what it does below a node depends only on the drafts under that node, drawn given
its path. Between rounds, as in dspark.decoding.specdec: cache length == drafter context length ==
len(prompt) + len(tokens) − 1.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from dspark.decoding.batched_cache import tree_visibility
from dspark.decoding.counter_random import uniforms
from dspark.decoding.sampling import KeyedNoise, SamplingParams, rejection_residual, sample, to_probs
from dspark.decoding.specdec import GenerationResult, RoundStats, generate_rounds


@dataclass
class DraftTree:
    """A tree of drafts grown from one anchor (a drafter's `draft_trees`), nodes in breadth-first order."""

    tokens: Tensor  # LongTensor [M] target ids
    parents: list[int]  # parent node of each node, -1 = the anchor
    depths: list[int]  # 1..γ: node i's token stands at position anchor + depths[i]
    probs: Tensor  # float32 [M, V]: the distribution node i was drawn from (shared by its siblings)


def parse_branching(text: str) -> tuple[int, ...]:
    """'4x2' -> (4, 2): a tree's children per depth as written on a command line (ValueError otherwise)."""
    if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*)*", text):
        raise ValueError(f"{text!r} is not a tree; write children per depth (each >= 1), e.g. 4 or 3x2")
    return tuple(int(n) for n in text.split("x"))


def check_branching(branching: Sequence[int], gamma: int) -> tuple[int, ...]:
    """A tree's children per depth as a tuple: at most γ counts, each >= 1 (else one clear error)."""
    branching = tuple(int(n) for n in branching)
    if len(branching) > gamma or any(n < 1 for n in branching):
        raise ValueError(f"branching {branching}: at most γ = {gamma} counts, each >= 1")
    return branching


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """Each node's children in index order (the order they were drawn), -1 = the anchor's."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def accept_tree(tokens: Tensor, parents: list[int], draft_probs: Tensor, target_probs: Tensor,
                generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """(accepted path as node indices from the anchor down, next token). tokens [M], draft_probs [M, V] (the
    row each node was drawn from), target_probs [1 + M, V] (row 0: after the anchor; row 1 + i: after
    node i). Children are tried in index order (the order they were drawn)."""
    device = generator.device if generator is not None else target_probs.device
    draft_probs, target_probs = draft_probs.to(device), target_probs.to(device)
    children, token_ids = children_of(parents), tokens.tolist()  # the nodes' tokens in one read
    path, at = [], -1
    while True:
        residual = target_probs[at + 1]
        for child in children.get(at, []):
            x, q = token_ids[child], draft_probs[child]
            if float(uniforms(generator, (), device, torch.float32)) * q[x] < residual[x]:
                path.append(child)
                at = child
                break
            residual = rejection_residual(residual, q)
        else:  # no child accepted, or a leaf: the next token comes from what is left of p
            return path, int(sample(residual, generator))


def tree_expected_accepted(tokens: Tensor, parents: list[int], draft_probs: Tensor, target_probs: Tensor) -> float:
    """E[accepted path length | the tree, p] under `accept_tree`'s walk: Σ over nodes of P(the walk reaches it),
    where child j of a reached node is accepted with probability min(1, r_j(x_j) / q^(j)(x_j)) after its earlier
    siblings were rejected. The draft gate's acceptance figure for trees: the conditional mean of the realized
    length, far less noisy than one round's count (and known only after the verify, so lossless to use)."""
    target_probs, draft_probs = target_probs.float(), draft_probs.to(target_probs.device).float()
    children, token_ids = children_of(parents), tokens.tolist()  # the nodes' tokens in one read
    reach, total = {-1: 1.0}, 0.0
    for at in [-1, *range(len(parents))]:  # parents come before their children
        if reach.get(at, 0.0) == 0.0:
            continue
        residual, left = target_probs[at + 1], reach[at]
        for child in children.get(at, []):
            x, q = token_ids[child], draft_probs[child]
            accept = min(1.0, float(residual[x]) / max(float(q[x]), 1e-30))
            reach[child] = left * accept
            total, left = total + reach[child], left * (1.0 - accept)
            residual = rejection_residual(residual, q)
    return total


def verify_parents(parents: list[int]) -> list[int]:
    """Parents within the verified row [anchor, nodes]: the anchor is the root, node i sits at 1 + i."""
    return [-1, *(p + 1 for p in parents)]


def accept_keyed_tree(tokens: Tensor, parents: list[int], target_probs: Tensor, noise: KeyedNoise,
                      position: int) -> tuple[list[int], int]:
    """The keyed counterpart of `accept_tree` (see `KeyedNoise`): from the anchor down, the target's
    Gumbel-max token at output position `position + depth` is computed from the current node's row; the
    walk moves to the child holding that token, and stops at the first node that has none (or at a
    leaf), returning (path, that token). The output is the keyed target sample whatever was drafted."""
    token_ids = tokens.tolist()  # the nodes' tokens in one read
    children = {at: {token_ids[node]: node for node in reversed(kids)}  # a token's first child wins
                for at, kids in children_of(parents).items()}
    path, at = [], -1
    while True:
        x = int(noise.argmax(target_probs[at + 1: at + 2], [position + len(path)])[0])
        child = children.get(at, {}).get(x)
        if child is None:
            return path, x
        path.append(child)
        at = child


@torch.no_grad()
def tree_speculative_generate(target, drafter, prompt_ids, sp: SamplingParams, max_new_tokens: int,
                              branching: Sequence[int], stop_ids: Sequence[int] | None = None,
                              generator: torch.Generator | None = None, gamma: int | None = None,
                              core_mode: str | None = None) -> GenerationResult:
    """Lossless speculative decoding of one prompt with a draft tree per round (module doc). The drafter
    needs `draft_tree` (DSpark). gamma: the tree's depth (default the drafter's block size). core_mode: as
    in `speculative_generate`."""
    if not hasattr(drafter, "draft_tree"):
        raise ValueError(f"{drafter.algo} drafters do not grow draft trees (DSpark does)")
    gamma = gamma or drafter.config.block_size
    drafter.check_gamma(gamma)
    branching = check_branching(branching, gamma)
    return generate_rounds(target, drafter, prompt_ids, sp, max_new_tokens, stop_ids, generator, gamma,
                           lambda state, seq, anchor, _round_idx, layer_ids: _tree_round(
                               target, drafter, state, seq, anchor, gamma, branching, sp, generator, layer_ids),
                           core_mode)


def _tree_round(target, drafter, state, seq, anchor: int, gamma: int, branching: tuple[int, ...], sp,
                generator, layer_ids):
    """One draft-tree / verify / walk cycle -> (stats, new tokens, features and ids of the kept positions)."""
    t0 = time.perf_counter()
    tree = drafter.draft_tree(state, anchor, gamma, branching, sp, generator)
    t1 = time.perf_counter()
    base = seq.length
    verify_ids = torch.cat([torch.tensor([anchor], device=target.device), tree.tokens.to(target.device)])
    seen, depth = tree_visibility(verify_parents(tree.parents))  # node i at base + depth, sees its ancestors
    out = seq.extend(verify_ids, layer_ids, logits="all", depth=depth, seen=seen)
    path, next_token = accept_tree(tree.tokens, tree.parents, tree.probs, to_probs(out.logits[0], sp), generator)
    kept = torch.tensor([0, *(1 + node for node in path)], device=target.device)  # in [anchor, nodes]
    seq.keep_path(base, base + kept)
    # proposed: the tree's nodes (what the target verified besides the anchor); verified: the depth any path
    # reaches (γ), so position k's conditional acceptance reads as for a chain
    stats = RoundStats(proposed=len(tree.parents), verified=gamma, accepted=len(path),
                       outcomes=[True] * len(path) + ([False] if len(path) < gamma else []),
                       draft_s=t1 - t0, verify_s=time.perf_counter() - t1)
    tree_ids = tree.tokens.tolist()  # one read
    new = [tree_ids[node] for node in path] + [next_token]
    return stats, new, out.features[0, kept], verify_ids[kept]
