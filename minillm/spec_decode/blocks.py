"""Block drafting at serving time (chapter 06b): DFlash, DDTree and DSpark on one drafter.

One drafter forward per step fills, for every sequence of the batch at once, a block [last
token, MASK, ..., MASK] (:class:`~.drafters.BlockDrafter`); its context rows are the target's
states from several layers at the positions the target just committed, kept in the drafter's
own paged cache (only their keys and values matter), so each round adds only the new ones. The
three methods differ in what they make of the block's per-position distributions:

- ``dflash``: the argmax (or a draw) at each position, a chain of k;
- ``ddtree``: a best-first tree under a node budget (:func:`.trees.best_first_tree`), verified
  in one target pass with the ancestor mask; the longest accepted path wins;
- ``dspark``: a chain decoded left to right with the Markov head (position i sees token i - 1),
  each token with a confidence; a sequence's draft stops at the first token whose confidence is
  below ``confidence_threshold`` (decided before the target runs: non-anticipating), and the
  batch shares ``verify_budget`` draft tokens, given out by :func:`fill_budget`.

Shapes: B sequences, S the block size, D the width, Vd the draft vocabulary.
"""
from __future__ import annotations

import heapq
import math
from collections import deque

import torch

from ..engine.sampler import SamplingBatch, filtered_probs
from ..engine.sequence import Draft
from .drafters import BlockDrafter, DraftHead, vocab_lookup
from .inputs import SpecInput
from .proposers import PagedDrafter
from .trees import best_first_tree


def early_exit(confidences: list[float], threshold: float) -> int:
    """How many leading tokens to keep: up to (not including) the first whose confidence is
    below ``threshold``."""
    for i, c in enumerate(confidences):
        if c < threshold:
            return i
    return len(confidences)


def fill_budget(confidences: list[list[float]], budget: int) -> list[int]:
    """DSpark's shared budget: confidences[s][i] = P(token i of sequence s is accepted | the
    ones before it were). A token is worth its prefix probability prod_{j<=i} c[s][j] (the
    chance it is accepted at all); the ``budget`` tokens of highest worth are taken greedily
    (a sequence's tokens in order, since the product only falls), which maximises the expected
    number accepted. Returns how many tokens each sequence keeps (ties: the earlier sequence)."""
    keep = [0] * len(confidences)
    heap = [(-c[0], s) for s, c in enumerate(confidences) if c]
    worth = [c[0] if c else 0.0 for c in confidences]
    heapq.heapify(heap)
    while heap and budget > 0:
        _, s = heapq.heappop(heap)
        keep[s] += 1
        budget -= 1
        if keep[s] < len(confidences[s]):
            worth[s] *= confidences[s][keep[s]]
            heapq.heappush(heap, (-worth[s], s))
    return keep


