"""Drafters at serving time: each turns what the target just committed into the next draft,
for every sequence of the step at once.

- :class:`NgramProposer`: prompt lookup, no model.
- :class:`DraftModelProposer`: a small LM with its own paged KV cache, drafting a chain.
- :class:`FeatureProposer`: EAGLE / MTP on the target's last hidden states, a chain (MTP) or
  EAGLE-2's dynamic tree, with its own (one-layer) paged KV cache.
- :class:`MedusaProposer`: Medusa's heads and static sparse tree, no cache.

A drafter with a cache keeps it in step with the target: the target's committed positions
from ``start`` on are (re)computed in the drafter too, so whatever the drafter had written past
``start`` (its own guesses, now verified or rejected) is simply overwritten. Shapes: B
sequences, D the width, Vd the draft vocabulary.
"""
from __future__ import annotations

import torch

from ..attention.paged import batch_order, build_metadata, default_paged_backend, get_paged_backend
from ..cache.block_manager import BlockManager
from ..cache.pool import PagedBatch, PagedKVPool
from ..config import ModelConfig
from ..engine.cpu_forward import CpuForward
from ..engine.sampler import SamplingBatch, filtered_probs
from ..engine.sequence import Draft
from ..model.packed import can_pack_linears, pack_linears
from .drafters import DraftHead
from .inputs import SpecInput
from .ngram import prompt_lookup
from .trees import medusa_tree, top_nodes, tree_parents


class NgramProposer:
    """Prompt lookup over each sequence's own tokens (:func:`.ngram.prompt_lookup`)."""

    hidden_layers: tuple[int, ...] = ()
    catches_up = True             # it reads the sequence's tokens, whenever it is asked

    def __init__(self, k: int, max_n: int = 3, min_n: int = 1) -> None:
        self.k, self.max_n, self.min_n = k, max_n, min_n
        self.max_nodes = k

    def propose(self, inputs: list[SpecInput], hidden: dict) -> list[Draft | None]:
        out = []
        for inp in inputs:
            toks = prompt_lookup(inp.seq.token_ids, min(self.k, inp.max_depth), self.max_n,
                                 self.min_n) if inp.max_depth else []
            out.append(Draft.chain(toks) if toks else None)
        return out

    def fork(self, parent_id: int, child_id: int) -> None: ...

    def release(self, seq_id: int) -> None: ...


class PagedDrafter:
    """A drafter's own paged KV cache: a block manager and a pool, like the target's, keyed by
    the same sequence ids. ``run`` computes new positions of several sequences in one pass.
    ``backend``: its paged attention (default: the engine's default for the device and dtype,
    the C++ kernel on a CPU where it builds)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, backend: str | None = None) -> None:
        self.cfg, self.device = cfg, device
        self.blocks = BlockManager(num_blocks, block_size, watermark=0.0)
        self.pool = PagedKVPool(cfg, num_blocks, block_size, device, dtype)
        self.attn = get_paged_backend(backend or default_paged_backend(device, dtype))

    def run(self, forward, work: list[tuple[int, int]], inputs: list[torch.Tensor],
            masks: list[torch.Tensor | None] | None = None,
            positions: list[list[int]] | None = None) -> list[torch.Tensor]:
        """work[i] = (seq id, first position); inputs[i] [n_i, ...] the rows of positions
        first.. (or ``positions[i]``, with tree ``masks[i]``); forward(x [1, R, ...], cache,
        positions [R]) -> [1, R, D]. Anything the sequence had from ``first`` on is dropped.
        Returns each sequence's outputs [n_i, D], in the order given."""
        masks = masks or [None] * len(work)
        counts = [len(x) for x in inputs]
        for (sid, first), n in zip(work, counts):
            self._room(sid, first, first + n)
        order = batch_order([f for _, f in work], counts, [m is not None for m in masks])
        pos = [positions[i] if positions else list(range(work[i][1], work[i][1] + counts[i]))
               for i in order]
        meta = build_metadata([self.blocks.tables[work[i][0]] for i in order],
                              [work[i][1] for i in order], [counts[i] for i in order],
                              self.blocks.block_size, self.device, [masks[i] for i in order],
                              q_per_kv=self.cfg.n_heads // self.cfg.n_kv_heads,
                              direct=self.attn.reads_direct)
        x = torch.cat([inputs[i] for i in order])[None]
        flat = torch.tensor([p for ps in pos for p in ps], device=self.device)
        out = forward(x, PagedBatch(self.pool, meta, self.attn), flat)[0]
        pieces = dict(zip(order, out.split([counts[i] for i in order])))
        return [pieces[i] for i in range(len(work))]

    def _room(self, sid: int, first: int, total: int) -> None:
        b = self.blocks
        if sid not in b.tables:
            if first:
                raise RuntimeError(f"drafter has no cache for sequence {sid} but was asked to "
                                   f"continue it from position {first}")
            b.allocate(sid, 0)
        b.truncate(sid, min(first, b.filled[sid]))
        self.pool.copy_blocks(b.reserve(sid, total))

    def length(self, sid: int) -> int:
        return self.blocks.filled.get(sid, 0)

    def fork(self, parent_id: int, child_id: int) -> None:
        if parent_id in self.blocks.tables:
            self.blocks.fork(parent_id, child_id)

    def release(self, seq_id: int) -> None:
        self.blocks.free(seq_id)


