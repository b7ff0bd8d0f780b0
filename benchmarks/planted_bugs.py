"""Plant one-line bugs in a copy of the repository, one at a time, and check that the tests named
for each bug fail on it.

    python benchmarks/planted_bugs.py              # every bug (about 4 minutes on 2 cores);
                                                   # writes results/planted_bugs.json
    python benchmarks/planted_bugs.py --list       # the bugs and the tests that must catch them
    python benchmarks/planted_bugs.py --bug NAME [--bug NAME]   # only these (JSON with --out)

Each run copies the repository's files (``git ls-files``: tracked files and untracked ones that
git does not ignore, as they are in the working tree) into a fresh temporary folder, replaces
one exact text there, a line or part of one (a few lines where a line alone is not unique; a
text not found exactly once stops the script), and runs the
bug's tests with ``python -m pytest -x -q -p no:cacheprovider`` inside the copy, with
``PYTHONPATH`` naming the copy. The package is installed editable from the original tree and
``minillm.kernels`` is mapped to ``kernels/`` by pyproject's package-dir, so the copy gets a
``minillm/kernels -> ../kernels`` link, and a subprocess with the same environment must import
both ``minillm`` and ``minillm.kernels`` from the copy before any test runs. The source tree
itself is never written.

A bug is CAUGHT when its tests fail (pytest exits 1, or 2 for an error while collecting) and
MISSED when they pass. First the union of all selected bugs' tests runs on an unchanged copy and
must pass: otherwise a failure would say nothing about the bug. The script exits 1 when a bug is
missed or the unchanged copy fails, 0 when every bug is caught.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "planted_bugs.json"
SPEC = "tests/spec_decode/test_spec_verify.py::"
PREFIX = "tests/cache/test_prefix_cache.py::"
STEPS = "tests/engine/test_step_policy.py::"
PAGED = "tests/attention/test_paged_attention_backend.py::"
CONNECTOR = "tests/engine/test_kv_connector.py::"
POLICY = "tests/engine/test_policy_seams.py::"
REPLAY = "tests/engine/test_cpu_replay.py::"
SHIFT = "(start > 0 and w.num_tokens > 1)"   # a later chunk's positions moved by one


@dataclass(frozen=True)
class Bug:
    """One planted bug, called ``name`` and described by ``what``: in ``file``, the text
    ``original`` (found exactly once) becomes ``replacement``; each of ``tests`` (pytest node
    ids) must pass without the bug, and at least one must fail with it."""

    name: str
    what: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]


BUGS = (
    Bug("spec-bonus-row", "the bonus token after a whole chain drawn from row k - 1",
        "minillm/spec_decode/verify.py",
        "    return k, _draw(p[k], generator)",
        "    return k, _draw(p[k - 1], generator)",
        (SPEC + "test_the_bonus_token_after_a_whole_chain_comes_from_the_last_row",
         SPEC + "test_the_bonus_token_follows_the_last_row_in_distribution")),
    Bug("spec-greedy-bonus-row", "greedy: the bonus token read from row k - 1",
        "minillm/spec_decode/verify.py",
        "    return a, int(target_argmax[a])",
        "    return a, int(target_argmax[min(a, len(draft) - 1)])",
        (SPEC + "test_greedy_keeps_the_agreeing_prefix",
         SPEC + "test_the_bonus_token_after_a_whole_chain_comes_from_the_last_row")),
    Bug("spec-tree-bonus-row", "tree: the bonus token drawn from the parent's row",
        "minillm/spec_decode/verify.py",
        "            return path, _draw(target, generator)",
        "            return path, _draw(p[path[-2]] if len(path) > 1 else target, generator)",
        (SPEC + "test_tree_rules_take_the_bonus_token_from_the_last_accepted_node",
         SPEC + "test_tree_bonus_token_follows_the_leafs_row_in_distribution")),
    Bug("spec-greedy-tree-bonus", "greedy tree: the bonus token read at the parent",
        "minillm/spec_decode/verify.py",
        "            return path, int(target_argmax[node])",
        "            return path, int(target_argmax[path[-2] if len(path) > 1 else node])",
        (SPEC + "test_tree_rules_take_the_bonus_token_from_the_last_accepted_node",)),
    Bug("sampler-top-k-largest", "top-k only: every row keeps the batch's largest k",
        "minillm/engine/sampler.py",
        "        kth = x.topk(batch.top_k_only, dim=-1).values.gather(1, (k - 1)[:, None])",
        "        kth = x.topk(batch.top_k_only, dim=-1).values[:, -1:]",
        ("tests/engine/test_sampler.py::test_top_k_rows_with_different_k_each_keep_their_own_top_k",)),
    Bug("scheduler-budget", "each admitted prompt gets the whole token budget",
        "minillm/engine/scheduler.py",
        "            budget -= used",
        "            pass",
        (STEPS + "test_an_engine_prefilling_several_long_prompts_keeps_its_budget",
         STEPS + "test_several_prompts_admitted_at_once_share_one_budget")),
    Bug("scheduler-stale-recompute", "a request preempted by recompute keeps num_computed",
        "minillm/engine/scheduler.py",
        "self.blocks.free(s.seq_id)\n            s.num_computed = 0",
        "self.blocks.free(s.seq_id)\n            pass",
        (STEPS + "test_preempted_requests_are_computed_again_from_their_first_token",)),
    Bug("runner-chunk-positions", "a later prompt chunk's positions shifted by one",
        "minillm/engine/runner.py",
        "range(start, start + w.num_tokens)",
        f"range(start + {SHIFT}, start + w.num_tokens + {SHIFT})",
        (STEPS + "test_an_engine_prefilling_several_long_prompts_keeps_its_budget",)),
    Bug("attention-output-zeroed", "paged attention (sdpa) returns zeros",
        "minillm/attention/paged.py",
        "    return out\n\n\ndef _gather",
        "    return torch.zeros_like(out)\n\n\ndef _gather",
        (PAGED + "test_sdpa_paged_attention_matches_dense_masked_attention",)),
    Bug("attention-first-key-dropped", "paged attention (sdpa) never sees a sequence's first key",
        "minillm/attention/paged.py",
        "seen[n:, 0] = True",
        "seen[:n, 0] = False; seen[n:, 0] = True",
        (PAGED + "test_sdpa_paged_attention_matches_dense_masked_attention",)),
    Bug("prefix-last-token", "a prefix match may cover the prompt's last token",
        "minillm/cache/block_manager.py",
        "        usable = (len(token_ids) - 1) // self.block_size * self.block_size",
        "        usable = len(token_ids) // self.block_size * self.block_size",
        (PREFIX + "test_a_block_aligned_prompt_sent_twice",)),
    Bug("prefix-hash-unchained", "hash keys not chained on the blocks before",
        "minillm/cache/prefix.py",
        "            key = hash((key, tuple(token_ids[i * bs:(i + 1) * bs])))",
        "            key = hash((i, tuple(token_ids[i * bs:(i + 1) * bs])))",
        (PREFIX + "test_equal_blocks_after_different_earlier_blocks_never_match[hash]",
         PREFIX + "test_matches_equal_a_dictionary_keyed_by_the_whole_prefix[hash]")),
    Bug("blocks-no-copy-on-write", "writes into shared blocks are not copied first",
        "minillm/cache/block_manager.py",
        "        return [i for i in range(first, min(last + 1, len(table))) "
        "if self.device.ref[table[i]] > 1]",
        "        return []",
        ("tests/cache/test_block_manager.py::"
         "test_truncating_a_fork_then_writing_leaves_the_parents_kv_alone",)),
    Bug("spec-rejected-kv-kept", "a verified draft's rejected tokens keep their KV slots",
        "minillm/engine/update.py",
        "        self.blocks.truncate(seq.seq_id, root + 1 + len(path))",
        "        pass",
        ("tests/engine/test_engine_update.py::"
         "test_a_verified_chain_keeps_its_accepted_prefix_and_rolls_back_the_rest",
         "tests/engine/test_runner_on_model.py::test_rollback_and_compaction_keep_the_accepted_tokens")),
    Bug("spec-tree-not-compacted", "a tree's accepted nodes' KV is not moved after the root",
        "minillm/engine/runner.py",
        "            self.pool.copy_slots(src, dst)",
        "            pass",
        ("tests/engine/test_runner_on_model.py::test_rollback_and_compaction_keep_the_accepted_tokens",)),
    Bug("store-load-skips-a-layer", "a layer-by-layer load of stored KV skips layer 1",
        "minillm/cache/offload.py",
        "        for blocks, load in self.loads:\n            self.pool.write_layer(",
        "        for blocks, load in self.loads if layer != 1 else ():\n"
        "            self.pool.write_layer(",
        ("tests/cache/test_offload.py::test_served_from_the_store_after_device_eviction",)),
    Bug("connector-short-load-runs", "a sequence whose connector load came short runs anyway",
        "minillm/engine/runner.py",
        "        run = plan.without(short) if short else plan",
        "        run = plan",
        (CONNECTOR + "test_a_short_load_sits_the_step_out_and_is_recomputed",)),
    Bug("connector-fast-path-no-wait", "the CPU fast path never calls the connector's "
        "wait_for_layer",
        "minillm/engine/cpu_forward.py",
        "            if before_layer is not None:\n                before_layer(i)",
        "            pass",
        (CONNECTOR + "test_the_runner_calls_the_connector_around_every_layer",)),
    Bug("plan-unchecked", "the engine runs a step policy's plan without checking it",
        "minillm/engine/engine.py",
        "            check_plan(plan, self.config,",
        "            (lambda *args: None)(plan, self.config,",
        (POLICY + "test_a_plan_breaking_a_rule_fails_its_requests_alone",)),
    Bug("allocator-unchecked", "the pool takes whatever block the allocator hands out",
        "minillm/cache/block_pool.py",
        "        if rule is not None:\n            raise AllocatorError(",
        "        if False:\n            raise AllocatorError(",
        (POLICY + "test_an_allocator_handing_out_a_used_block_fails_that_request_alone",)),
    Bug("sampler-unchecked", "the runner appends whatever token the sampler returns",
        "minillm/engine/step_sampler.py",
        "        bad = sampler_violations(drawn, len(rows), logits.shape[-1])",
        "        bad = {}",
        (POLICY + "test_a_sampler_drawing_outside_the_vocabulary_fails_that_request_alone",)),
    Bug("drafts-unchecked", "the engine attaches drafts with tokens outside the vocabulary",
        "minillm/engine/speculation.py",
        "        bad = [t for t in draft.tokens if not (isinstance(t, int) and 0 <= t < "
        "vocab_size)]",
        "        bad = []",
        ("tests/engine/test_engine_update.py::"
         "test_a_drafter_breaking_its_contract_fails_its_request_alone",)),
    Bug("graph-padding-in-block-0", "a padded decode step's padding rows write into block 0",
        "minillm/engine/graphs.py",
        "        meta = build_metadata(tables + [[self.scratch_block]] * pad,",
        "        meta = build_metadata(tables + [[0]] * pad,",
        ("tests/engine/test_graphs.py::test_padding_rows_write_only_the_scratch_block",)),
    Bug("server-prompt-tokens-per-choice", "usage.prompt_tokens counts the prompt once per "
        "choice when n > 1",
        "minillm/serve/responses.py",
        "        prompt = sum(len(o.prompt_token_ids) for o in self.latest.values())",
        "        prompt = sum(len(o.prompt_token_ids) * len(o.outputs) "
        "for o in self.latest.values())",
        ("tests/serve/test_serve.py::test_n_samples_and_seeds",)),
    Bug("server-no-abort-on-disconnect", "a client that leaves a stream does not abort its "
        "engine request",
        "minillm/serve/loop.py",
        "        if not job.finished:\n            self._commands.put((\"abort\", job))",
        "        if False:\n            self._commands.put((\"abort\", job))",
        ("tests/serve/test_serve.py::test_client_disconnect_mid_stream_frees_its_blocks",)),
    Bug("replay-stale-rope", "a replayed decode step keeps the recorded step's RoPE positions",
        "minillm/engine/cpu_replay.py",
        "            rope(positions, b, x.dtype)\n",
        "",
        (REPLAY + "test_replayed_steps_equal_the_eager_fast_path_exactly",)),
    Bug("replay-stale-block-tables", "a replayed decode step reads the recorded step's block "
        "tables (a sequence that moves into a new block attends to the wrong one)",
        "minillm/engine/cpu_replay.py",
        'block_tables=b.put("block_tables", meta.block_tables, self.max_blocks)',
        'block_tables=b.tensors["block_tables"] if self.calls else '
        'b.put("block_tables", meta.block_tables, self.max_blocks)',
        (REPLAY + "test_replayed_steps_equal_the_eager_fast_path_exactly",)),
    Bug("int4-high-nibble-offset", "the int4 kernel meets each high nibble with the wrong four "
        "activation bytes (the AVX2 path, which every x86 machine here builds)",
        "kernels/cpu_quant_matmul.cpp",
        "dot = madd(dot, hi[u], _mm256_set1_epi32(word(a + 16 + 4 * u)));",
        "dot = madd(dot, hi[u], _mm256_set1_epi32(word(a + 4 + 4 * u)));",
        ("tests/kernel_tests/test_cpu_quant_matmul.py::"
         "test_kernel_equals_float64_on_the_quantized_input",)),
    Bug("attention-pair-past-the-end", "the bfloat16 attention pairs a block's last odd key with "
        "the slot after it (weight zero, but zero times a NaN there is NaN)",
        "kernels/cpu_paged_attention.cpp",
        "const __m512i b = o + 1 < n ? _mm512_loadu_si512(vb + (o + 1) * row + i)",
        "const __m512i b = o + 1 < 2 * n ? _mm512_loadu_si512(vb + (o + 1) * row + i)",
        ("tests/kernel_tests/test_cpu_paged_attention.py::"
         "test_slots_past_a_sequence_are_never_read",)),
)


@dataclass
class Outcome:
    """What one pytest run in a copy gave: ``status`` is PASSED, CAUGHT, MISSED, TIMEOUT or
    ERROR (pytest could not run the tests: exit 3 to 5); ``failed`` the failing node ids."""

    name: str
    file: str | None
    tests: list[str]
    status: str
    caught: bool
    seconds: float
    failed: list[str]
    returncode: int | None


# ---- the copy ---------------------------------------------------------------------------------
def repository_files(root: Path) -> list[str]:
    """Paths (relative to ``root``) of tracked files and of untracked files git does not
    ignore, that exist in the working tree now."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, check=True).stdout
    names = sorted({name for name in out.decode().split("\0") if name})
    return [name for name in names if (root / name).is_file()]


