"""Checkers for the exercises of appendix A1 (training and quantization).

Each ``check_*`` takes the student's function (or class), compares it with the package or a
float64 reference on a few cases, prints a one-line verdict and returns a
:class:`~minillm.labs.common.Result` (``passed`` is None while the exercise still raises
NotImplementedError). Two are builds that run inside the model: :func:`check_lora_finetune`
fine-tunes a model through the student's LoRA layer (:class:`LoRAFromLayer`), and
:func:`check_int4_serving` serves a decode from the student's int4 format
(:class:`Int4Served`) in the engine.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..engine import EngineConfig, LLMEngine
from ..model.transformer import Transformer
from ..quant.formats import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from ..quant.linear import DequantizedLinear
from ..quant.methods import awq_quantize, gptq_quantize
from ..quant.quantize import LINEARS, quantize_model
from ..train.data import IGNORE
from ..train.lora import TARGETS, LoRALinear, add_lora, lora_parameters, merge_lora
from ..train.preference import bradley_terry_loss, dpo_loss
from ..train.sft import optimizer, sft_loss
from .common import Result, check
from .in_engine import assert_same_tokens, demo_model, demo_prompts, serve_greedy


def _weights(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(8, 64, generator=g) * 0.05, torch.randn(3, 128, generator=g)]
    w = torch.randn(5, 96, generator=g) * 0.02
    w[2, 5] = 0.7  # an outlier
    w[4] = 0.0  # an all-zero row
    return ws + [w]


# ----------------------------------------------------------------------------- LoRA

def check_lora_layer(cls: Callable[..., nn.Module]) -> Result:
    """``cls(base, rank, alpha)`` -> a module wrapping a frozen ``nn.Linear`` base (W [N, K],
    optional bias) with trainable ``lora_a`` [r, K] (small random) and ``lora_b`` [N, r]
    (zeros), both in W's dtype and on its device. ``forward(x [..., K])`` -> base(x) +
    (alpha / r) x A^T B^T [..., N]; ``merged_weight()`` -> W + (alpha / r) B A [N, K].
    Checked: the layer starts equal to its base, only A and B train, the forward and the
    merged weight after A and B have moved."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(2)
        for n, k, r, alpha, bias in ((6, 10, 2, 4.0, True), (16, 8, 8, 8.0, False),
                                     (5, 7, 1, 1.0, True)):
            case = f"N={n}, K={k}, r={r}, alpha={alpha}, bias={bias}"
            base = nn.Linear(k, n, bias=bias)
            w0 = base.weight.detach().clone()
            layer = cls(base, r, alpha)
            x = torch.randn(2, 3, k, generator=g)
            with torch.no_grad():
                want0 = F.linear(x, w0, base.bias)
                got0 = layer(x)
            assert tuple(got0.shape) == (2, 3, n), (
                f"{case}: output shape {tuple(got0.shape)}, expected (2, 3, {n})")
            assert torch.allclose(got0, want0, atol=1e-6), (
                f"{case}: a fresh layer must equal its base (B starts at zero), off by "
                f"{(got0 - want0).abs().max():.2e}")
            a, b = layer.lora_a, layer.lora_b
            assert tuple(a.shape) == (r, k) and tuple(b.shape) == (n, r), (
                f"{case}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)}, expected "
                f"({r}, {k}) and ({n}, {r})")
            assert (b == 0).all() and (a != 0).any(), (
                f"{case}: initialise lora_b to zeros and lora_a small random (if both are "
                f"zero, no gradient ever reaches them)")
            trainable = {id(p) for p in layer.parameters() if p.requires_grad}
            assert trainable == {id(a), id(b)}, (
                f"{case}: only lora_a and lora_b may train; freeze the base "
                f"({len(trainable)} trainable tensors found)")
            with torch.no_grad():
                a.copy_(torch.randn(r, k, generator=g))
                b.copy_(torch.randn(n, r, generator=g))
                got = layer(x).double()
                delta = alpha / r * b.double() @ a.double()
                want = F.linear(x.double(), w0.double() + delta,
                                None if base.bias is None else base.bias.double())
                err = (got - want).abs().max().item()
                assert err < 1e-4, f"{case}: forward with trained A, B off by {err:.2e}"
                merged = torch.as_tensor(layer.merged_weight()).double()
                err = (merged - (w0.double() + delta)).abs().max().item()
                assert err < 1e-4, f"{case}: merged_weight() off by {err:.2e}"
                assert torch.equal(base.weight, w0), (
                    f"{case}: merged_weight() must not change the frozen base weight")

    return check("lora_layer", attempt)


