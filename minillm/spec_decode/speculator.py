"""The speculator the engine calls: a proposer (which drafter) plus the verification rules,
with counters of what was proposed and accepted at each draft position.

``build_speculator(speculative_config, engine)`` is what
``minillm.LLM(..., speculative_config={...})`` uses.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from ..config import SamplingParams
from ..engine.engine import LLMEngine
from ..engine.plan import RunnerOutput, SchedulerOutput, StepUpdate
from ..engine.sampler import SamplingBatch, filtered_probs
from ..engine.sequence import Draft, Sequence
from .autotune import CALIBRATION_PROMPTS, Calibration, calibrate
from .blocks import BlockProposer
from .config import BLOCK_METHODS, MAX_TOKENS, MODEL_FREE, SpeculativeConfig
from .inputs import spec_inputs
from .prompts import training_prompts
from .proposers import DraftModelProposer, FeatureProposer, MedusaProposer, NgramProposer
from .suffix import SuffixProposer
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
    log: list[tuple[list[int], list[int]]] | None = None   # per round, when a list: the
    #                                  draft's node depths in its order, the accepted path's nodes

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
        self.max_draft_tokens = proposer.max_nodes
        self.stats = SpecStats()
        self.calibration: Calibration | None = None   # set when k was "auto"
        self.drafting = True                           # False: propose nothing (plain decoding)
        self._depth_for: dict[int, int] = {}           # batch -> calibration.k_for_batch
        self._stale: set[int] = set()                  # sequences whose drafter state was
        #                                                dropped while drafting was off

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose states the proposer reads; none while it does not draft
        (the runner then keeps its fast path: a step that returns hidden states leaves the
        fused CPU forward and the CUDA graphs)."""
        return self.proposer.hidden_layers if self.drafting else ()

    def propose(self, plan: SchedulerOutput, out: RunnerOutput, done: StepUpdate
                ) -> dict[int, Draft]:
        """The next drafts after a step's update, by sequence id. New parallel samples first
        share their parent's drafter state (``proposer.fork``)."""
        for child, parent in done.forked.items():
            self.proposer.fork(parent, child)
            if parent in self._stale:
                self._stale.add(child)
        inputs = spec_inputs(plan, out, done, self.max_seq_len) if self.drafting else []
        if inputs and self.calibration is not None:
            inputs = self._under_load(inputs)
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
        if self.stats.log is not None:
            self.stats.log.append((draft.depths()[1:], list(path)))
        observe = getattr(self.proposer, "observe", None)
        if observe is not None:
            observe(seq.seq_id, len(path))
        self.stats.verify_seconds += time.perf_counter() - start
        return path, nxt

    def _under_load(self, inputs: list) -> list:
        """Only as deep as pays for this many sequences (``calibration.k_for_batch``); where
        nothing does, the drafter does no work at all this step, and a drafter that cannot
        catch up on the tokens it did not see (``catches_up`` False: it reads the target's
        hidden states of each step) drops those sequences for good."""
        batch = len(inputs)                  # the sequences the next step computes
        if batch not in self._depth_for:
            self._depth_for[batch] = self.calibration.k_for_batch(batch)
        depth = self._depth_for[batch]
        if depth == 0:
            if not getattr(self.proposer, "catches_up", False):
                for inp in inputs:
                    if inp.seq.seq_id not in self._stale:
                        self._stale.add(inp.seq.seq_id)
                        self.proposer.release(inp.seq.seq_id)
            return []
        inputs = [inp for inp in inputs if inp.seq.seq_id not in self._stale]
        for inp in inputs:
            inp.max_depth = min(inp.max_depth, depth)
        return inputs

    def release(self, seq_id: int) -> None:
        self._stale.discard(seq_id)
        self.proposer.release(seq_id)


def build_speculator(options: dict | SpeculativeConfig, engine: LLMEngine,
                     drafter=None, calibration_prompts: list[list[int]] | None = None
                     ) -> DraftAndVerify:
    """The speculator for ``options`` (a speculative_config dict) on ``engine``'s model; a
    drafter with a cache gets room to follow every sequence the engine can hold. ``drafter``:
    (module, head, manifest) to use instead of the packaged weights (tests).
    num_speculative_tokens="auto" first measures the method on ``engine`` (which must have no
    requests) with ``calibration_prompts`` (token ids; default: a few training prompts in the
    engine tokenizer's chat template) and keeps the k of the best predicted speedup, or turns
    drafting off when no k pays; the measurement is the speculator's ``calibration``."""
    cfg = SpeculativeConfig.from_dict(options)
    if cfg.num_speculative_tokens == "auto":
        return auto_speculator(cfg, engine, drafter, calibration_prompts)
    k, model = cfg.num_speculative_tokens, engine.model
    window = model.cfg.max_seq_len
    num_blocks = engine.drafter_blocks(cfg.max_draft_tokens)
    block_size = engine.blocks.block_size
    if cfg.method == "ngram":
        return DraftAndVerify(cfg, window,
                              NgramProposer(k, cfg.prompt_lookup_max, cfg.prompt_lookup_min))
    if cfg.method == "suffix":
        return DraftAndVerify(cfg, window, suffix_proposer(cfg, window))
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
        module, head, model.embed, k, num_blocks, block_size,
        tree=cfg.method in ("eagle", "eagle3"), topk=cfg.tree_topk, budget=cfg.tree_nodes))


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


def suffix_proposer(cfg: SpeculativeConfig, max_seq_len: int) -> SuffixProposer:
    """Suffix decoding; its global trie must hold at least one whole request (or be off)."""
    cap = cfg.suffix_decoding_max_cached_tokens
    if 0 < cap < max_seq_len:
        raise ValueError(f"speculative_config suffix_decoding_max_cached_tokens ({cap}) must "
                         f"hold at least one request, the model's context of {max_seq_len} "
                         f"tokens (or be 0 to keep no outputs)")
    return SuffixProposer(cfg.num_speculative_tokens, cfg.suffix_decoding_max_tree_depth,
                          cfg.suffix_decoding_max_spec_factor,
                          cfg.suffix_decoding_min_token_prob, cap)


def auto_speculator(cfg: SpeculativeConfig, engine: LLMEngine, drafter=None,
                    prompts: list[list[int]] | None = None) -> DraftAndVerify:
    """The speculator at the k that :func:`.autotune.calibrate` measures best on ``engine``."""
    drafter = drafter if drafter is not None or cfg.method in MODEL_FREE else \
        load_drafter("dflash" if cfg.method in BLOCK_METHODS else cfg.method, engine.model,
                     cfg.drafter)
    top = MAX_TOKENS[cfg.method]
    if cfg.method == "medusa":
        top = min(top, len(drafter[0].heads))
    if prompts is None:
        prompts = calibration_prompts(engine)

    def build(k: int, nodes: int | None = None) -> DraftAndVerify:
        return build_speculator(replace(cfg, num_speculative_tokens=k,
                                        tree_nodes=nodes or cfg.tree_nodes), engine, drafter)

    calibration = calibrate(engine, cfg.method, top, build, prompts)
    spec = build(*calibration.best())
    spec.calibration, spec.drafting = calibration, calibration.pays
    return spec


def calibration_prompts(engine: LLMEngine) -> list[list[int]]:
    """A few training prompts (all kinds) in the engine tokenizer's chat template."""
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("speculative_config num_speculative_tokens='auto' measures on chat "
                         "prompts: the engine needs a tokenizer (or pass calibration_prompts)")
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": m}],
                                               add_generation_prompt=True))
            for _, m in training_prompts(CALIBRATION_PROMPTS, seed=1)]
