"""compare_sampling: the plain and the speculative engine's first tokens against the exact
distribution (enumerated independently here by sampling the model's logits directly)."""
from __future__ import annotations

import torch

from minillm import SamplingParams
from minillm.course.ch06_sampling import compare_sampling, first_tokens_distribution, tv_tolerance
from minillm.labs.ch06 import first_layer_drafter, sampling_model


def test_exact_distribution_is_the_product_of_the_models_softmaxes():
    """Temperature 1, top-k 2: every two-token outcome's probability is p(t1) p(t2 | t1)
    from float64 softmaxes over the two largest logits."""
    model = sampling_model()
    prompt = list(range(5, 13))
    dist = first_tokens_distribution(model, prompt, SamplingParams(temperature=1.0, top_k=2), 2)
    assert abs(sum(dist.values()) - 1) < 1e-6 and len(dist) == 4
    with torch.no_grad():
        for (t1, t2), prob in dist.items():
            first = model(torch.tensor([prompt]))[0, -1].double()
            top = first.topk(2)
            p1 = top.values.softmax(-1)[top.indices.tolist().index(t1)]
            second = model(torch.tensor([prompt + [t1]]))[0, -1].double().topk(2)
            p2 = second.values.softmax(-1)[second.indices.tolist().index(t2)]
            assert abs(prob - float(p1 * p2)) < 1e-5


def test_plain_and_speculative_samples_are_within_the_noise_of_the_exact_distribution():
    model = sampling_model()
    prompt = list(range(5, 13))
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)
    comp = compare_sampling(model, prompt, params,
                            {"method": "draft_model", "num_speculative_tokens": 2}, 600,
                            positions=2, drafter=first_layer_drafter(model))
    assert sum(comp.plain.values()) == sum(comp.spec.values()) == 600
    assert comp.acceptance and 0.05 < comp.acceptance[0] < 0.95       # both branches ran
    for pos in (None, 0, 1):
        assert comp.distance(comp.plain, pos) <= comp.tolerance(pos)
        assert comp.distance(comp.spec, pos) <= comp.tolerance(pos)
    assert comp.tolerance() == tv_tolerance(list(comp.exact.values()), 600)
