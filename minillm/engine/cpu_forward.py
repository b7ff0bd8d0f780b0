"""The runner's CPU fast path: one engine step's forward pass with the small ops fused.

:meth:`Transformer.forward_layers` is the model as the course writes it: modules calling some
forty PyTorch operations a layer. On the CPU, at a decode step's few rows, the dispatch of the
small ones (norms, RoPE, residual adds, the cache write, SiLU) and the Python around each call
cost more than their arithmetic. :class:`CpuForward` computes the same layers over the same
weights with each group of small ops one C++ call (:mod:`minillm.kernels.cpu_fused_ops`),
attention the paged kernel (:mod:`minillm.kernels.cpu_paged_attention`) and the matmuls
oneDNN's on the weights already packed (bfloat16 at a few rows: a matrix-vector kernel of
its own, :class:`~minillm.model.packed.CpuWeight`; quantized linears: the group their class
names as ``fused_group``, e.g. :class:`minillm.quant.linear.QuantGroup`), per layer:

    h = RMSNorm(x += delta)                  add_rms_norm (delta: the previous sublayer's output)
    q, k, v = h @ [Wq Wk Wv]                 one packed matmul
    q = rope(q); cache <- rope(k), v         rope_store
    delta = attention(q, cache) @ Wo         the paged kernel, a packed matmul
    h = RMSNorm(x += delta)                  add_rms_norm
    delta = (silu(h Wg) * (h Wu)) @ Wd       a packed matmul, silu_mul, a packed matmul

Each op rounds where the eager code rounds, but a sum may run in another order, so a last bit
here and there differs and, over 30 layers, bfloat16 greedy text can part from the eager path's
after some tokens, as it does between batch sizes (``tests/engine/test_cpu_forward.py``: as
close to a float64 forward as the eager path, float32 within 1e-5 of it, the same greedy
float32 text).
:func:`supports` says when it applies: a dense Llama-family model (no QK-norm, no experts) on
the CPU with the C++ kernels built; the runner also requires the ``cpu`` backend (not wrapped;
every other case takes the eager path). A speculative step's tree drafts go to the same
kernel with their masks as bits (a mask wider than it takes: SDPA in a padded group, inside
the same fused layers). Like a
compiled graph, it runs no ``nn.Module`` hooks: to hook the layers, turn it off
(``EngineConfig(fuse_ops=False)``). The KV connector's per-layer calls run here as in the
eager path. A decode step whose every call is C++ (quantized weights at a few rows) is
recorded once per batch size and replayed after (:mod:`.cpu_replay`, ``replay``).
``python benchmarks/cpu_forward_bench.py`` measures it.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Collection

import torch
from torch import nn

from ..attention.paged import attend_groups_and_singles
from ..cache.pool import PagedBatch
from ..config import ModelConfig
from ..model.layers import Attention, RMSNorm, SwiGLU, rope_cos_sin
from ..model.packed import CpuWeight, PackedGroup, PackedLinear, can_pack_linears
from ..model.transformer import Block, LayerCall
from .cpu_replay import Buffers, RecordedDecode, StepShape


def _kernels():
    from ..kernels import cpu_fused_ops, cpu_paged_attention

    return cpu_fused_ops, cpu_paged_attention


def _fused_group(linears: list[nn.Module]):
    """The group type that runs ``linears`` as one call, if their class names one: a
    quantized linear (a technique the core never imports) sets ``fused_group`` to a class with
    ``supports(linears) -> bool`` and ``group(linears)``: x [N, K] -> [N, sum of out_features]
    (:class:`minillm.quant.linear.QuantGroup`). None when it names none or refuses them."""
    group = getattr(type(linears[0]), "fused_group", None) if linears else None
    return group if group is not None and group.supports(linears) else None


LINEARS = (("attn", ("wq", "wk", "wv")), ("attn", ("wo",)), ("ffn", ("w_gate", "w_up")),
           ("ffn", ("w_down",)))     # a layer's four matmuls: packed groups, single linears


def supports(model: nn.Module, cfg: ModelConfig | None = None) -> bool:
    """Whether :class:`CpuForward` computes what ``model``'s layers would with the ``cpu``
    paged backend. ``model``: a :class:`Transformer`, or any module with ``layers`` (blocks of
    shape ``cfg``, default ``model.cfg``) and a final ``norm``, such as a drafter's (a walk over
    the model, about 2 ms here: :class:`CpuForward` repeats it only when the model changed)."""
    fused, attention = _kernels()
    cfg = cfg or model.cfg
    weight = model.norm.weight
    if weight.device.type != "cpu" or weight.dtype not in \
            fused.DTYPES or not (fused.available() and attention.available()):
        return False
    return type(model.norm) is RMSNorm and all(_plain_layer(b, cfg, weight.dtype)
                                               for b in model.layers)


def _plain_layer(b: nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> bool:
    """A Llama layer as :mod:`minillm.model` builds it, whose matmuls are each bias-free linears
    of the model's ``dtype`` (plain or packed, oneDNN packs that dtype here, weights with version
    counters: not inference tensors) or quantized linears with a fused group
    (:func:`_fused_group`)."""
    if not (type(b) is Block and type(b.attn) is Attention and type(b.ffn) is SwiGLU
            and type(b.attn_norm) is RMSNorm and type(b.ffn_norm) is RMSNorm
            and not hasattr(b.attn, "q_norm") and b.attn.n_heads == cfg.n_heads
            and b.attn.n_kv_heads == cfg.n_kv_heads):
        return False
    return all(_plain_linears(lins, dtype) or _fused_group(lins) is not None
               for lins in (_linears(getattr(b, part), names) for part, names in LINEARS))


def _plain_linears(linears: list[nn.Module], dtype: torch.dtype) -> bool:
    return can_pack_linears(torch.device("cpu"), dtype) and all(
        type(lin) in (nn.Linear, PackedLinear) and lin.bias is None
        and lin.weight.dtype == dtype and not lin.weight.is_inference()
        for lin in linears)


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear]:
    return [getattr(module, n) for n in names]


def _cpu_weight(module: nn.Module, names: tuple[str, ...]) -> CpuWeight:
    """The CPU's matmuls over ``module``'s linears ``names`` (their weights concatenated by
    output rows), the ones the model's packed linear or group already holds when it has one."""
    linears = _linears(module, names)
    if len(names) == 1:
        lin = linears[0]
        return (lin if isinstance(lin, PackedLinear) else PackedLinear(lin)).cpu_weight()
    return (module.input_group or PackedGroup(module, *names)).cpu_weight(linears)


