"""DSpark: DFlash backbone + sequential head + confidence head (paper §3.1, §3.2.1).

The anchor itself is the first prediction slot: γ inputs [emb(x_0), MASK × (γ-1)] at positions
t..t+γ-1 give hidden states h_1..h_γ and base logits U_1..U_γ (slot k-1 predicts token t+k). The
sequential head then samples left to right from p_k = to_probs(U_k + B_k(x_0, x_<k)), so each
returned probability row is the exact distribution its token was drawn from (lossless verification).
Many requests draft together: one backbone pass and one LM-head call for all R blocks, then each
sequential step k runs for all R requests at once.
Training teacher-forces x_{k-1} with the ground-truth tokens t+k-1 (x_0 = the anchor token).
"""
from __future__ import annotations

import torch
from torch import Tensor

from dspark.drafters import chain_capture
from dspark.drafters.base import (BlockDraws, DraftProposal, DraftTrainOut, DraftTree, RowSampling,
                                  selected_tokens, split_proposals)
from dspark.drafters.config import DrafterConfig
from dspark.drafters.dflash import DFlashDrafter
from dspark.drafters.heads import ConfidenceHead, build_sequential_head
from dspark.drafters.layers import init_weights
from dspark.decoding.sampling import (Generators, KeyedNoise, SamplingParams, draw_distinct, sample,
                                      sibling_proposals, to_probs)