# ----------------------------------------------------------------------------- LoRA in the model

class LoRAFromLayer(LoRALinear):
    """The student's LoRA layer ``cls(base, rank, alpha)`` where the package's
    :class:`~minillm.train.lora.LoRALinear` sits: the forward is ``layer(x)``, the merge adds
    ``layer.merged_weight() - W`` to W, and the adapters are the layer's ``lora_a`` and
    ``lora_b``; the package's training loops (``train_sft``, ``train_dpo``, ...), ``merge_lora``,
    ``fold_lora`` and ``lora_disabled`` find it as one of theirs."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float,
                 cls: Callable[..., nn.Module]) -> None:
        super().__init__(base, rank, alpha)
        self.layer = cls(base, rank, alpha)
        self.lora_a, self.lora_b = self.layer.lora_a, self.layer.lora_b

    def delta(self) -> torch.Tensor:
        """merged_weight() - W: the layer's own update to W [N, K]."""
        return torch.as_tensor(self.layer.merged_weight()) - self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) if self.merged or not self.enabled else self.layer(x)


def add_lora_layers(model: nn.Module, cls: Callable[..., nn.Module], rank: int, alpha: float,
                    layers: Sequence[int] | None = None,
                    targets: Sequence[str] = TARGETS) -> list[LoRAFromLayer]:
    """:func:`~minillm.train.lora.add_lora` with the student's layer class: freeze ``model``
    and wrap ``targets`` of ``layers`` (default: all) in :class:`LoRAFromLayer`."""
    model.requires_grad_(False)
    added = []
    for i in range(len(model.layers)) if layers is None else layers:
        for name in targets:
            block = model.layers[i]
            block.set_submodule(name, LoRAFromLayer(block.get_submodule(name), rank, alpha, cls))
            added.append(block.get_submodule(name))
    return added


