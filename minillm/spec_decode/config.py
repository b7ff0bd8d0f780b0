"""``speculative_config``: which drafter, how far ahead, and its knobs (vLLM's names).

    minillm.LLM("smollm2-135m", speculative_config={"method": "eagle",
                                                    "num_speculative_tokens": 4})
"""
from __future__ import annotations

from dataclasses import dataclass, fields

METHODS = ("draft_model", "ngram", "suffix", "medusa", "eagle", "eagle3", "mtp", "dflash",
           "ddtree", "dspark")
MODEL_FREE = ("ngram", "suffix")                      # no weights, no training
BLOCK_METHODS = ("dflash", "ddtree", "dspark")       # one block drafter serves all three
MAX_TOKENS = {"draft_model": 12, "ngram": 12, "suffix": 16, "medusa": 8, "eagle": 8,
              "eagle3": 8, "mtp": 8, "dflash": 7, "ddtree": 7,
              "dspark": 7}                         # the block drafter's block is 8
TREE_METHODS = ("medusa", "eagle", "eagle3", "ddtree")
DEFAULT_THRESHOLD = 0.1
SUFFIX_OPTIONS = {     # name: (valid?, what it must be)
    "suffix_decoding_max_tree_depth": (lambda v: isinstance(v, int) and v >= 2, "an int >= 2"),
    "suffix_decoding_max_spec_factor": (lambda v: v > 0, "> 0"),
    "suffix_decoding_min_token_prob": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "suffix_decoding_max_cached_tokens": (lambda v: isinstance(v, int) and v >= 0,
                                          "an int >= 0"),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: one of METHODS. num_speculative_tokens: the lookahead k, how many tokens a chain
    drafts per step, or a tree's depth (at most MAX_TOKENS[method]; Medusa: at most its heads;
    suffix: the most nodes of its tree); "auto": chosen by measuring this machine when the
    engine is built (:mod:`.autotune`).
    prompt_lookup_max / prompt_lookup_min: the n-gram sizes ``ngram`` tries (longest first).
    tree_nodes: the node budget of a tree (medusa, eagle, ddtree); tree_topk: children per
    expanded node (eagle), candidates per depth (ddtree). verify_budget (dspark): draft tokens
    verified per step across the whole batch (None: max(32, max_num_seqs)); at least the
    engine's max_num_seqs. confidence_threshold (dspark): a draft stops at the first token
    whose confidence is below it, in (0, 1) (None: DEFAULT_THRESHOLD). drafter: a weights
    file to use instead of the packaged one. suffix_decoding_* (suffix): the tries' longest
    substring (max_tree_depth), the draft's size at most max_spec_factor times the matched
    length, its nodes' least score (min_token_prob, in (0, 1]), and the global trie's memory
    in tokens of recent outputs (max_cached_tokens; 0 turns it off, else at least one request:
    the model's context)."""

    method: str
    num_speculative_tokens: int | str = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    tree_nodes: int = 16
    tree_topk: int = 4
    verify_budget: int | None = None
    confidence_threshold: float | None = None
    drafter: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_tokens: int = 1 << 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got "
                             f"{self.method!r}")
        k, top = self.num_speculative_tokens, MAX_TOKENS[self.method]
        if k != "auto" and (not isinstance(k, int) or not 1 <= k <= top):
            raise ValueError(f"speculative_config num_speculative_tokens must be in [1, {top}] "
                             f"for {self.method}, or 'auto', got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")
        if self.tree_nodes < 1 or self.tree_topk < 1:
            raise ValueError(f"speculative_config tree_nodes and tree_topk must be >= 1, got "
                             f"{self.tree_nodes}, {self.tree_topk}")
        if self.verify_budget is not None and (not isinstance(self.verify_budget, int)
                                               or self.verify_budget < 1):
            raise ValueError(f"speculative_config verify_budget must be an int >= 1 (draft "
                             f"tokens per step), got {self.verify_budget!r}")
        if self.confidence_threshold is not None and not 0 < self.confidence_threshold < 1:
            raise ValueError(f"speculative_config confidence_threshold must be in (0, 1), got "
                             f"{self.confidence_threshold!r}")
        for name in ("verify_budget", "confidence_threshold"):
            if getattr(self, name) is not None and self.method != "dspark":
                raise ValueError(f"speculative_config {name} is an option of dspark, not of "
                                 f"{self.method}")
        if self.method in MODEL_FREE and self.drafter is not None:
            raise ValueError(f"speculative_config drafter: {self.method} has no weights")
        self._check_suffix()

    def _check_suffix(self) -> None:
        for name, (valid, must) in SUFFIX_OPTIONS.items():
            value = getattr(self, name)
            if value != SpeculativeConfig.__dataclass_fields__[name].default \
                    and self.method != "suffix":
                raise ValueError(f"speculative_config {name} is an option of suffix, not of "
                                 f"{self.method}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
                raise ValueError(f"speculative_config {name} must be {must}, got {value!r}")

    @classmethod
    def from_dict(cls, options: dict | SpeculativeConfig) -> SpeculativeConfig:
        """From vLLM-style keys; unknown keys are an error naming them."""
        if isinstance(options, SpeculativeConfig):
            return options
        if not isinstance(options, dict) or "method" not in options:
            raise ValueError(f"speculative_config must be a dict with a 'method' (one of "
                             f"{METHODS}), got {options!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        return cls(**options)

    @property
    def threshold(self) -> float:
        """DSpark's early-exit threshold (the default when not given)."""
        return DEFAULT_THRESHOLD if self.confidence_threshold is None else \
            self.confidence_threshold

    @property
    def max_draft_tokens(self) -> int:
        """Most nodes one draft may have."""
        if self.method in TREE_METHODS:
            return self.tree_nodes
        return self.num_speculative_tokens