def _matmul_of(module: nn.Module, names: tuple[str, ...]) -> Callable[..., torch.Tensor]:
    """x [N, K] (, out) -> [N, sum of out_features]: ``module``'s linears ``names`` as one
    matmul (:class:`~minillm.model.packed.CpuWeight`: oneDNN's on their packed weight, at a
    few bfloat16 rows the C++ matrix-vector kernel; the integer kernels' for quantized
    linears)."""
    linears = _linears(module, names)
    group = _fused_group(linears)
    return group(linears) if group is not None else _cpu_weight(module, names)


#: rows of all the recordings kept at once (:meth:`CpuForward._recording`; each holds its
#: step's activations, ~20 KB a row of SmolLM2 in bfloat16), the least recently used dropped
MAX_RECORDED_ROWS = 1024


_VERSION = operator.attrgetter("_version")


class CpuForward:
    """The fast forward for one model, watching what it depends on cheaply: each step
    compares the model's modules and the weights' versions with those it last
    saw (:meth:`_unchanged`), and only when they changed walks the model again
    (:func:`supports`) and looks its weights up (:class:`~minillm.model.packed.CpuWeight`, per
    layer [Wq Wk Wv], Wo, [Wg Wu], Wd). Calling
    the packed linears instead would cost their own checks, 20-35 us a call here: a tenth of
    a batch-1 step. ``model`` and ``cfg`` as :func:`supports` takes them: a
    :class:`Transformer` (:meth:`__call__` from token ids), or a drafter's stack of blocks
    (:meth:`layers` from its own input rows). ``replay`` (default True): record a step whose
    calls are all C++ once per :class:`~.cpu_replay.StepShape` and replay it after;
    ``recorded``: the recordings by shape (:class:`~.cpu_replay.RecordedDecode`)."""

    def __init__(self, model: nn.Module, cfg: ModelConfig | None = None) -> None:
        self.model, self.cfg = model, cfg or model.cfg
        self._seen: tuple | None = None
        self.supported = False
        self.matmuls: list[tuple[Callable[..., torch.Tensor], ...]] = []
        self.replay = True
        self.recorded: dict[StepShape, RecordedDecode] = {}

    def _unchanged(self) -> bool:
        """Every module's children and weight versions as when :meth:`applies` last looked
        (identity checks: ~25 us in a loop, ~0.2 ms inside a step, where the objects are out
        of cache after the forward has streamed the weights)."""
        if self._seen is None:
            return False
        dicts, keys, children, params, versions = self._seen
        # list == compares item by item in C, identity first (a module's == is identity)
        return list(map(dict.get, dicts, keys)) == children \
            and list(map(_VERSION, params)) == versions

    def applies(self) -> bool:
        """Whether :meth:`__call__` computes this model's forward now."""
        if self._unchanged():
            return self.supported
        self.supported = supports(self.model, self.cfg)
        self.recorded = {}
        self.matmuls = [tuple(_matmul_of(getattr(b, part), names) for part, names in LINEARS)
                        for b in self.model.layers] if self.supported else []
        modules = list(self.model.modules())
        slots = [(m._modules, k, c) for m in modules for k, c in m._modules.items()]
        params = [p for p in self.model.parameters() if not p.is_inference()]
        self._seen = ([d for d, _, _ in slots], [k for _, k, _ in slots],
                      [c for _, _, c in slots], params, list(map(_VERSION, params)))
        return self.supported

    def runs(self, batch: PagedBatch) -> bool:
        """Whether :meth:`__call__` (or :meth:`layers`) computes a forward over ``batch`` now:
        its backend declares ``cpu_fast_path`` (computes exactly the C++ kernel's attention),
        its metadata was built with ``direct=True`` (the sequences go to the paged kernel)
        and has every one left to SDPA (a tree mask wider than the kernel takes) after cached
        context (SDPA with its mask then reads only the cache), and :meth:`applies`."""
        meta = batch.meta
        return batch.attn.cpu_fast_path and meta.direct is not None \
            and all(meta.ctx_lens[i] for i in meta.singles) and self.applies()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
                 keep: Collection[int] = (), before_layer: LayerCall | None = None,
                 after_layer: LayerCall | None = None
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """input_ids, positions [N] (the step's flat batch) -> (final normed hidden states
        [N, D], {layer: residual stream after it [N, D]} for the layers in ``keep``); stores
        each layer's K/V at ``batch.meta.slot_mapping`` of ``batch.pool``, calling
        ``before_layer(i)`` / ``after_layer(i)`` around layer i as ``forward_layers`` does.
        Call where it :meth:`runs` the batch: the sequences of ``meta.direct`` go to the
        paged kernel (tree masks as ``meta.row_bits``), the others (wider tree masks, after
        cached context) to SDPA in padded groups."""
        x = self.model.embed(input_ids)
        if before_layer is None and after_layer is None:
            return self.from_rows(x, positions, batch, keep)
        return self.layers(x, positions, batch, keep, before_layer, after_layer)

    def from_rows(self, x: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
                  keep: Collection[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`layers` (x [N, D] the first layer's input rows, e.g. a drafter's), replayed
        from the recording of the batch's :class:`~.cpu_replay.StepShape` where one serves it
        (:meth:`_recording`), else run (and recorded, where it can be)."""
        recorded = self._recording(batch, tuple(sorted(keep)))
        if recorded is not None:
            return recorded.run(x, positions, batch.meta, self.layers, self._rope)
        return self.layers(x, positions, batch, keep)

    def _recording(self, batch: PagedBatch, keep: tuple[int, ...]) -> RecordedDecode | None:
        """The recorded step (:mod:`.cpu_replay`) that serves ``batch``, new or kept, if
        ``replay`` is on and it can: every sequence continues a cached one (decodes and
        verifications: shapes that recur, where a new prompt's rarely does) and goes to the
        paged kernel (tree masks as bits), and every matmul is one C++ call at the step's rows
        (``one_call``, e.g. :meth:`minillm.quant.linear.QuantGroup.one_call`)."""
        meta, s = batch.meta, len(batch.meta.q_lens)
        if not self.replay or meta.groups or meta.singles or meta.direct is None \
                or meta.direct.numel() != s or not all(meta.ctx_lens):
            return None
        shape = StepShape(s, sum(meta.q_lens), meta.row_bits is not None, keep)
        recorded = self.recorded.pop(shape, None)
        if recorded is not None and recorded.serves(batch):
            self.recorded[shape] = recorded           # now the most recently used
            return recorded
        dt = self.model.norm.weight.dtype           # the activations' (a drafter has no embed)
        if not all(getattr(m, "one_call", None) and m.one_call(shape.rows, dt)
                   for mm in self.matmuls for m in mm):
            return None
        recorded = RecordedDecode(batch, -(-self.cfg.max_seq_len // meta.block_size), keep)
        if not recorded.serves(batch):
            return None
        while self.recorded and sum(r.rows for r in self.recorded) + shape.rows \
                > MAX_RECORDED_ROWS:
            del self.recorded[next(iter(self.recorded))]
        self.recorded[shape] = recorded
        return recorded

    def _rope(self, positions: torch.Tensor, buffers: Buffers | None, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos, sin [N, head_dim] at ``positions`` (in ``buffers`` when given)."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        if buffers is None:
            return cos, sin
        return buffers.put("cos", cos), buffers.put("sin", sin)

    def layers(self, x: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
               keep: Collection[int] = (), before_layer: LayerCall | None = None,
               after_layer: LayerCall | None = None, buffers: Buffers | None = None
               ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`__call__` from the first layer's input rows ``x`` [N, D] (written to in
        place: the residual stream) instead of token ids. ``buffers``: take every tensor the
        step writes from there (a step being recorded, :mod:`.cpu_replay`), not fresh ones."""
        fused, attention = _kernels()
        model, meta, pool, cfg, dt = self.model, batch.meta, batch.pool, self.cfg, x.dtype
        n, hq, hkv, hd = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos, sin = self._rope(positions, buffers, dt)                        # [N, hd]

        def new(name: str, width: int) -> torch.Tensor:
            """An [N, width] tensor to write: fresh, or the buffer ``name``."""
            return torch.empty(n, width, dtype=dt) if buffers is None \
                else buffers.empty(name, (n, width), dt)

        def norm(delta: torch.Tensor | None, rms: RMSNorm, name: str = "h") -> torch.Tensor:
            """x += delta (in place, when given), then rms(x): a new [N, D] tensor."""
            return fused.add_rms_norm_into(x, delta, rms.weight, rms.eps, new(name, x.shape[1]))

        def matmul(f: Callable[..., torch.Tensor], h: torch.Tensor, name: str) -> torch.Tensor:
            return f(h) if buffers is None else f(h, buffers.empty(name, (n, widths[name]), dt))
        widths = {"qkv": (hq + 2 * hkv) * hd, "o": x.shape[1], "gate_up": 2 * cfg.ffn_dim,
                  "down": x.shape[1]}

        delta, kept = None, {}
        for i, (layer, (qkv, o, gate_up, down)) in enumerate(zip(model.layers, self.matmuls)):
            if before_layer is not None:
                before_layer(i)
            q, k, v = matmul(qkv, norm(delta, layer.attn_norm), "qkv").split(
                [hq * hd, hkv * hd, hkv * hd], dim=1)                # views of one [N, .]
            k_cache, v_cache = pool.layer(i)          # the model's dtype, bfloat16 or int8
            q_rot = fused.rope_store_into(q, k, v, cos, sin, k_cache, v_cache,
                                          meta.slot_mapping, new("q_rot", hq * hd).view(n, hq, hd))
            out = new("attention", hq * hd).view(n, hq, hd)
            if meta.direct.numel():
                attention.attend_in_place(q_rot, k_cache, v_cache, meta.block_tables,
                                          meta.seq_lens, meta.cu_seqlens_q, meta.direct, out,
                                          row_bits=meta.row_bits, mask_from=meta.mask_from)
            if meta.groups or meta.singles:    # wide tree masks: SDPA in padded groups
                attend_groups_and_singles(q_rot, None, None, k_cache, v_cache, meta, out)
            delta = matmul(o, out.view(n, -1), "o")
            gate, up = matmul(gate_up, norm(delta, layer.ffn_norm), "gate_up").chunk(2, dim=1)
            delta = matmul(down, fused.silu_mul_into(gate, up, new("act", gate.shape[1])), "down")
            if after_layer is not None:
                after_layer(i)
            if i in keep:
                from ..kernels.cpu_build import profiled_call

                kept[i] = torch.empty_like(x) if buffers is None \
                    else buffers.empty(f"kept{i}", tuple(x.shape), dt)
                profiled_call(_add_into, "keep_hidden", x, delta, kept[i])
                delta = None
        return norm(delta, model.norm, "final"), kept


def _add_into(x: torch.Tensor, delta: torch.Tensor, out: torch.Tensor) -> None:
    """x += delta; out = x (a layer's residual stream kept for a drafter: a call a recorded
    step replays, as it does the C++ ones)."""
    x.add_(delta)
    out.copy_(x)