def demo_sft_batches(model: Transformer, steps: int = 4, batch: int = 4, length: int = 16,
                     seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` seeded (ids [B, T], labels [B, T]) batches of random tokens whose second half
    is the "answer" (labels: the next token there, IGNORE on the prompt), for a model without
    a tokenizer (:func:`check_lora_finetune`'s default)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(5, model.cfg.vocab_size, (batch, length), generator=g)
        labels = torch.full_like(ids, IGNORE)
        labels[:, length // 2 - 1:-1] = ids[:, length // 2:]
        out.append((ids, labels))
    return out


def _finetune(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
              lr: float) -> tuple[list[float], float]:
    """``train_sft``'s loop over ready batches: AdamW on the adapters, the answer-token loss.
    -> (loss per step, seconds)."""
    opt = optimizer(model, lr)
    losses, t0 = [], time.perf_counter()
    model.train()
    for ids, labels in batches:
        loss = sft_loss(model, ids.to(model.device), labels.to(model.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses, time.perf_counter() - t0


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.to(model.device)).double()


def _first_gap(mine: Sequence[float], ref: Sequence[float], tol: float) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(mine, ref))
                 if not abs(a - b) <= tol * max(1.0, abs(b))), None)


def check_lora_finetune(cls: Callable[..., nn.Module], model: Transformer | None = None,
                        batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                        rank: int = 4, alpha: float = 16.0,
                        layers: Sequence[int] | None = None, lr: float = 1e-2) -> Result:
    """Exercise 1's ``LoRA`` fine-tunes ``model`` (default: the tiny preset, random weights,
    float64): its layers wrap the seven linears of ``layers`` (default: all;
    :class:`LoRAFromLayer`), and ``train_sft``'s loop (AdamW at ``lr`` on the adapters, the
    answer-token loss) runs over ``batches`` ((ids, labels) pairs; default
    :func:`demo_sft_batches`). The package's LoRALinear, its A set to the student's initial A,
    does the same steps. Passes when the fresh model gives the base model's logits, only the
    adapters train, every step's loss and the final logits equal the package's, the base
    weights are untouched and merging (``merged_weight()``) keeps the logits; prints both
    runs' losses and seconds."""
    model = model or demo_model()
    batches = batches if batches is not None else demo_sft_batches(model)
    dtype = model.dtype
    tol = {torch.float64: 1e-7, torch.float32: 2e-3}.get(dtype, 5e-2)

    def close(a: torch.Tensor, b: torch.Tensor) -> float:
        """max |a - b| over max |b|."""
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()

    def attempt() -> None:
        cls(nn.Linear(8, 4), 2, 4.0)               # a stub raises NotImplementedError here
        ids = batches[0][0][:2]                    # the logits compared: two rows
        base_logits = _logits(model, ids)
        mine, ref = copy.deepcopy(model), copy.deepcopy(model)
        added = add_lora_layers(mine, cls, rank, alpha, layers)
        a, w = added[0].lora_a, added[0].base.weight
        assert (a.dtype, a.device) == (w.dtype, w.device), (
            f"lora_a is {a.dtype} on {a.device}, the base weight {w.dtype} on {w.device}: "
            f"create A and B in the base weight's dtype, on its device")
        with torch.no_grad():
            for theirs, ours in zip(added, add_lora(ref, rank, alpha, layers=layers)):
                ours.lora_a = nn.Parameter(theirs.lora_a.detach().clone())
                ours.lora_b = nn.Parameter(torch.zeros_like(theirs.lora_b))
        err = close(_logits(mine, ids), base_logits)
        assert err <= tol, (
            f"before training, the model with your adapters must give the base model's "
            f"logits (B starts at zero); they differ by {err:.1e} of their scale")
        adapters = {id(p) for p in lora_parameters(mine)}
        extra = [n for n, p in mine.named_parameters() if p.requires_grad and id(p) not in
                 adapters]
        assert not extra, (f"only lora_a and lora_b may train; {len(extra)} more tensors do, "
                           f"e.g. {extra[0]}: freeze the base")
        losses, seconds = _finetune(mine, batches, lr)
        ref_losses, ref_seconds = _finetune(ref, batches, lr)
        step = _first_gap(losses, ref_losses, tol)
        assert step is None, (
            f"step {step + 1}: loss {losses[step]:.6f} with your LoRA, {ref_losses[step]:.6f} "
            f"with the package's (same model, same initial A, same batches)"
            + ("; the first step agreed, so the updates differ: check the scale alpha / r, "
               "and that the gradient still flows through the frozen base to the layers "
               "before" if step > 0 else ""))
        assert any(bool((m.lora_b != 0).any()) for m in added), (
            "lora_b is still zero after training: if A and B both start at zero, no gradient "
            "ever reaches them")
        now = dict(mine.named_parameters(remove_duplicate=False))
        for name, p in model.named_parameters():
            head, _, leaf = name.rpartition(".")
            q = now.get(name, now.get(f"{head}.base.{leaf}"))
            assert q is None or torch.equal(p, q), f"training changed the frozen weight {name}"
        trained = _logits(mine, ids)
        err = close(trained, _logits(ref, ids))
        assert err <= tol, (f"after {len(batches)} steps your model's logits differ from the "
                            f"package's by {err:.1e} of their scale")
        merge_lora(mine)                           # W <- merged_weight() in every layer
        err = close(_logits(mine, ids), trained)
        assert err <= tol, (f"the model with merged weights (merged_weight()) differs from "
                            f"the one with adapters by {err:.1e} of its logits' scale")
        n_train = sum(p.numel() for p in lora_parameters(mine))
        print(f"your LoRA: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps, "
              f"{seconds:.2f} s; the package's: {ref_losses[0]:.3f} -> {ref_losses[-1]:.3f}, "
              f"{ref_seconds:.2f} s; {n_train:,} parameters trained, merged = adapters")

    return check("lora_finetune", attempt)


# ----------------------------------------------------------------------------- formats

def check_int4_groups(cls: Callable[[torch.Tensor, int], object]) -> Result:
    """``cls(w, group_size)`` -> an object holding W [N, K] in int4 groups of ``group_size``
    along each row: ``.packed`` uint8 [N, K/2] (byte j = code 2j in the low nibble, code 2j+1
    in the high one), ``.scale`` and ``.min`` [N, K/G] (scale = (max - min) / 15, codes
    round((w - min) / scale) in 0..15), and ``.dequantize()`` -> float [N, K]. A group whose
    values are all equal may use any tiny positive scale. Compared with minillm.quant."""

    def attempt() -> None:
        for w in _weights(1):
            for gs in (32, 64):
                if w.shape[1] % gs:
                    continue
                case = f"weight {tuple(w.shape)}, group_size={gs}"
                q, scale, mn = quantize_int4(w, gs)
                got = cls(w.clone(), gs)
                packed = torch.as_tensor(got.packed)
                assert packed.dtype == torch.uint8 and tuple(packed.shape) == (
                    w.shape[0], w.shape[1] // 2), (
                    f"{case}: packed must be uint8 {(w.shape[0], w.shape[1] // 2)}, got "
                    f"{packed.dtype} {tuple(packed.shape)}")
                flat = (scale < 1e-9)[..., None].expand(-1, -1, gs).reshape(w.shape)
                wrong = ((unpack_int4(packed) != q) & ~flat).nonzero()
                if len(wrong):
                    r, c = (int(v) for v in wrong[0])
                    raise AssertionError(
                        f"{case}: byte [{r}, {c // 2}] is {int(packed[r, c // 2])}, expected "
                        f"{int(pack_int4(q)[r, c // 2])} (the codes are {int(q[r, c // 2 * 2])}, "
                        f"{int(q[r, c // 2 * 2 + 1])}; the even column goes in the low nibble)")
                live = scale >= 1e-9
                for name, mine, ref in (("scale", got.scale, scale), ("min", got.min, mn)):
                    mine = torch.as_tensor(mine).float()
                    assert tuple(mine.shape) == tuple(ref.shape), (
                        f"{case}: {name} shape {tuple(mine.shape)}, expected {tuple(ref.shape)}")
                    assert torch.allclose(mine[live], ref[live], atol=1e-7, rtol=1e-5), (
                        f"{case}: {name} differs from the package's")
                deq = torch.as_tensor(got.dequantize()).float()
                err = (deq - dequantize_int4(q, scale, mn, gs)).abs().max().item()
                assert err < 1e-6, f"{case}: dequantize() differs from the package by {err:.2e}"

    return check("int4_groups", attempt)


# ----------------------------------------------------------------------------- int4 in the engine

def held_bytes(obj: object) -> int:
    """Bytes of the tensors an object keeps in its attributes (and in lists, tuples or dicts
    there), each storage counted once and whole."""
    seen: dict[int, int] = {}

    def visit(v: object) -> None:
        if isinstance(v, torch.Tensor):
            s = v.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)

    for v in getattr(obj, "__dict__", {}).values():
        visit(v)
    return sum(seen.values())


class Int4Served(nn.Module):
    """A linear whose weight is an exercise-4 object (``.dequantize()`` -> float [N, K]) and
    nothing else: every call dequantizes it and multiplies, y = x W^T (weight-only
    quantization by plain PyTorch ops; the package's :class:`~minillm.quant.linear.Int4Linear`
    does the same in one kernel that never writes W out)."""

    def __init__(self, weight: object, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight_int4 = weight
        self.out_features, self.in_features = out_features, in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, torch.as_tensor(self.weight_int4.dequantize()).float().to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, exercise int4"


def swap_linears(model: Transformer, make: Callable[[nn.Linear], nn.Module]) -> Transformer:
    """Every block linear of ``model`` (the seven that ``quantize_model`` quantizes) replaced,
    in place, by ``make(linear)``; the embedding and the output head stay as they are."""
    for block in model.layers:
        for name in LINEARS:
            block.set_submodule(name, make(block.get_submodule(name)))
    return model


def int4_format_bytes(model: Transformer, group_size: int) -> int:
    """Bytes of the block linears in the int4 format: K/2 code bytes per row and a float32
    scale and min per group."""
    n = sum(block.get_submodule(name).weight.numel() for block in model.layers
            for name in LINEARS)
    return n // 2 + n // group_size * 8


def check_int4_serving(cls: Callable[[torch.Tensor, int], object],
                       model: Transformer | None = None,
                       prompts: list[list[int]] | None = None,
                       output_lens: list[int] | None = None, group_size: int = 32) -> Result:
    """Exercise 4's ``Int4Groups`` holds every block linear of ``model`` (default: the tiny
    preset, random weights, float64; :class:`Int4Served`: dequantized at every call), and the
    engine serves ``prompts`` greedily from it. Passes when every request gets the tokens of
    the same engine on the package's int4 format (``quantize_int4``, decoded to float) and
    the layers hold at most 1.5 times the format's bytes (codes, scales and mins: not a float
    copy of W). Also serves the package's packed int4 model (``quantize_model``, its kernels
    round the activations, so its tokens may part from the exact ones) and prints the three
    runs' seconds and the tokens they share."""
    model = model or demo_model()
    if prompts is None:
        prompts, output_lens = demo_prompts(4)
    dtype = model.dtype

    def reference(lin: nn.Linear) -> nn.Module:
        w = lin.weight.detach().float()
        return DequantizedLinear(
            dequantize_int4(*quantize_int4(w, group_size), group_size).to(dtype), "int4")

    def serve(m: Transformer) -> dict:
        return serve_greedy(LLMEngine(m, None, EngineConfig(num_kv_blocks=64)), prompts,
                            output_lens)

    def attempt() -> None:
        cls(torch.randn(2, 64), 32).dequantize()   # a stub raises NotImplementedError here
        held: list[int] = []

        def student(lin: nn.Linear) -> nn.Module:
            n, k = lin.weight.shape
            obj = cls(lin.weight.detach().float(), group_size)
            got = tuple(torch.as_tensor(obj.dequantize()).shape)
            assert got == (n, k), f"dequantize() of a [{n}, {k}] weight has shape {got}"
            held.append(held_bytes(obj))
            return Int4Served(obj, n, k)

        mine = serve(swap_linears(copy.deepcopy(model), student))
        ref = serve(swap_linears(copy.deepcopy(model), reference))
        assert_same_tokens(mine, ref)
        fmt = int4_format_bytes(model, group_size)
        assert sum(held) <= 1.5 * fmt, (
            f"the same tokens, but your layers hold {sum(held) / 1e6:.2f} MB where the int4 "
            f"format needs {fmt / 1e6:.2f} MB (codes, scales, mins): keep nothing else, no "
            f"float copy of W")
        packed = serve(quantize_model(copy.deepcopy(model), "int4", group_size,
                                      quantize_head=False))
        same = sum(a == b for x, y in zip(packed["tokens"], ref["tokens"]) for a, b in zip(x, y))
        total = sum(map(len, ref["tokens"]))
        print(f"your int4 layers ({sum(held) / 1e6:.1f} MB) served {total} tokens in "
              f"{mine['seconds']:.2f} s, dequantizing every weight at every step; the "
              f"package's int4 decoded to float: {ref['seconds']:.2f} s; its packed kernels: "
              f"{packed['seconds']:.2f} s, {same} of the {total} tokens the same")

    return check("int4_serving", attempt)


# ----------------------------------------------------------------------------- preferences

def _stable(fn: Callable[..., torch.Tensor], args: list[torch.Tensor], want: float,
            case: str) -> None:
    got = float(fn(*args))
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (
        f"{case}: got {got}, expected {want:.6g}" + (
            " (use logsigmoid: log(sigmoid(m)) overflows for large margins)"
            if got != got or abs(got) == float("inf") else ""))


def check_bradley_terry(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Result:
    """``fn(r_chosen [B], r_rejected [B])`` -> the mean Bradley-Terry loss
    -log sigmoid(r_c - r_r) over the batch (a 0-d tensor), finite for any margin."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(4)
        cases = [(f"batch {b}", [3 * torch.randn(b, generator=g) for _ in range(2)])
                 for b in (1, 4, 9)]
        cases.append(("margins of -200 and +150", [torch.tensor([-100.0, 80.0]),
                                                   torch.tensor([100.0, -70.0])]))
        for case, args in cases:
            want = bradley_terry_loss(*[a.double() for a in args]).item()
            _stable(fn, args, want, case)

    return check("bradley_terry", attempt)


def check_dpo_loss(fn: Callable[..., torch.Tensor]) -> Result:
    """``fn(pi_c, pi_r, ref_c, ref_r, beta)`` -> the mean DPO loss over a batch of summed
    response log-probabilities [B] (policy and reference, chosen and rejected), finite for any
    margin."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(3)
        cases = [(f"batch {b}, beta={beta}", [-10 * torch.rand(b, generator=g)
                                              for _ in range(4)], beta)
                 for b, beta in ((1, 0.1), (4, 0.5), (7, 2.0))]
        cases.append(("a policy far below its reference on the chosen answer, beta=0.5",
                      [torch.tensor([-2000.0, -30.0]), torch.tensor([-20.0, -25.0]),
                       torch.tensor([-10.0, -28.0]), torch.tensor([-20.0, -40.0])], 0.5))
        for case, args, beta in cases:
            want = dpo_loss(*[a.double() for a in args], beta)[0].item()
            _stable(lambda *a, beta=beta: fn(*a, beta), args, want, case)

    return check("dpo_loss", attempt)


# ----------------------------------------------------------------------------- AWQ, GPTQ

def _outlier_layer(seed: int, n: int, k: int, t: int, outliers: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] and activations [T, K] where a few input channels are 20x larger."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(t, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:outliers]] *= 20
    return w, x


def _awq_errors(w: torch.Tensor, x: torch.Tensor, gs: int, n_grid: int
                ) -> dict[float, float]:
    """Output error of AWQ's scaled round-to-nearest for every alpha of the grid (float64)."""
    errs = {}
    for j in range(n_grid):
        alpha = j / max(n_grid - 1, 1)
        s = _awq_scale(x, alpha)
        deq = dequantize_int4(*quantize_int4(w * s[None, :], gs), gs).double()
        errs[alpha] = ((x.double() / s.double()) @ deq.t() - x.double() @ w.double().t()
                       ).pow(2).mean().item()
    return errs


def _awq_scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    s = x.abs().mean(0).clamp(min=1e-6) ** alpha
    return s / (s.max() * s.min()).sqrt()


def check_awq_search(fn: Callable[..., tuple[float, torch.Tensor]]) -> Result:
    """``fn(w [N, K], x [T, K], group_size, n_grid)`` -> (alpha, s [K]): AWQ's per-channel
    scale search. For alpha in linspace(0, 1, n_grid): s = mean_t |x|^alpha, normalised so
    sqrt(max(s) min(s)) = 1; quantize W * s (columns scaled) with int4 round-to-nearest groups;
    the error is mean((x / s) Q(W s)^T - x W^T)^2. Return the best alpha and its s. Tested on
    layers whose activations have a few outlier channels, and one without."""

    def attempt() -> None:
        for seed, n, k, t, outliers, gs, n_grid in ((0, 16, 64, 48, 3, 32, 11),
                                                    (1, 8, 128, 32, 2, 64, 6),
                                                    (2, 12, 64, 40, 0, 32, 5)):
            case = f"N={n}, K={k}, {outliers} outlier channels, group_size={gs}, n_grid={n_grid}"
            w, x = _outlier_layer(seed, n, k, t, outliers)
            alpha, s = fn(w.clone(), x.clone(), gs, n_grid)
            alpha, s = float(alpha), torch.as_tensor(s).float()
            errs = _awq_errors(w, x, gs, n_grid)
            grid = min(errs, key=lambda a: abs(a - alpha))
            assert abs(grid - alpha) < 1e-6, (
                f"{case}: alpha={alpha} is not on the grid {sorted(errs)}")
            best = min(errs.values())
            assert errs[grid] <= best * (1 + 1e-3), (
                f"{case}: alpha={alpha} gives output error {errs[grid]:.3e}, but alpha="
                f"{min(errs, key=errs.get)} gives {best:.3e}")
            want = _awq_scale(x, grid)
            assert tuple(s.shape) == (k,) and torch.allclose(s, want, rtol=1e-4), (
                f"{case}: s is not mean|x|^alpha normalised to sqrt(max * min) = 1")
        w, x = _outlier_layer(0, 16, 64, 48, 3)
        assert awq_quantize(w, x, 32, 11)[4] > 0, (  # the package agrees that scaling helps
            "minillm.quant.awq_quantize kept alpha = 0 on the outlier layer: a package bug")

    return check("awq_search", attempt)


def _output_error(w: torch.Tensor, deq: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) = ||X W^T - X Q^T||^2 for H = X^T X."""
    d = (w.double() - deq.double())
    return torch.einsum("nk,kj,nj->", d, h.double(), d).item()


def check_gptq(fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Result:
    """``fn(w [N, K], hessian [K, K], group_size)`` -> (q uint8 [N, K] codes 0..15, scale
    [N, K/G], min [N, K/G]): GPTQ without act-order. Add 0.01 * mean(diag H) to H's diagonal,
    take U = the upper Cholesky factor of H^-1; for each column i left to right: when a group
    starts, fit its (scale, min) by min/max to the current (error-updated) columns of the
    group; quantize column i; err = (w_i - deq_i) / U[i, i]; W[:, i:] -= err U[i, i:].
    Judged by the output error tr((W - Q) H (W - Q)^T) against the package's GPTQ."""

    def attempt() -> None:
        g = torch.Generator().manual_seed(5)
        for n, k, t, gs in ((8, 64, 96, 32), (16, 128, 160, 64), (4, 64, 40, 64)):
            case = f"N={n}, K={k}, {t} calibration tokens, group_size={gs}"
            w = torch.randn(n, k, generator=g) * 0.05
            mix = torch.eye(k) + 0.6 * torch.randn(k, k, generator=g) / k ** 0.5
            x = torch.randn(t, k, generator=g) @ mix  # correlated inputs: feedback pays
            h = x.t() @ x
            q, scale, mn = (torch.as_tensor(v) for v in fn(w.clone(), h.clone(), gs))
            assert tuple(q.shape) == (n, k) and tuple(scale.shape) == (n, k // gs), (
                f"{case}: shapes q {tuple(q.shape)}, scale {tuple(scale.shape)}, expected "
                f"{(n, k)} and {(n, k // gs)}")
            assert int(q.min()) >= 0 and int(q.max()) <= 15, f"{case}: codes outside 0..15"
            mine = _output_error(w, dequantize_int4(q.to(torch.uint8), scale.float(),
                                                    torch.as_tensor(mn).float(), gs), h)
            ref = _output_error(w, dequantize_int4(*gptq_quantize(w, h, gs), gs), h)
            rtn = _output_error(w, dequantize_int4(*quantize_int4(w, gs), gs), h)
            assert mine <= ref * 1.02, (
                f"{case}: output error {mine:.4e}; the package's GPTQ reaches {ref:.4e} "
                f"(round-to-nearest: {rtn:.4e})")

    return check("gptq", attempt)
