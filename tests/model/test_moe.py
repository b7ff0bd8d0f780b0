"""MoE routing against a dense per-token loop in float64."""
import pytest
import torch
import torch.nn.functional as F

from minillm.model import MoEFeedForward

D, FFN, E = 16, 32, 6


def dense_reference(moe, x):
    """Per token: softmax over all experts, keep the k largest, renormalise, sum weighted
    SwiGLU outputs computed from the raw weight matrices."""
    out = torch.zeros_like(x)
    for n, token in enumerate(x):
        probs = torch.softmax(moe.router.weight @ token, dim=0)
        chosen = sorted(range(E), key=lambda e: -probs[e].item())[:moe.top_k]
        total = sum(probs[e] for e in chosen)
        for e in chosen:
            ex = moe.experts[e]
            hidden = F.silu(ex.w_gate.weight @ token) * (ex.w_up.weight @ token)
            out[n] += probs[e] / total * (ex.w_down.weight @ hidden)
    return out


@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_top_k_matches_dense_loop(top_k):
    torch.manual_seed(0)
    moe = MoEFeedForward(D, FFN, E, top_k).double().eval()
    x = torch.randn(3, 9, D, dtype=torch.float64)
    with torch.no_grad():
        y = moe(x)
    ref = dense_reference(moe, x.reshape(-1, D)).view_as(x)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)


def test_load_counts_sum_to_tokens_times_k():
    torch.manual_seed(0)
    moe = MoEFeedForward(D, FFN, E, top_k=2)
    x = torch.randn(4, 10, D)
    moe(x)
    assert moe.expert_load.shape == (E,)
    assert moe.expert_load.sum().item() == 40 * 2
    _, experts, _ = moe.route(x.reshape(-1, D))
    assert moe.expert_load.tolist() == [int((experts == e).sum()) for e in range(E)]


def test_aux_loss_is_one_for_uniform_router_and_larger_when_skewed():
    torch.manual_seed(0)
    moe = MoEFeedForward(D, FFN, E, top_k=2)
    x = torch.randn(50, D)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(x)
    assert moe.aux_loss.item() == pytest.approx(1.0)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 5 * x.mean(0)   # expert 0 favoured for most tokens
    moe(x)
    assert moe.aux_loss.item() > 1.2


def test_aux_loss_formula_and_gradient():
    torch.manual_seed(0)
    moe = MoEFeedForward(D, FFN, E, top_k=2)
    x = torch.randn(30, D)
    moe(x)
    probs = torch.softmax(x @ moe.router.weight.T, dim=-1).detach()
    top = probs.topk(2, dim=-1).indices
    f = torch.tensor([(top == e).sum().item() / top.numel() for e in range(E)])
    expected = E * sum(f[e] * probs[:, e].mean() for e in range(E))
    assert moe.aux_loss.item() == pytest.approx(expected.item(), rel=1e-5)
    moe.aux_loss.backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


def test_router_noise_only_in_training():
    torch.manual_seed(0)
    noisy = MoEFeedForward(D, FFN, E, top_k=2, noise_std=1.0)
    clean = MoEFeedForward(D, FFN, E, top_k=2)
    clean.load_state_dict(noisy.state_dict())
    x = torch.randn(64, D)
    with torch.no_grad():
        noisy.eval()
        clean.eval()
        torch.testing.assert_close(noisy(x), clean(x), rtol=0, atol=0)
        noisy.train()
        clean.train()
        torch.testing.assert_close(clean(x), clean.eval()(x), rtol=0, atol=0)
        first, second = noisy(x), noisy(x)
    assert not torch.allclose(first, second)


def test_bad_top_k_is_rejected():
    with pytest.raises(ValueError, match="top_k"):
        MoEFeedForward(D, FFN, E, top_k=E + 1)
