"""The speculator the engine calls: a proposer (which drafter) plus the verification rules,
with counters of what was proposed and accepted at each draft position.

``build_speculator(speculative_config, engine)`` is what
``minillm.LLM(..., speculative_config={...})`` uses.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import SamplingParams
from ..engine.engine import LLMEngine
from ..engine.plan import RunnerOutput, SchedulerOutput, StepUpdate
from ..engine.sampler import SamplingBatch, filtered_probs
from ..engine.sequence import Draft, Sequence
from .blocks import BlockProposer
from .config import BLOCK_METHODS, SpeculativeConfig
from .inputs import spec_inputs
from .proposers import DraftModelProposer, FeatureProposer, MedusaProposer, NgramProposer
from .verify import greedy_tree_accept, rejection_accept, tree_accept
from .weights import load_drafter


@dataclass
class SpecStats:
    """proposed[i] / accepted[i]: drafts that reached depth i + 1 / whose accepted path did.
    rounds: verifications; emitted: tokens they produced (accepted + the target's own)."""

    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    rounds: int = 0
    emitted: int = 0
    nodes: int = 0                   # draft tokens verified, over all rounds
    propose_seconds: float = 0.0     # wall time in the drafter (all of its work)
    verify_seconds: float = 0.0      # wall time in the verification rules

    def add(self, depth: int, kept: int, nodes: int = 0) -> None:
        grow = max(depth, kept) - len(self.proposed)
        self.proposed += [0] * grow
        self.accepted += [0] * grow
        for i in range(depth):
            self.proposed[i] += 1
        for i in range(kept):
            self.accepted[i] += 1
        self.rounds += 1
        self.emitted += kept + 1
        self.nodes += nodes or depth

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def mean_accepted(self) -> float:
        """Tokens per verification round (accepted drafts + 1)."""
        return self.emitted / self.rounds if self.rounds else 0.0


class DraftAndVerify:
    """A proposer (which drafter) plus the verification rules, as the engine's
    :class:`~minillm.engine.speculation.Speculator` protocol asks; ``max_seq_len``: the
    target's context window (drafts stop short of it)."""

    def __init__(self, config: SpeculativeConfig, max_seq_len: int, proposer) -> None:
        self.config, self.max_seq_len, self.proposer = config, max_seq_len, proposer
        self.hidden_layers = proposer.hidden_layers
        self.max_draft_tokens = proposer.max_nodes
        self.stats = SpecStats()

    def propose(self, plan: SchedulerOutput, out: RunnerOutput, done: StepUpdate
                ) -> dict[int, Draft]:
        """The next drafts after a step's update, by sequence id. New parallel samples first
        share their parent's drafter state (``proposer.fork``)."""
        for child, parent in done.forked.items():
            self.proposer.fork(parent, child)
        inputs = spec_inputs(plan, out, done, self.max_seq_len)
        if not inputs:
            return {}
        start = time.perf_counter()
        drafts = self.proposer.propose(inputs, out.hidden)
        self.stats.propose_seconds += time.perf_counter() - start
        return {inp.seq.seq_id: d for inp, d in zip(inputs, drafts)
                if d is not None and inp.max_depth > 0}

    def verify(self, seq: Sequence, draft: Draft, logits: torch.Tensor,
               params: SamplingParams, generator: torch.Generator | None
               ) -> tuple[list[int], int]:
        """Greedy match at temperature 0; otherwise lossless rejection sampling (a sampled
        chain with its q) or the tree rule with deterministic candidates."""
        start = time.perf_counter()
        tokens = [seq.token_ids[seq.num_tokens - seq.num_draft - 1]] + draft.tokens
        children = draft.children()
        if params.greedy:
            path, nxt = greedy_tree_accept(children, tokens, logits.argmax(-1).tolist())
        else:
            rows = len(tokens)
            batch = SamplingBatch.from_params([params] * rows, [generator] * rows,
                                              logits.device)
            p = filtered_probs(logits, batch)
            if draft.q is not None:
                a, nxt = rejection_accept(draft.tokens, draft.q, p, generator)
                path = list(range(1, a + 1))
            else:
                path, nxt = tree_accept(children, tokens, None, p, generator)
        self.stats.add(max(draft.depths()), len(path), len(draft.tokens))
        observe = getattr(self.proposer, "observe", None)
        if observe is not None:
            observe(seq.seq_id, len(path))
        self.stats.verify_seconds += time.perf_counter() - start
        return path, nxt

    def release(self, seq_id: int) -> None:
        self.proposer.release(seq_id)


def build_speculator(options: dict | SpeculativeConfig, engine: LLMEngine,
                     drafter=None) -> DraftAndVerify:
    """The speculator for ``options`` (a speculative_config dict) on ``engine``'s model; a
    drafter with a cache gets room to follow every sequence the engine can hold. ``drafter``:
    (module, head, manifest) to use instead of the packaged weights (tests)."""
    cfg = SpeculativeConfig.from_dict(options)
    k, model = cfg.num_speculative_tokens, engine.model
    window = model.cfg.max_seq_len
    num_blocks = engine.drafter_blocks(cfg.max_draft_tokens)
    block_size = engine.blocks.block_size
    if cfg.method == "ngram":
        return DraftAndVerify(cfg, window,
                              NgramProposer(k, cfg.prompt_lookup_max, cfg.prompt_lookup_min))
    if cfg.method in BLOCK_METHODS:
        return DraftAndVerify(cfg, window, block_proposer(cfg, engine, drafter))
    module, head, manifest = drafter or load_drafter(cfg.method, model, cfg.drafter)
    if cfg.method == "medusa":
        heads = len(module.heads)
        if k > heads:
            raise ValueError(f"speculative_config num_speculative_tokens must be in [1, {heads}] "
                             f"for medusa (its heads), got {k}")
        return DraftAndVerify(cfg, window, MedusaProposer(
            module, head, manifest["head_accuracy"], k, cfg.tree_nodes))
    if cfg.method == "draft_model":
        return DraftAndVerify(cfg, window,
                              DraftModelProposer(module, head, k, num_blocks, block_size))
    return DraftAndVerify(cfg, window, FeatureProposer(
        module, head, model.embed, k, num_blocks, block_size, tree=cfg.method == "eagle",
        topk=cfg.tree_topk, budget=cfg.tree_nodes))


def block_proposer(cfg: SpeculativeConfig, engine: LLMEngine, drafter=None) -> BlockProposer:
    """DFlash / DDTree / DSpark on the packaged block drafter; DSpark's budget is checked
    against the engine's batch size (a budget below it could leave a sequence without a
    draft every step)."""
    seqs = engine.config.max_num_seqs
    budget = cfg.verify_budget if cfg.verify_budget is not None else max(32, seqs)
    if cfg.method == "dspark" and budget < seqs:
        raise ValueError(f"speculative_config verify_budget ({budget}) must be at least the "
                         f"engine's max_num_seqs ({seqs})")
    module, head, _ = drafter or load_drafter("dflash", engine.model, cfg.drafter)
    if cfg.method == "dspark" and not module.cfg.markov_rank:
        raise ValueError("speculative_config method dspark needs a drafter with DSpark's heads "
                         "(markov_rank > 0)")
    blocks = engine.drafter_blocks(max(cfg.max_draft_tokens, module.cfg.block_size))
    return BlockProposer(module, head, engine.model.embed, cfg.method,
                         cfg.num_speculative_tokens, blocks, engine.blocks.block_size,
                         cfg.tree_nodes, cfg.tree_topk, budget, cfg.threshold)