def make_copy(root: Path, dest: Path) -> None:
    """Copy the repository's files into ``dest`` and link ``minillm/kernels`` to the copy's
    ``kernels/`` (pyproject maps the subpackage there), so that the copy imports whole."""
    for name in repository_files(root):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    link = dest / "minillm" / "kernels"
    if not link.exists():
        link.symlink_to(Path("..") / "kernels", target_is_directory=True)


def plant(copy: Path, bug: Bug) -> None:
    """Replace ``bug.original`` by ``bug.replacement`` in the copy; the original text must occur
    exactly once (else ValueError, naming the bug and the count)."""
    path = copy / bug.file
    text = path.read_text()
    count = text.count(bug.original)
    if count != 1:
        raise ValueError(f"bug {bug.name!r}: the original text occurs {count} times in "
                         f"{bug.file} (must be once): {bug.original!r}")
    path.write_text(text.replace(bug.original, bug.replacement))


def uncommitted(root: Path) -> list[str]:
    """``git status --porcelain`` lines: what the copies hold beyond the commit."""
    out = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                         text=True, check=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def copy_env(copy: Path) -> dict[str, str]:
    """The environment of a run in ``copy``: PYTHONPATH names only the copy."""
    return {**os.environ, "PYTHONPATH": str(copy)}