class BlockProposer:
    """``mode``: dflash, ddtree or dspark. k: the most tokens (or tree depth) drafted;
    ``tree_nodes`` / ``tree_topk``: DDTree's node budget and candidates per depth;
    ``budget`` / ``threshold``: DSpark's shared budget per step and early-exit threshold."""

    def __init__(self, drafter: BlockDrafter, head: DraftHead, embed, mode: str, k: int,
                 num_blocks: int, block_size: int, tree_nodes: int = 16, tree_topk: int = 4,
                 budget: int | None = None, threshold: float = 0.0) -> None:
        self.drafter, self.head, self.embed, self.mode = drafter, head, embed, mode
        if not 1 <= k < drafter.cfg.block_size:
            raise ValueError(f"speculative_config num_speculative_tokens must be in [1, "
                             f"{drafter.cfg.block_size - 1}] for this block drafter (its block "
                             f"is {drafter.cfg.block_size}), got {k}")
        self.k = k
        self.tree_nodes, self.tree_topk = tree_nodes, tree_topk
        self.budget, self.threshold = budget, threshold
        self.hidden_layers = drafter.cfg.target_layers
        self.max_nodes = tree_nodes if mode == "ddtree" else self.k
        dev, dtype = embed.weight.device, embed.weight.dtype
        self.cache = PagedDrafter(drafter.block_cfg, num_blocks, block_size, dev, dtype)
        self.last: dict[int, dict] = {}       # seq id -> the last block's details (for plots)
        self.pending: dict[int, list[float]] = {}   # seq id -> confidences of its live draft
        # (confidences, accepted) of the last verified DSpark drafts, for calibration plots
        self.calibration: deque[tuple[list[float], int]] = deque(maxlen=10_000)

    # ---- the drafter pass ---------------------------------------------------------------------
    def _forward(self, x, cache, positions):
        return self.drafter(x[..., :-1], x[0, :, -1] > 0.5, positions, cache)

    def _rows(self, inp: SpecInput, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's rows [n (+ S), D + 1] (the last column flags context rows) and, if it
        drafts, its mask over them (context rows causal; block rows see all rows)."""
        dtype = self.embed.weight.dtype
        ctx = self.drafter.context(feats.to(dtype))
        rows = [torch.cat([ctx, ctx.new_ones(len(ctx), 1)], -1)]
        if not inp.max_depth:
            return rows[0], None
        s = self.drafter.cfg.block_size
        anchor = self.embed(torch.tensor([inp.seq.token_ids[-1]], device=ctx.device))
        block = torch.cat([anchor, self.drafter.mask_embedding.to(dtype).expand(s - 1, -1)])
        rows.append(torch.cat([block, block.new_zeros(s, 1)], -1))
        n = len(ctx)
        mask = torch.ones(n + s, n + s, dtype=torch.bool, device=ctx.device).tril()
        mask[n:, :] = True
        return torch.cat(rows), mask

    @torch.inference_mode()
    def propose(self, inputs: list[SpecInput], hidden: dict) -> list[Draft | None]:
        feats = torch.cat([hidden[layer] for layer in self.hidden_layers], -1)
        work, rows, masks = [], [], []
        for inp in inputs:
            if inp.max_depth and inp.start + len(inp.rows) != inp.seq.num_tokens - 1:
                raise RuntimeError(f"block drafter: sequence {inp.seq.seq_id} drafts from "
                                   f"position {inp.seq.num_tokens - 1} but its context ends at "
                                   f"{inp.start + len(inp.rows)}")
            x, m = self._rows(inp, feats[torch.tensor(inp.rows, device=feats.device)])
            work.append((inp.seq.seq_id, inp.start))
            rows.append(x)
            masks.append(m)
        outs = self.cache.run(self._forward, work, rows, masks)
        live = [i for i, inp in enumerate(inputs) if inp.max_depth]
        drafts: list[Draft | None] = [None] * len(inputs)
        if not live:
            return drafts
        s = self.drafter.cfg.block_size
        h = torch.stack([outs[i][-(s - 1):] for i in live])          # [B, S - 1, D]
        sub = [inputs[i] for i in live]
        make = {"dflash": self._chain, "ddtree": self._tree, "dspark": self._dspark}[self.mode]
        for i, d in zip(live, make(sub, h)):
            drafts[i] = d
        return drafts

    def _depth(self, inp: SpecInput) -> int:
        return min(self.k, inp.max_depth)

    # ---- dflash: a chain of independent picks -------------------------------------------------
    def _chain(self, inputs: list[SpecInput], h: torch.Tensor) -> list[Draft | None]:
        logits = self.head(h).float()                                 # [B, S - 1, Vd]
        out = []
        for inp, lg in zip(inputs, logits):
            n = self._depth(inp)
            if inp.params.greedy:
                toks, q = self.head.ids[lg[:n].argmax(-1)].tolist(), None
            else:
                q = self._probs(lg[:n], inp)
                toks = torch.multinomial(q, 1, generator=inp.generator)[:, 0].tolist()
            out.append(Draft.chain(toks, q))
            self.last[inp.seq.seq_id] = {"tokens": toks}
        return out

    def _probs(self, logits: torch.Tensor, inp: SpecInput) -> torch.Tensor:
        """[n, Vd] draft logits -> the request's tempered, filtered distributions [n, V]."""
        batch = SamplingBatch.from_params([inp.params] * len(logits),
                                          [inp.generator] * len(logits), logits.device)
        return filtered_probs(self.head.full(logits), batch)

    # ---- ddtree: best-first under a node budget -----------------------------------------------
    def _tree(self, inputs: list[SpecInput], h: torch.Tensor) -> list[Draft | None]:
        logp = self.head(h).float().log_softmax(-1)
        top = logp.topk(self.tree_topk, dim=-1)                       # [B, S - 1, K]
        values, ids = top.values.tolist(), self.head.ids[top.indices].tolist()
        out = []
        for b, inp in enumerate(inputs):
            n = self._depth(inp)
            parents, picks = best_first_tree(values[b][:n], self.tree_nodes)
            tokens = [ids[b][d][r] for d, r in picks]
            self.last[inp.seq.seq_id] = {"tokens": tokens, "parents": parents, "picks": picks,
                                         "logp": values[b][:n], "candidates": ids[b][:n]}
            out.append(Draft(tokens, parents))
        return out

    # ---- dspark: Markov chain, confidences, early exit, shared budget -------------------------
    def _dspark(self, inputs: list[SpecInput], h: torch.Tensor) -> list[Draft | None]:
        d = self.drafter
        base = self.head(h).float()
        lookup = self._lookup()
        prev = lookup[torch.tensor([inp.seq.token_ids[-1] for inp in inputs], device=h.device)]
        tokens, conf, qs = [], [], []
        for j in range(self.k):
            logits = base[:, j] + d.markov(h[:, j], prev).float()
            logp = logits.log_softmax(-1)
            pick = logp.argmax(-1)
            q_rows = [None] * len(inputs)
            for b, inp in enumerate(inputs):
                if not inp.params.greedy:
                    q = self._probs(logits[b:b + 1], inp)[0]
                    tok = int(torch.multinomial(q, 1, generator=inp.generator))
                    pick[b] = int(lookup[tok])          # q is zero off the draft vocabulary
                    q_rows[b] = q
            c = torch.sigmoid(d.confidence(h[:, j], prev, logp.gather(-1, pick[:, None])[:, 0]))
            tokens.append(self.head.ids[pick].tolist())
            conf.append(c.float().tolist())
            qs.append(q_rows)
            prev = pick
        per_seq = [[conf[j][b] for j in range(self._depth(inp))] for b, inp in enumerate(inputs)]
        cut = [early_exit(c, self.threshold) for c in per_seq]
        budget = self.budget if self.budget is not None else math.inf
        lengths = fill_budget([c[:n] for c, n in zip(per_seq, cut)],
                              int(min(budget, sum(cut))))
        out = []
        for b, inp in enumerate(inputs):
            n = lengths[b]
            sid = inp.seq.seq_id
            self.last[sid] = {"tokens": [tokens[j][b] for j in range(len(per_seq[b]))],
                              "confidence": per_seq[b], "exit": cut[b], "kept": n}
            if not n:
                out.append(None)
                continue
            self.pending[sid] = per_seq[b][:n]
            q = None if inp.params.greedy else torch.stack([qs[j][b] for j in range(n)])
            out.append(Draft.chain([tokens[j][b] for j in range(n)], q))
        return out

    def _lookup(self) -> torch.Tensor:
        """[V]: a token's draft-vocabulary index, Vd for one outside it (cached)."""
        if not hasattr(self, "_lookup_table"):
            table = vocab_lookup(self.head.ids, self.head.vocab_size).to(self.head.ids.device)
            self._lookup_table = torch.where(table >= 0, table, self.drafter.cfg.draft_vocab)
        return self._lookup_table

    def observe(self, seq_id: int, accepted: int) -> None:
        """After verification: how many of the draft's tokens were accepted (calibration)."""
        conf = self.pending.pop(seq_id, None)
        if conf is not None:
            self.calibration.append((conf, accepted))

    def fork(self, parent_id: int, child_id: int) -> None:
        self.cache.fork(parent_id, child_id)

    def release(self, seq_id: int) -> None:
        self.cache.release(seq_id)
        self.last.pop(seq_id, None)
        self.pending.pop(seq_id, None)
