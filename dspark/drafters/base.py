"""What every drafter shares: the frozen target's embedding and LM head (held by reference, never
saved), the per-request drafting state, proposals, and calibrated confidences.

Inference contract (used by dspark/decoding/specdec.py and dspark/decoding/engine.py):
    state = drafter.new_state()
    drafter.extend_context(state, features[n, m*d], token_ids[n])   # verified positions only, in order
    proposal = drafter.propose(state, anchor, gamma, sampling, generator)
    proposals = drafter.propose_batch(states, anchors, gamma(s), sampling(s), generator)  # one pass, R requests
The state only ever holds verified positions 0..n-1; the anchor (the token the target just emitted,
with no target state yet) sits at position n. After verification the caller extends the state with
the newly verified positions, so no rollback is needed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark.drafters import draft_vocab
from dspark.drafters.config import DrafterConfig
from dspark.drafters.layers import KVBuffer, Rotary
from dspark.decoding.counter_random import host_values
from dspark.decoding.sampling import (Generators, KeyedNoise, SamplingParams, block_uniforms, draw_keyed_rows,
                                     inverse_cdf, prefetch_noise, rows_generators, sample, to_probs)
from dspark.decoding.tree_specdec import DraftTree  # noqa: F401 - what draft_trees returns (decoding verifies it)
from dspark.models.small_batch_linear import use_small_batch_linear


class HostCopy:
    """A drafted batch's tokens [R, G] and confidences [R, G] on the host: ONE device-to-host read for all its
    requests, made when first asked for (a scheduler's confidences, the emitted tokens), never if nobody asks."""

    def __init__(self, tokens: Tensor, confidences: Tensor | None):
        self._tensors, self._rows = (tokens, confidences), None

    def rows(self) -> tuple[list, list | None]:
        if self._rows is None:
            tokens, conf = self._tensors
            host = torch.stack([tokens.double()] + ([] if conf is None else [conf.double()])).tolist()
            self._rows = (host[0], host[1] if conf is not None else None)
        return self._rows


@dataclass
class DraftProposal:
    tokens: Tensor  # LongTensor [n] target ids
    probs: Tensor  # float32 [n, V]: the exact processed distribution each token was sampled from
    # (with a draft vocabulary: the distribution on the subset, zero elsewhere)
    confidences: Tensor | None = None  # [n] c_k (STS-calibrated when drafter.calibration is set)
    host: tuple | None = field(default=None, repr=False, compare=False)  # (HostCopy, row, its tokens, confidences)

    @property
    def host_tokens(self) -> list[int] | None:
        """The tokens as host ints from the batch's one read (`split_proposals`); None when not drafted in a batch
        or when `tokens` was replaced since (writes into the tensor itself are not tracked)."""
        if self.host is None or self.host[2] is not self.tokens:
            return None
        return [int(t) for t in self.host[0].rows()[0][self.host[1]][:self.tokens.shape[0]]]

    @property
    def host_confidences(self) -> list[float] | None:
        """The confidences as host floats from the same read (None likewise, or without confidences)."""
        if self.host is None or self.confidences is None or self.host[3] is not self.confidences:
            return None
        return self.host[0].rows()[1][self.host[1]][:self.confidences.shape[0]]


@dataclass
class DraftState:
    """Per-request drafting state: projected context K/V per layer for verified positions 0..length-1."""
    kv: list[KVBuffer]
    length: int = 0
    last_fused: Tensor | None = None  # eagle3: fused target feature of position length-1
    captured: bool | None = None  # its passes as captured graphs (where its core compiles); None: DSPARK_DECODE_CORE


@dataclass
class DraftTrainOut:
    logits: Tensor  # [M, N] draft logits at the selected (supervised) positions, order (b, anchor, k);
    # N = the draft vocabulary (V without one): column i is target id drafter.draft_ids[i]
    conf_logits: Tensor | None  # [M] confidence logits at the same positions (dspark only)


class Drafter(nn.Module):
    """Base class. Subclasses implement forward (training), extend_context and propose."""

    algo = ""
    draft_vocab_rows: tuple[str, ...] = ()  # parameters whose rows are indexed by draft id (change_draft_vocab)

    def __init__(self, config: DrafterConfig, target_meta: dict):
        super().__init__()
        if config.num_heads is None or config.head_dim is None or config.target_layer_ids is None:
            raise ValueError("DrafterConfig is not resolved; build drafters with build_drafter(cfg, target) "
                             "or load_drafter(path)")
        self.config = config
        self.target_meta = dict(target_meta)
        self.calibration: list[float] | None = None
        self.draft_temperature: float = 1.0  # saved with the checkpoint; see draft_sampling
        self.hidden_size: int = int(target_meta["hidden_size"])
        self.vocab_size: int = int(target_meta["vocab_size"])
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        object.__setattr__(self, "_target", None)  # plain attribute: never a submodule, never in state_dict
        object.__setattr__(self, "_head_rows", None)  # target LM-head rows of the draft vocabulary (cache)
        if config.draft_vocab_size is None:
            self.draft_ids: Tensor | None = None
        else:  # d2t/t2d: saved with the checkpoint (speculators names)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))
            self.register_buffer("draft_ids", torch.zeros(config.draft_vocab_size, dtype=torch.long),
                                 persistent=False)
            self.register_load_state_dict_post_hook(_refresh_after_load)  # a function: the module stays picklable

    # ---- the distribution drafts are sampled from ----------------------------------------
    def draft_sampling(self, sp: SamplingParams) -> SamplingParams:
        """The request's processing with its temperature × `draft_temperature` (greedy stays greedy).
        Invariant: lossless for any value, since acceptance compares the target's p with exactly this q
        (the distribution every draft is drawn from); only how often drafts are accepted changes. Below 1
        helps a drafter broader than its target; measure before setting it (recipes/learning_curve/
        draft_temperature.py: the committed CPU drafter is best at 1, and 0.8 costs it 0.02 τ)."""
        if sp.greedy or self.draft_temperature == 1.0:
            return sp
        return sp.model_copy(update={"temperature": sp.temperature * self.draft_temperature})

    # ---- target sharing -----------------------------------------------------------------
    @property
    def layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def target(self):
        if self._target is None:
            raise RuntimeError("this drafter has no target attached; call drafter.attach_target(target) "
                               "or load_drafter(path, target=target)")
        return self._target

    def attach_target(self, target) -> None:
        """Share the target's frozen embedding and LM head by reference (nothing is copied or saved)."""
        got = (target.hidden_size, target.vocab_size)
        want = (self.hidden_size, self.vocab_size)
        if got != want:
            raise ValueError(f"target {target.name!r} has hidden/vocab {got} but this drafter was built for {want}")
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_head_rows", None)
        use_small_batch_linear(self)  # inference on CPU (training calls keep F.linear)

    # ---- draft vocabulary -----------------------------------------------------------------
    @property
    def draft_vocab_size(self) -> int:
        """N: the size of the vocabulary the drafter predicts over (V without a draft vocabulary)."""
        return self.config.draft_vocab_size or self.vocab_size

    def set_draft_vocab(self, draft_ids: Tensor) -> None:
        """Fix the draft vocabulary: ascending target ids (dspark.drafters.draft_vocab.top_token_ids)."""
        if self.draft_ids is None:
            raise ValueError("this drafter was built without draft_vocab_size; set DrafterConfig.draft_vocab_size")
        ids = draft_vocab.check_draft_ids(draft_ids, self.vocab_size, self.config.draft_vocab_size)
        self.d2t.copy_(draft_vocab.d2t_from_ids(ids))
        self.t2d.copy_(draft_vocab.t2d_from_ids(ids, self.vocab_size))
        self._refresh_draft_vocab()

    def change_draft_vocab(self, draft_ids: Tensor) -> None:
        """Move a trained drafter to another draft vocabulary of the same size (e.g. one counted on new
        data): the weights indexed by draft id (`draft_vocab_rows`) keep each shared token's row and give
        new tokens zeros; the LM-head rows are the frozen target's, so they follow the maps."""
        if self.draft_ids is None:
            raise ValueError("this drafter predicts the full target vocabulary; there is no draft vocabulary to change")
        ids = draft_vocab.check_draft_ids(draft_ids, self.vocab_size, self.config.draft_vocab_size)
        with torch.no_grad():  # t2d is still the old vocabulary's until set_draft_vocab below
            for name in self.draft_vocab_rows:
                param = self.get_parameter(name)
                param.copy_(draft_vocab.carry_rows(param, self.t2d, ids))
        self.set_draft_vocab(ids)

    def _refresh_draft_vocab(self) -> None:
        """Recompute draft_ids from the (possibly just loaded) d2t/t2d, checking they agree."""
        if self.d2t.any() or self.t2d.any():  # all zeros = not set yet (a fresh module before loading)
            self.draft_ids.copy_(draft_vocab.check_maps(self.d2t, self.t2d))
        object.__setattr__(self, "_head_rows", None)

    def _draft_head(self):
        """(weight [N, d], bias) of the target LM head restricted to the draft vocabulary, cached on
        the target's device/dtype (a copy of N rows; rebuilt when the target or the maps change)."""
        head, rows = self.target.lm_head, self._head_rows
        if rows is None or rows[0].device != head.weight.device or rows[0].dtype != head.weight.dtype:
            if not self.t2d.any():
                raise RuntimeError("draft_vocab_size is set but the draft vocabulary is not: call "
                                   "drafter.set_draft_vocab(ids) or build_drafter(cfg, target, draft_ids=ids)")
            ids = self.draft_ids.to(head.weight.device)
            bias = None if head.bias is None else head.bias.detach()[ids]
            rows = (head.weight.detach()[ids].contiguous(), bias)
            object.__setattr__(self, "_head_rows", rows)
        return rows

    def to_target_ids(self, draft_tokens: Tensor) -> Tensor:
        """Draft ids (indices into the draft vocabulary) -> target token ids."""
        if self.draft_ids is None:
            return draft_tokens
        return self.draft_ids.to(draft_tokens.device)[draft_tokens]

    def full_vocab_probs(self, probs: Tensor) -> Tensor:
        """Probabilities [..., N] -> [..., V], zero outside the draft vocabulary (identity without one)."""
        if self.draft_ids is None:
            return probs
        return draft_vocab.extend_to_vocab(probs, self.draft_ids, self.vocab_size)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def embed(self, ids: Tensor) -> Tensor:
        t = self.target
        with torch.no_grad():
            return t.embed(ids.to(t.device)).to(self.device, self.dtype)

    def lm_logits(self, h: Tensor) -> Tensor:
        """Frozen target LM head on (normed) drafter hidden states -> float32 logits [..., N] over the
        draft vocabulary (grad flows to h). Without a draft vocabulary N = V."""
        t = self.target
        x = h.to(t.device, t.dtype)
        if self.draft_ids is None:
            return t.lm_logits(x).float().to(h.device)
        weight, bias = self._draft_head()
        return F.linear(x, weight, bias).float().to(h.device)

    # ---- inference ----------------------------------------------------------------------
    def new_state(self) -> DraftState:
        return DraftState(kv=[KVBuffer() for _ in range(self.config.depth)])

    def reserve_capture_slots(self, requests: int) -> None:
        """Room for `requests` at once in the captured passes' slot store (`draft_slots`), made up front: a store
        that grows as a batch fills retraces every captured pass."""
        from dspark.drafters import draft_slots

        draft_slots.store_of(self).reserve_slots(requests)

    def extend_context(self, state: DraftState, features: Tensor, token_ids: Tensor) -> None:
        raise NotImplementedError

    def extend_contexts(self, states: list[DraftState], features: list[Tensor], token_ids: list[Tensor]) -> None:
        """`extend_context` for many requests (the engine's catch-up). Subclasses may do it in one pass;
        the result must equal one extend_context call per request."""
        for state, f, ids in zip(states, features, token_ids, strict=True):
            self.extend_context(state, f, ids)

    def propose(self, state: DraftState, anchor: int, gamma: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> DraftProposal:
        """γ draft tokens for one request: `propose_batch` with a batch of one (same random draws)."""
        return self.propose_batch([state], [anchor], gamma, sampling, generator)[0]

    @torch.no_grad()
    def propose_batch(self, states: list[DraftState], anchors: list[int], gamma: int | list[int],
                      sampling: SamplingParams | list[SamplingParams],
                      generator: Generators = None) -> list[DraftProposal]:
        """One proposal per request from ONE batched drafter pass over all R requests (contexts of any
        lengths, padded and masked). gamma / sampling / generator: one for all, or a list with one per
        request; max(gamma) positions are drafted and each proposal is cut to its own gamma.

        Each request's proposal has the same distribution as `propose` on its own. Random draws: all of a
        block's uniforms before drafting, request-major (`BlockDraws`; a keyed request is drawn by its key at
        each position), so R = 1 reproduces `propose` exactly. With
        one generator per request, request r's draws come from its own generator only, so its
        proposal is exactly `propose` on its own with that generator, whatever else is in the batch.
        """
        gammas, sps = self._batch_args(states, anchors, gamma, sampling)
        if isinstance(generator, (list, tuple)) and len(generator) != len(states):
            raise ValueError(f"propose_batch got {len(states)} states but {len(generator)} generators; pass one "
                             "generator per state (or a single one)")
        if not states:
            return []
        anchor_ids = torch.tensor([int(a) for a in anchors], dtype=torch.long, device=self.device)
        return self.draft_batch(states, anchor_ids, gammas, RowSampling([self.draft_sampling(sp) for sp in sps]),
                                generator)

    def draft_batch(self, states: list[DraftState], anchors: Tensor, gammas: list[int], rows: "RowSampling",
                    generator: Generators) -> list[DraftProposal]:
        """The batched drafting pass (subclasses): anchors LongTensor [R], validated gammas -> proposals."""
        raise NotImplementedError

    def _batch_args(self, states, anchors, gamma, sampling) -> tuple[list[int], list[SamplingParams]]:
        n = len(states)
        gammas = [int(g) for g in gamma] if isinstance(gamma, (list, tuple)) else [int(gamma)] * n
        sps = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
        if not len(anchors) == len(gammas) == len(sps) == n:
            raise ValueError(f"propose_batch got {n} states but {len(anchors)} anchors, {len(gammas)} gammas and "
                             f"{len(sps)} sampling params; pass one per state (or a single gamma / sampling)")
        for g in gammas:
            self.check_gamma(g)
        return gammas, sps

    def check_gamma(self, gamma: int) -> None:
        if not 1 <= gamma <= self.config.block_size:
            raise ValueError(f"gamma={gamma} must be in 1..block_size={self.config.block_size}")

    def _check_features(self, features: Tensor, token_ids: Tensor) -> None:
        width = self.hidden_size * len(self.layer_ids)
        if features.dim() != 2 or features.shape[1] != width or features.shape[0] != token_ids.shape[0]:
            raise ValueError(f"extend_context needs features [n, {width}] and token_ids [n], got "
                             f"{tuple(features.shape)} and {tuple(token_ids.shape)}")

    # The algorithm the others are compared against in evaluation tables (ratios X/other).
    comparison_reference: ClassVar[bool] = False

    @property
    def slots_per_anchor(self) -> int:
        """Drafter positions computed per training anchor (what a step's FLOPs scale with)."""
        return self.block_len

    @property
    def context_params_per_token(self) -> int:
        """Trainable weights every context token passes through in training (the FLOPs model's 6·N per
        context token): the fused-feature projection `fc`, plus what each algorithm adds (DFlash: the
        layers' K/V projections of the injected context)."""
        return sum(p.numel() for p in self.fc.parameters() if p.requires_grad)

    @property
    def trains_every_position(self) -> bool:
        """True when training supervises every eligible position (Eagle3's dense TTT) rather than the
        sampled anchors."""
        return False

    @property
    def has_confidences(self) -> bool:
        """True when proposals carry confidences c_1..c_γ (what the dynamic/threshold schedulers, the
        threshold sweep and STS calibration need). Only DSpark with its confidence head has them."""
        return False

    def confidences(self, logits: Tensor) -> Tensor:
        """c_k = σ(logit_k / T_k) with the STS temperatures when calibrated, else σ(logit_k)."""
        if self.calibration is None:
            return torch.sigmoid(logits.float())
        n = logits.shape[-1]  # logits [..., n]: positions 1..n on the last axis
        if len(self.calibration) < n:
            raise ValueError(f"calibration has {len(self.calibration)} temperatures but {n} "
                             "positions were drafted; recalibrate with the drafter's block_size")
        temps = torch.tensor(self.calibration[:n], device=logits.device)
        return torch.sigmoid(logits.float() / temps)


def _refresh_after_load(module: Drafter, _incompatible_keys) -> None:
    module._refresh_draft_vocab()


class RowSampling:
    """Per-request SamplingParams applied to rows: logits [R, ..., V] -> probs with row r processed by
    `to_probs(·, sps[r])`. Requests with identical params share one to_probs call (the same math as
    the single-request path); greedy rows come out one-hot."""

    def __init__(self, sps: list[SamplingParams]):
        groups: dict[tuple, list[int]] = {}
        for r, sp in enumerate(sps):
            groups.setdefault(tuple(sp.model_dump().values()), []).append(r)
        self.sps = sps
        self.groups = [(sps[rows[0]], rows) for rows in groups.values()]
        self._indices: dict[torch.device, list[Tensor]] = {}  # the groups' rows on a device, made once

    @property
    def single(self) -> bool:
        """Every row samples with the same parameters."""
        return len(self.groups) == 1

    def probs(self, logits: Tensor) -> Tensor:
        if len(self.groups) == 1:
            return to_probs(logits, self.sps[0])
        indices = self._indices.get(logits.device)
        if indices is None:
            indices = self._indices[logits.device] = [host_values(rows, logits.device) for _, rows in self.groups]
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for (sp, _), idx in zip(self.groups, indices):
            out[idx] = to_probs(logits[idx], sp)
        return out


def drafting_rows(gammas: list[int], k: int, generator: Generators, device=None) -> tuple[slice | Tensor, Generators]:
    """The requests that draft position k (k < γ_r) and their generators, from the host's γs (nothing read
    back from the device): an index into the batch (every row: a slice, no copy) and `rows_generators`."""
    live = [int(g > k) for g in gammas]
    if all(live):
        return slice(None), generator
    return host_values([r for r, on in enumerate(live) if on], device), rows_generators(generator, live)


class BlockDraws:
    """The random draws of one drafted block [R, max γ], position by position. Requests drawing from streams
    (counter streams or torch generators: one for all, or one per request) have every uniform drawn up front
    (`block_uniforms`: counter streams of all requests in one call), so
    a position costs one `inverse_cdf` over all rows and no host work; requests drawing by position (KeyedNoise)
    are drawn by their key at each position they draft. Rows past their γ_r get a token never returned.
    `up_front = False` (class switch, for references and benchmarks): the streams are drawn position by position
    instead — on a counter stream or a CPU generator the very same values; a CUDA generator's differ (same law)."""

    up_front = True

    def __init__(self, generator: Generators, gammas: list[int], device):
        self.generator, self.gammas = generator, gammas
        per_request = list(generator) if isinstance(generator, (list, tuple)) else [generator] * len(gammas)
        self.keyed = [(r, g) for r, g in enumerate(per_request) if isinstance(g, KeyedNoise)]
        self.uniforms = block_uniforms(generator, gammas, device) if self.up_front else None
        # keyed rows draw position by position, from noise made for the whole block at once
        prefetch_noise([(noise, noise.cursor + k) for r, noise in self.keyed for k in range(gammas[r])])

    def draw(self, probs: Tensor, k: int) -> tuple[slice | Tensor, Tensor]:
        """probs [R, N] of position k -> (the rows drawn, their tokens in probs' columns)."""
        if self.uniforms is None:
            live, live_generators = drafting_rows(self.gammas, k, self.generator, probs.device)
            return live, sample(probs[live], live_generators).to(probs.device)
        tokens = inverse_cdf(probs, self.uniforms[:, k:k + 1])
        keyed = [(r, noise) for r, noise in self.keyed if k < self.gammas[r]]
        if keyed:  # every keyed row drafting position k in one argmax
            rows = host_values([r for r, _ in keyed], probs.device)
            tokens[rows] = draw_keyed_rows([noise for _, noise in keyed], probs[rows]).to(probs.device)
        return slice(None), tokens


def drafted_entries(gammas: list[int], device=None) -> slice | Tensor:
    """The (request, position) entries with k < γ_r of a [R, max γ] batch, as an index into its flattened
    rows (request-major, as `rows_generators(generator, gammas)` lays out the generators): a slice when every
    request drafts max γ."""
    width = max(gammas)
    if min(gammas) == width:
        return slice(None)
    return host_values([r * width + k for r, g in enumerate(gammas) for k in range(g)], device)


def split_proposals(tokens: Tensor, probs: Tensor, confidences: Tensor | None,
                    gammas: list[int]) -> list[DraftProposal]:
    """Batched drafts tokens [R, G], probs [R, G, V], confidences [R, G] -> one proposal per request,
    cut to its own γ_r. Their host copies share ONE read of the whole batch (`HostCopy`), so a step that needs
    the tokens or confidences on the host waits for the device once, not once per request."""
    copy, out = HostCopy(tokens, confidences), []
    for r, g in enumerate(gammas):
        row_tokens, row_conf = tokens[r, :g], None if confidences is None else confidences[r, :g]
        out.append(DraftProposal(tokens=row_tokens, probs=probs[r, :g], confidences=row_conf,
                                 host=(copy, r, row_tokens, row_conf)))
    return out


def selected_tokens(input_ids: Tensor, anchors: Tensor, steps: int, offset: int) -> Tensor:
    """Teacher-forced tokens x[t + offset + k] for k = 0..steps-1 (clamped at the end): [B, N, steps]."""
    pos = anchors.unsqueeze(-1) + offset + torch.arange(steps, device=anchors.device)
    pos = pos.clamp(max=input_ids.shape[1] - 1)
    return input_ids.gather(1, pos.flatten(1)).view_as(pos)