def packed(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its linears packed for oneDNN (in place, as the runner packs the target)
    where that applies to its device and dtype; the same parameters and state dict."""
    weight = next(module.parameters())
    if can_pack_linears(weight.device, weight.dtype):
        pack_linears(module)
    return module


def pick(logits: torch.Tensor, head: DraftHead, inputs: list[SpecInput]
         ) -> tuple[list[int], list[torch.Tensor | None]]:
    """[B, Vd] draft logits -> one token per row: argmax for greedy requests, else a draw
    from the request's tempered, filtered draft distribution (returned as q [V], full vocab)."""
    tokens = head.ids[logits.argmax(-1)].tolist()
    qs: list[torch.Tensor | None] = [None] * len(inputs)
    for i, inp in enumerate(inputs):
        if not inp.params.greedy:
            batch = SamplingBatch.from_params([inp.params], [inp.generator], logits.device)
            q = filtered_probs(head.full(logits[i:i + 1].float()), batch)[0]
            tokens[i] = int(torch.multinomial(q, 1, generator=inp.generator))
            qs[i] = q
    return tokens, qs


def chain_drafts(tokens: list[list[int]], qs: list[list], inputs: list[SpecInput]
                 ) -> list[Draft | None]:
    out = []
    for toks, q, inp in zip(tokens, qs, inputs):
        sampled = not inp.params.greedy
        out.append(Draft.chain(toks, torch.stack(q) if sampled else None) if toks else None)
    return out


class DraftModelProposer:
    """A small language model drafts a chain of k tokens, one batched step per token."""

    hidden_layers: tuple[int, ...] = ()
    catches_up = True             # it computes every token past its cache, whenever asked

    def __init__(self, lm, head: DraftHead, k: int, num_blocks: int, block_size: int) -> None:
        self.lm, self.head, self.k, self.max_nodes = lm, head, k, k
        self.cache = PagedDrafter(lm.cfg, num_blocks, block_size, lm.device, lm.dtype)
        self.fused = CpuForward(packed(lm))

    def _forward(self, ids, cache, positions):
        if self.fused.runs(cache):
            return self.fused(ids[0], positions, cache)[0][None]
        return self.lm.forward_layers(ids, cache, positions)[0]

    @torch.inference_mode()
    def propose(self, inputs: list[SpecInput], hidden: dict) -> list[Draft | None]:
        work, ids = [], []
        for inp in inputs:
            s = inp.seq
            first = min(self.cache.length(s.seq_id), inp.start)
            end = s.num_tokens if s.num_uncomputed == 1 else inp.start + len(inp.rows)
            work.append((s.seq_id, first))
            ids.append(torch.tensor(s.token_ids[first:end], device=self.lm.device))
        outs = self.cache.run(self._forward, work, ids)
        live = [i for i, inp in enumerate(inputs) if inp.max_depth]
        tokens = [[] for _ in inputs]
        qs = [[] for _ in inputs]
        last = torch.stack([outs[i][-1] for i in live]) if live else None
        for step in range(self.k):
            live = [i for i in live if len(tokens[i]) < min(self.k, inputs[i].max_depth)]
            if not live:
                break
            if step:
                pos = [inputs[i].seq.num_tokens + step - 1 for i in live]
                ids = [torch.tensor([tokens[i][-1]], device=self.lm.device) for i in live]
                last = torch.cat(self.cache.run(self._forward, [(inputs[i].seq.seq_id, p)
                                                                for i, p in zip(live, pos)], ids))
            new, q = pick(self.head(last), self.head, [inputs[i] for i in live])
            for i, t, qi in zip(live, new, q):
                tokens[i].append(t)
                qs[i].append(qi)
        return chain_drafts(tokens, qs, inputs)

    def fork(self, parent_id: int, child_id: int) -> None:
        self.cache.fork(parent_id, child_id)

    def release(self, seq_id: int) -> None:
        self.cache.release(seq_id)


class FeatureProposer:
    """EAGLE or MTP: the drafter reads the target's last hidden state h_t (EAGLE-3: its states
    after a low, a middle and a high layer, fused) and the next token x_{t+1} at each committed
    position t, then runs ahead on its own outputs. ``tree`` False
    drafts a chain of k; True grows EAGLE-2's dynamic tree k levels deep: each level expands
    the ``topk`` nodes of highest joint confidence into ``topk`` children each, and the
    ``budget`` best nodes of all are kept."""

    hidden_layers: tuple[int, ...] = (-1,)

    def __init__(self, drafter, head: DraftHead, embed, k: int, num_blocks: int,
                 block_size: int, tree: bool = False, topk: int = 4, budget: int = 16) -> None:
        self.drafter, self.head, self.embed = drafter, head, embed
        self.k, self.tree, self.topk, self.budget = k, tree, topk, budget
        self.hidden_layers = tuple(drafter.cfg.target_layers) or (-1,)
        self.max_nodes = budget if tree else k
        dev, dtype = embed.weight.device, embed.weight.dtype
        self.cache = PagedDrafter(drafter.block_cfg, num_blocks, block_size, dev, dtype)
        self.fused = CpuForward(packed(drafter), drafter.block_cfg)
        self.last_tree: dict[int, dict] = {}      # seq id -> the last tree grown (for plots)

    def _forward(self, x, cache, positions):
        """x [1, R, 2D] (token embeddings, features) -> [1, R, D]: the drafter's block, through
        the engine's CPU fast path where it runs (:class:`~minillm.engine.cpu_forward.CpuForward`:
        the same block's small ops fused, about half the time of the eager modules here; a
        tree level's or a chain step's shape recurs every round, so it is recorded once and
        replayed, :mod:`minillm.engine.cpu_replay`)."""
        d = x.shape[-1] // 2
        if self.fused.runs(cache):
            h = self.drafter.inputs(x[0, :, :d], x[0, :, d:])
            return self.fused.from_rows(h, positions, cache)[0][None]
        return self.drafter(x[..., :d], x[..., d:], positions, cache)

    def _rows(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """[n] next tokens and [n, D] features -> drafter input rows [n, 2D]."""
        ids = torch.tensor(tokens, device=features.device)
        return torch.cat([self.embed(ids), features.to(self.embed.weight.dtype)], -1)

    def features(self, hidden: dict) -> torch.Tensor:
        """The step's rows of what the drafter reads [N, D]: the last hidden state, or
        EAGLE-3's fused low, middle and high ones."""
        if self.hidden_layers == (-1,):
            return hidden[-1]
        states = torch.cat([hidden[i] for i in self.hidden_layers], -1)
        return self.drafter.fuse(states.to(self.embed.weight.dtype))

    @torch.inference_mode()
    def propose(self, inputs: list[SpecInput], hidden: dict) -> list[Draft | None]:
        h = self.features(hidden)
        work, rows = [], []
        for inp in inputs:
            s, n = inp.seq, len(inp.rows)
            work.append((s.seq_id, inp.start))
            rows.append(self._rows(s.token_ids[inp.start + 1:inp.start + n + 1],
                                   h[torch.tensor(inp.rows, device=h.device)]))
        outs = self.cache.run(self._forward, work, rows)
        live = [i for i, inp in enumerate(inputs) if inp.max_depth]
        drafts: list[Draft | None] = [None] * len(inputs)
        if not live:
            return drafts
        sub = [inputs[i] for i in live]
        feats = torch.stack([outs[i][-1] for i in live])
        made = self._tree(sub, feats) if self.tree else self._chain(sub, feats)
        for i, d in zip(live, made):
            drafts[i] = d
        return drafts

    def _chain(self, inputs: list[SpecInput], feats: torch.Tensor) -> list[Draft | None]:
        tokens, qs = [[] for _ in inputs], [[] for _ in inputs]
        live = list(range(len(inputs)))
        for step in range(self.k):
            live = [i for i in live if len(tokens[i]) < min(self.k, inputs[i].max_depth)]
            if not live:
                break
            if step:
                work = [(inputs[i].seq.seq_id, inputs[i].seq.num_tokens + step - 2)
                        for i in live]
                x = [self._rows([tokens[i][-1]], feats[i][None]) for i in live]
                out = self.cache.run(self._forward, work, x)
                for i, o in zip(live, out):
                    feats[i] = o[-1]
            new, q = pick(self.head(feats[live]), self.head, [inputs[i] for i in live])
            for i, t, qi in zip(live, new, q):
                tokens[i].append(t)
                qs[i].append(qi)
        return chain_drafts(tokens, qs, inputs)

    def _tree(self, inputs: list[SpecInput], feats: torch.Tensor) -> list[Draft | None]:
        """EAGLE-2's tree, one drafter pass per level over the new frontier nodes only: the
        nodes of earlier levels stay in the drafter's cache, and each new node sees its
        ancestors among them (a mask over the cached nodes too)."""
        trees = [_Tree() for _ in inputs]
        self._expand([(t, 0) for t in trees], feats)
        for level in range(1, self.k):
            grow = [i for i, inp in enumerate(inputs) if level < inp.max_depth]
            if not grow:
                break
            fronts = [trees[i].frontier(level, self.topk) for i in grow]
            work, x, masks, pos = [], [], [], []
            for i, front in zip(grow, fronts):
                inp, t = inputs[i], trees[i]
                root = inp.seq.num_tokens - 2        # drafter position t reads h_t, x_{t+1}
                work.append((inp.seq.seq_id, root + 1 + len(t.done)))
                x.append(self._rows([t.tokens[n - 1] for n in front],
                                    torch.stack([t.parent_feature(n, feats[i]) for n in front])))
                masks.append(t.ancestry(front))
                pos.append([root + t.depth[n - 1] for n in front])
            outs = self.cache.run(self._forward, work, x, masks, pos)
            for i, front, out in zip(grow, fronts, outs):
                trees[i].features.update(zip(front, out))
            self._expand([(trees[i], n) for i, front in zip(grow, fronts) for n in front],
                         torch.cat(outs))
        drafts = []
        for inp, t in zip(inputs, trees):
            d = t.draft(self.budget)
            self.last_tree[inp.seq.seq_id] = {"tokens": t.tokens, "parents": t.parents,
                                              "scores": t.scores, "kept": d[1]}
            drafts.append(d[0])
        return drafts

    def _expand(self, nodes: list[tuple[_Tree, int]], out: torch.Tensor) -> None:
        """Give each (tree, node) its ``topk`` children from the drafter's output rows
        ``out`` [len(nodes), D] (node 0: the root), all through the head at once."""
        top = self.head(out).float().log_softmax(-1).topk(self.topk)
        tokens = self.head.ids[top.indices].tolist()
        for (t, n), lps, toks in zip(nodes, top.values.tolist(), tokens):
            t.expand(n, lps, toks)

    def fork(self, parent_id: int, child_id: int) -> None:
        self.cache.fork(parent_id, child_id)

    def release(self, seq_id: int) -> None:
        self.cache.release(seq_id)
        self.last_tree.pop(seq_id, None)


class _Tree:
    """One sequence's EAGLE-2 tree while it grows: nodes 1.. with token, parent, depth, joint
    log-confidence; ``done``: the nodes computed in the drafter, in the order of its cache
    slots after the root; ``features[n]``: the drafter's output at node n."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depth: list[int] = []
        self.scores: list[float] = []
        self.done: list[int] = []
        self.features: dict[int, torch.Tensor] = {}

    def expand(self, node: int, logps: list[float], tokens: list[int]) -> None:
        """Add ``tokens`` as children of ``node`` (0: the root), of log-probabilities ``logps``."""
        base = self.scores[node - 1] if node else 0.0
        depth = self.depth[node - 1] + 1 if node else 1
        for lp, tok in zip(logps, tokens):
            self.tokens.append(tok)
            self.parents.append(node)
            self.depth.append(depth)
            self.scores.append(base + lp)

    def frontier(self, level: int, topk: int) -> list[int]:
        """The ``topk`` nodes of depth ``level`` with the highest joint confidence."""
        nodes = [n for n in range(1, len(self.tokens) + 1) if self.depth[n - 1] == level]
        return sorted(nodes, key=lambda n: -self.scores[n - 1])[:topk]

    def ancestry(self, front: list[int]) -> torch.Tensor:
        """The mask of the ``front`` nodes' pass [F, C + F] over the C nodes computed before
        (their cache slots) and themselves: a node sees its ancestors and itself. The front
        is computed from now on."""
        slot = {n: j for j, n in enumerate(self.done)}
        mask = torch.zeros(len(front), len(self.done) + len(front), dtype=torch.bool)
        for r, n in enumerate(front):
            mask[r, len(self.done) + r] = True
            p = self.parents[n - 1]
            while p:
                mask[r, slot[p]] = True
                p = self.parents[p - 1]
        self.done += front
        return mask

    def parent_feature(self, node: int, root_feature: torch.Tensor) -> torch.Tensor:
        p = self.parents[node - 1]
        return self.features[p] if p else root_feature

    def draft(self, budget: int) -> tuple[Draft, list[int]]:
        keep = top_nodes(self.scores, self.parents, budget)
        index = {n: j + 1 for j, n in enumerate(keep)}
        return Draft([self.tokens[n - 1] for n in keep],
                     [index.get(self.parents[n - 1], 0) for n in keep]), keep


class MedusaProposer:
    """Medusa: K heads on the target's last hidden state propose the next K tokens at once;
    their top-k candidates fill the static sparse tree (:func:`.trees.medusa_tree`)."""

    hidden_layers: tuple[int, ...] = (-1,)
    catches_up = True             # no state: it reads the last hidden state only

    def __init__(self, heads, head: DraftHead, accuracy: list[list[float]], k: int,
                 budget: int) -> None:
        self.heads, self.head = heads, head
        self.paths = medusa_tree(accuracy[:k], budget)
        self.parents = tree_parents(self.paths)
        self.max_nodes = len(self.paths)
        self.ranks = max(r for p in self.paths for r in p) + 1

    @torch.inference_mode()
    def propose(self, inputs: list[SpecInput], hidden: dict) -> list[Draft | None]:
        live = [i for i, inp in enumerate(inputs) if inp.max_depth]
        drafts: list[Draft | None] = [None] * len(inputs)
        if not live:
            return drafts
        h = hidden[-1][torch.tensor([inputs[i].rows[-1] for i in live], device=hidden[-1].device)]
        logits = self.head(self.heads(h))                        # [K, B, Vd]
        top = self.head.ids[logits.topk(self.ranks, dim=-1).indices].tolist()   # [K][B][r]
        for b, i in enumerate(live):
            tokens = [top[len(p) - 1][b][p[-1]] for p in self.paths]
            drafts[i] = Draft(tokens, list(self.parents))
        return drafts

    def fork(self, parent_id: int, child_id: int) -> None: ...

    def release(self, seq_id: int) -> None: ...