def check_imports_from(copy: Path) -> None:
    """Raise RuntimeError unless a Python started like the test runs imports ``minillm`` and
    ``minillm.kernels`` from files inside ``copy``."""
    code = "import minillm, minillm.kernels; print(minillm.__file__); " \
           "print(minillm.kernels.__file__)"
    run = subprocess.run([sys.executable, "-c", code], cwd=copy, env=copy_env(copy),
                         capture_output=True, text=True, timeout=300)
    files = run.stdout.split()
    inside = len(files) == 2 and all(Path(f).resolve().is_relative_to(copy.resolve())
                                     for f in files)
    if run.returncode != 0 or not inside:
        raise RuntimeError(f"the copy at {copy} does not import its own package: "
                           f"{run.stdout.strip()!r} {run.stderr.strip()[-500:]!r}")


# ---- one run ----------------------------------------------------------------------------------
def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[int | None, list[str], str]:
    """(pytest's exit code or None on timeout, the failed node ids, the output's tail) of the
    tests run inside ``copy``."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        run = subprocess.run(cmd, cwd=copy, env=copy_env(copy), capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, [], ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", run.stdout, flags=re.MULTILINE)
    return run.returncode, failed, (run.stdout + run.stderr)[-2000:]


def run_one(root: Path, bug: Bug | None, tests: list[str], timeout: float,
            verbose: bool) -> Outcome:
    """Copy the repository, plant ``bug`` (None: nothing), run ``tests`` there."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        copy = Path(tmp)
        make_copy(root, copy)
        if bug is not None:
            plant(copy, bug)
        check_imports_from(copy)
        code, failed, tail = run_tests(copy, tests, timeout)
    if code is None:
        status = "TIMEOUT"
    elif code == 0:
        status = "PASSED" if bug is None else "MISSED"
    elif code in (1, 2):
        status = "FAILED" if bug is None else "CAUGHT"
    else:
        status = "ERROR"
    if verbose or status in ("ERROR", "FAILED", "TIMEOUT"):
        print(tail)
    return Outcome(bug.name if bug else "(no bug)", bug.file if bug else None, list(tests),
                   status, status == "CAUGHT", round(time.perf_counter() - start, 1), failed,
                   code)