class DSparkDrafter(DFlashDrafter):
    algo = "dspark"

    @property
    def draft_vocab_rows(self) -> tuple[str, ...]:
        """The sequential head's bias B_k has one row per draft token (change_draft_vocab carries them)."""
        return () if self.markov_head is None else ("markov_head.markov_w2.weight",)

    def __init__(self, config: DrafterConfig, target_meta: dict):
        super().__init__(config, target_meta)
        d, r = self.hidden_size, config.rank
        self.markov_head = build_sequential_head(config.head, self.vocab_size, r, d, self.draft_vocab_size)
        conf_dim = d + (r if self.markov_head is not None else 0)
        self.confidence_head = ConfidenceHead(conf_dim) if config.confidence_head else None
        for head in (self.markov_head, self.confidence_head):
            if head is not None:
                init_weights(head, config.init_std)

    comparison_reference = True  # the paper's method: evaluation ratios are DSpark / other

    @property
    def has_confidences(self) -> bool:
        return self.confidence_head is not None

    @property
    def block_len(self) -> int:
        return self.config.block_size  # anchor + γ-1 masks

    @property
    def first_pred_slot(self) -> int:
        return 0

    def prev_embed(self, prev_tokens: Tensor) -> Tensor | None:
        return None if self.markov_head is None else self.markov_head.prev_embed(prev_tokens)

    # ---- training -------------------------------------------------------------------------
    def predict_train(self, h: Tensor, input_ids: Tensor, anchors: Tensor, select: Tensor) -> DraftTrainOut:
        prev = selected_tokens(input_ids, anchors, h.shape[2], offset=0)  # x_{k-1} = token t+k-1
        prev_emb = self.prev_embed(prev)
        logits = self.lm_logits(h[select])
        if self.markov_head is not None:
            logits = logits + self.markov_head.block_bias(prev_emb, h, select).float()
        conf = None
        if self.confidence_head is not None:
            conf = self.confidence_head(h[select], None if prev_emb is None else prev_emb[select])
        return DraftTrainOut(logits=logits, conf_logits=conf)

    def sequential_logits(self, u: Tensor, h: Tensor, prev_tokens: Tensor) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced U_k + B_k and confidence logits for one block: u [γ, V], h [γ, d],
        prev_tokens [γ] = (x_0, ..., x_{γ-1}). Same math as sampling, for tests and analysis."""
        prev_emb = self.prev_embed(prev_tokens.to(self.device))
        logits = u
        if self.markov_head is not None:
            logits = u + self.markov_head.block_bias(prev_emb, h).float()
        conf = None if self.confidence_head is None else self.confidence_head(h, prev_emb)
        return logits, conf

    # ---- inference ------------------------------------------------------------------------
    def sample_blocks(self, h: Tensor, anchors: Tensor, gammas: list[int], rows: RowSampling,
                      generator: Generators, states=()) -> list[DraftProposal]:
        """Left to right, each step batched over the R requests: p_k = to_probs(U_k + B_k(x_{k-1}, state))
        per row with its request's params; x_k ~ p_k; c_k from [h_k; W1[x_{k-1}]].
        h [R, G, d]; rows past their own γ_r are computed (and drawn: `BlockDraws`) but never returned.
        With a draft vocabulary everything runs on its N columns; x_k is mapped to its target id (what
        W1 reads next) and the returned rows are extended by zeros to V."""
        u = self.lm_logits(h)  # [R, G, N]: all base logits in one LM-head call
        draws = BlockDraws(generator, gammas, self.device)
        if rows.single and chain_capture.capturable(draws) and chain_capture.wanted(self, states):  # one captured graph
            tokens, probs, conf_logits = chain_capture.run(self, u, h, anchors, draws, rows.sps[0])
        else:
            tokens, probs, conf_logits = self.draft_chain(u, h, anchors, rows.probs, draws.draw)
        conf = None if conf_logits is None else self.confidences(conf_logits)
        return split_proposals(tokens, self.full_vocab_probs(probs), conf, gammas)

    def draft_chain(self, u: Tensor, h: Tensor, anchors: Tensor, probs_of,
                    draw) -> tuple[Tensor, Tensor, Tensor | None]:
        """`sample_blocks`' γ-loop: u [R, G, N] base logits, h [R, G, d], anchors [R]; probs_of(logits [R, N]) ->
        probs; draw(probs [R, N], k) -> (rows drawn, their draft ids) -> tokens [R, G] (target ids), probs
        [R, G, N], confidence logits [R, G] or None. Tensors only between positions (no host reads), so with
        every draw made before the loop (uniform table; keyed rows' noise table) and one sampling setting,
        torch.compile captures it whole (`chain_capture`)."""
        head, conf_head = self.markov_head, self.confidence_head
        tokens = torch.zeros(u.shape[:2], dtype=torch.long, device=u.device)  # [R, G]
        probs = torch.empty(u.shape, dtype=torch.float32, device=u.device)
        state = None if head is None else head.initial_state(h[:, 0])
        prev, conf_logits = anchors, []
        for k in range(h.shape[1]):
            prev_emb = self.prev_embed(prev)  # [R, r]
            logits = u[:, k]
            if head is not None:
                state, bias = head.step(state, prev_emb, h[:, k])
                logits = logits + bias.float()
            probs[:, k] = probs_of(logits)
            live, drawn = draw(probs[:, k], k)
            tokens[live, k] = self.to_target_ids(drawn)
            if conf_head is not None:
                conf_logits.append(conf_head(h[:, k], prev_emb))
            prev = tokens[:, k]
        return tokens, probs, torch.stack(conf_logits, dim=-1) if conf_logits else None

    @torch.no_grad()
    def draft_tree(self, state, anchor: int, gamma: int, branching: tuple[int, ...], sampling: SamplingParams,
                   generator: torch.Generator | None) -> DraftTree:
        """A draft tree of depth γ for one request: `draft_trees` with a batch of one."""
        return self.draft_trees([state], [anchor], gamma, branching, [sampling], [generator])[0]

    @torch.no_grad()
    def draft_trees(self, states: list, anchors: list[int], gamma: int, branching: tuple[int, ...],
                    samplings: list[SamplingParams], generators: list[torch.Generator | None]) -> list[DraftTree]:
        """One draft tree of depth γ per request: ONE backbone pass over all R blocks (as `draft_batch`),
        then `sample_tree` per request with its own sampling params and generator (so request r's tree
        is exactly `draft_tree` on its own)."""
        first = self.first_pred_slot
        anchor_ids = torch.tensor([int(a) for a in anchors], dtype=torch.long, device=self.device)
        h = self.blocks_hidden(states, anchor_ids)[:, first:first + gamma]  # [R, γ, d]
        return [self.sample_tree(h[r: r + 1], int(anchors[r]), branching, samplings[r], generators[r])
                for r in range(len(states))]

    @torch.no_grad()
    def sample_tree(self, h: Tensor, anchor: int, branching: tuple[int, ...], sampling: SamplingParams,
                    generator: torch.Generator | KeyedNoise | None) -> DraftTree:
        """A draft tree for one request from its block's hidden states h [1, γ, d]: every node at depth
        k−1 (the anchor at depth 0) gets branching[k−1] distinct children (1 past the tuple), drawn
        without replacement from q_k(· | its path) = draft_sampling(U_k + B_k(path)), level by level.
        Each child keeps the row it was drawn from (q_k without its earlier siblings, renormalised): what
        lossless tree verification divides by. A child past its node's support (top-k, top-p) is left
        out. With one child per node this is `sample_blocks`' chain. A KeyedNoise generator (a seeded
        engine request) takes the top-n of each node's row under the noise of the level's output position
        (cursor + depth − 1), its first child coupled with the target's keyed sample there; a greedy
        request the n most likely tokens (`_tree_children`)."""
        u = self.lm_logits(h[0])  # [γ, N]: base logits, shared by every path
        sp, head = self.draft_sampling(sampling), self.markov_head
        state = None if head is None else head.initial_state(h[:, 0])  # one row per node of the level
        prev = torch.tensor([anchor], device=self.device)
        level, tokens, parents, depths, rows = [-1], [], [], [], []
        for k in range(h.shape[1]):
            n = branching[k] if k < len(branching) else 1
            logits = u[k].expand(len(level), -1)
            if head is not None:
                state, bias = head.step(state, self.prev_embed(prev), h[0, k].expand(len(level), -1))
                logits = logits + bias.float()
            picks, proposals = self._tree_children(logits, n, sp, generator, k)  # [W, n], [W, n, N]
            real = proposals.sum(-1) > 0  # [W, n]: children that are proposals
            children = real.sum(1)
            parents += [p for p, c in zip(level, children.tolist()) for _ in range(c)]
            drawn = self.to_target_ids(picks[real])
            level = list(range(len(tokens), len(tokens) + len(drawn)))
            tokens += drawn.tolist()
            depths += [k + 1] * len(drawn)
            rows.append(proposals[real])
            prev = drawn
            if state is not None:
                state = state.repeat_interleave(children, 0)  # each child carries its parent's state
        return DraftTree(torch.tensor(tokens, device=self.device), parents, depths,
                         self.full_vocab_probs(torch.cat(rows)))

    def _tree_children(self, logits: Tensor, n: int, sp: SamplingParams, generator, level: int) -> tuple[Tensor, Tensor]:
        """(picks [W, n'] draft-vocabulary columns, the row each was drawn from [W, n', N]) of the W nodes of
        one level, from their logits [W, N]. Greedy requests take the n most likely tokens of the untempered
        q: the target keeps exactly the child equal to its argmax, so any q with q(child) > 0 is lossless."""
        if sp.greedy:
            q = torch.softmax(logits.float(), dim=-1)
            picks = q.topk(min(n, q.shape[-1]), dim=-1).indices
            return picks, sibling_proposals(q, picks)
        q = to_probs(logits, sp)
        if isinstance(generator, KeyedNoise):  # keyed: the top-n under the noise of this output position
            picks = generator.top_distinct(q, n, generator.cursor + level).to(self.device)
        elif n == 1:  # one child: the chain's own draw
            return sample(q, generator).to(self.device)[:, None], q[:, None]
        else:
            picks = draw_distinct(q, n, generator).to(self.device)
        return picks, sibling_proposals(q, picks)
