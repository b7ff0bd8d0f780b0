"""Bad speculative configurations fail at construction with the option named; drafter weight
files are checked (missing, changed, for another model)."""
from __future__ import annotations

import json

import pytest
import torch
from engine_checks import sharp_model
from test_spec_engine import random_drafter

from minillm import SamplingParams
from minillm.engine import EngineConfig, LLMEngine
from minillm.spec_decode import SpeculativeConfig, build_speculator
from minillm.spec_decode.weights import (
    BUDGET_BYTES,
    GROUP,
    STORAGE,
    WEIGHTS_DIR,
    dequantize,
    load_drafter,
    quantize,
    save_drafter,
)


@pytest.mark.parametrize("options, match", [
    ({"method": "lookahead"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"tokens must be in \[1, 12\]"),
    ({"method": "eagle", "num_speculative_tokens": 9}, r"tokens must be in \[1, 8\]"),
    ({"method": "ngram", "lookahead": 3}, r"unknown keys \['lookahead'\]"),
    ({"method": "ngram", "prompt_lookup_min": 4}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "eagle", "tree_nodes": 0}, "tree_nodes and tree_topk must be >= 1"),
    ({"num_speculative_tokens": 3}, "must be a dict with a 'method'"),
])
def test_bad_configs_name_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(options)


@pytest.fixture(scope="module")
def model():
    return sharp_model(torch.float32)


def test_medusa_lookahead_is_bounded_by_its_heads(model):
    drafter = random_drafter("medusa", model)         # 4 heads
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4))
    with pytest.raises(ValueError, match=r"in \[1, 4\] for medusa"):
        build_speculator({"method": "medusa", "num_speculative_tokens": 5}, engine,
                         drafter=drafter)


def test_options_speculation_cannot_serve(model):
    small = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=8,
                                                max_num_batched_tokens=64))
    options = {"method": "ngram", "num_speculative_tokens": 8}
    with pytest.raises(ValueError, match="max_num_batched_tokens >= max_num_seqs x"):
        small.use_speculator(build_speculator(options, small))
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4))
    engine.use_speculator(build_speculator(options, engine))
    with pytest.raises(ValueError, match="beam search"):
        engine.add_request([5, 6, 7], SamplingParams(beam_width=2, max_tokens=4))
    rid = engine.add_request([5, 6, 7, 5, 6], SamplingParams(max_tokens=4))
    while engine.has_unfinished():          # the engine keeps serving
        engine.step()
    assert rid not in engine.requests and engine.blocks.num_free == 64


def test_weight_files_are_checked(model, tmp_path):
    module, head, _ = random_drafter("eagle", model)
    path = save_drafter(module, model, module.cfg, head.ids, {"steps": 0}, tmp_path / "eagle.pt")
    loaded, _, manifest = load_drafter("eagle", model, path)
    for a, b in zip(loaded.state_dict().values(), module.state_dict().values()):
        # int4 in groups of 64 columns: within half a step, 1/14 of the group's largest value
        assert torch.allclose(a.float(), b.float(), atol=b.float().abs().max() / 13 + 1e-6)
    assert manifest["storage"] == STORAGE
    other = sharp_model(torch.float32, seed=11)
    with pytest.raises(ValueError, match="trained for another model"):
        load_drafter("eagle", other, path)
    with pytest.raises(ValueError, match="holds a 'eagle' drafter, not 'mtp'"):
        load_drafter("mtp", model, path)
    with pytest.raises(FileNotFoundError, match="method 'eagle' needs .* missing.*make drafters"):
        load_drafter("eagle", model, tmp_path / "nothing.pt")
    with pytest.raises(FileNotFoundError, match="method 'eagle3' .*make drafters-corpus"):
        load_drafter("eagle3", model, tmp_path / "nothing3.pt")
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="does not match its manifest"):
        load_drafter("eagle", model, path)


def test_auto_with_a_drafter_that_has_no_weights_names_the_method(model, tmp_path):
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4))
    options = {"method": "eagle3", "num_speculative_tokens": "auto",
               "drafter": str(tmp_path / "none.pt")}
    with pytest.raises(FileNotFoundError, match="speculative_config method 'eagle3' needs"):
        build_speculator(options, engine, calibration_prompts=[[5, 6, 7]])
    assert not engine.requests and engine.speculator is None      # nothing ran


def test_stored_matrices_round_trip_within_half_a_step():
    """int4 in groups of GROUP columns: every value within half its group's step (the group's
    largest magnitude / 7, fp16-rounded) of the original; a matrix of another width as int8
    rows (half a step: its row's largest / 127); vectors as fp16."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(96, 3 * GROUP, generator=g) * torch.rand(96, 1, generator=g),
             "odd": torch.randn(80, 70, generator=g), "v": torch.randn(9, generator=g)}
    stored = quantize(state)
    assert stored["w.int4"].dtype == torch.uint8 and stored["w.int4"].shape == (96, 3 * GROUP // 2)
    back = dequantize(stored)
    step = stored["w.scale"].float()[..., None]              # the group's largest / 7
    err = (back["w"] - state["w"]).view(96, 3, GROUP).abs()
    assert (err <= step / 2 + 1e-6).all()
    assert torch.allclose(step[..., 0], state["w"].view(96, 3, GROUP).abs().amax(-1) / 7,
                          rtol=1e-3)
    assert (err > step / 8).any()                   # it is 4-bit: not a float copy
    row_step = stored["odd.scale"].float()
    assert ((back["odd"] - state["odd"]).abs() <= row_step / 2 + 1e-6).all()
    assert torch.equal(back["v"], state["v"].half().float())


def test_the_shipped_drafters_fit_the_budget_and_say_how_they_are_stored():
    files = sorted(WEIGHTS_DIR.glob("*.pt"))
    assert len(files) >= 6 and sum(f.stat().st_size for f in files) <= BUDGET_BYTES
    for f in files:
        manifest = json.loads(f.with_suffix(".json").read_text())
        assert manifest["storage"] == STORAGE and manifest["bytes"] == f.stat().st_size