# ---- the table --------------------------------------------------------------------------------
def select(names: list[str] | None) -> list[Bug]:
    """The bugs named (all when ``names`` is None); an unknown name stops the script."""
    if not names:
        return list(BUGS)
    known = {bug.name: bug for bug in BUGS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown bug {unknown}; the bugs are: {sorted(known)}")
    return [known[n] for n in names]


def print_list(bugs: list[Bug]) -> None:
    for bug in bugs:
        print(f"{bug.name}: {bug.what}\n    {bug.file}: {bug.original.strip()!r}\n"
              f"    -> {bug.replacement.strip()!r}")
        for test in bug.tests:
            print(f"    {test}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the bugs and their tests")
    ap.add_argument("--bug", action="append", metavar="NAME", help="run only this bug "
                    "(repeatable; the names are those --list prints)")
    ap.add_argument("--out", type=Path, default=None, help=f"JSON report (default {OUT} when "
                    "every bug runs; none otherwise)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest's output tail")
    args = ap.parse_args()
    bugs = select(args.bug)
    if args.list:
        print_list(bugs)
        return 0
    import torch

    from minillm.bench.common import format_table, write_json
    from minillm.runinfo import machine_info

    every_test = list(dict.fromkeys(t for bug in bugs for t in bug.tests))
    baseline = run_one(ROOT, None, every_test, args.timeout, args.verbose)
    print(f"no bug: {baseline.status} ({baseline.seconds:.0f} s, {len(every_test)} tests)",
          flush=True)
    outcomes = [baseline]
    for bug in bugs:
        outcome = run_one(ROOT, bug, list(bug.tests), args.timeout, args.verbose)
        print(f"{bug.name}: {outcome.status} ({outcome.seconds:.0f} s)", flush=True)
        outcomes.append(outcome)
    print(format_table([("bug", "<28"), ("result", "<8"), ("s", ">6.1f"), ("failed", "<")],
                       [(o.name, o.status, o.seconds, " ".join(f.split("::")[-1] for f in
                                                                o.failed))
                        for o in outcomes]))
    ok = baseline.status == "PASSED" and all(o.caught for o in outcomes[1:])
    out = args.out or (OUT if not args.bug else None)
    if out is not None:
        report = {"benchmark": "planted_bugs",
                  "method": "each bug planted alone in a fresh copy of the working tree's files "
                            "(git ls-files, tracked and untracked-not-ignored); its tests run "
                            "there with pytest -x; caught = the tests failed. The same tests "
                            "pass on an unchanged copy (baseline).",
                  "all_caught": ok, "uncommitted": uncommitted(ROOT),
                  "baseline": asdict(baseline),
                  "bugs": [{**asdict(o), "what": b.what, "original": b.original,
                            "replacement": b.replacement}
                           for o, b in zip(outcomes[1:], bugs)],
                  **machine_info(torch.device("cpu"), torch.get_num_threads())}
        print("wrote", write_json(report, out))
    if baseline.status != "PASSED":
        print("the tests fail without any bug: the table says nothing until they pass")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
