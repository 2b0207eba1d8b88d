"""A compiled decode step: one new token per row, written out for Llama-family bases and run through
`torch.compile`.

The engine's decode forward goes through transformers' modules op by op: about 2,000 ATen calls a forward for a
6-layer model, each a pass over memory of its own (a norm alone is six). Written out over the same weights and
compiled (inductor: fused C++ loops on a CPU, Triton kernels on a GPU), the elementwise work of a layer fuses into
a few loops. No CUDA graph is captured: the step writes the KV cache it is handed, which CUDA graph trees do not
record.

What it covers: Llama, Mistral and Qwen2 bases (RMSNorm, rotary embedding with a static frequency table, SwiGLU
MLP, grouped-query attention written out for its one query a row, no sliding window), the engine's ragged KV
cache, and LoRA slots in any batch composition: all rows on one slot (a policy's rollout) multiply by that slot's
factors, mixed rows by their gathered factors. An engine asked to compile the step for any other base is refused
when it is built (`UnsupportedBase`, with the reason `unsupported` gives).

Tokens equal the eager forward's; logits agree to float rounding, not bit for bit (the fused loops sum in
another order). Compiling costs seconds (tens on a small CPU) on the first step and again at a new composition
kind (no LoRA, one slot, mixed); shapes are dynamic, so rows that retire and caches that grow do not recompile.
One-row batches run eager (a size of one would compile a graph of its own).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from mint_core.engine.kv_cache import RaggedCache
    from mint_core.lora.layers import LoRAContext

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "mistral", "qwen2")
"""`config.model_type` of the bases the written-out step covers."""
STATIC_ROPE = ("default", "linear", "llama3")
"""Rotary types whose frequency table does not change with the sequence length."""
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Factors = tuple[torch.Tensor, torch.Tensor] | None
LoRAMode = Literal["none", "shared", "rows"]


class UnsupportedBase(ValueError):
    """A base the compiled decode step does not cover; the message says why."""


def unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot take the compiled step, or None when it can."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"model_type {kind!r} is not one of {', '.join(ARCHITECTURES)}"
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {getattr(cfg, '_attn_implementation', None)!r}, not sdpa"
    if getattr(cfg, "use_sliding_window", kind == "mistral") and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if getattr(rotary, "rope_type", None) not in STATIC_ROPE:
        return f"rope type {getattr(rotary, 'rope_type', None)!r} is not one of {', '.join(STATIC_ROPE)}"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {getattr(cfg, 'hidden_act', None)!r}, not silu"
    layers = getattr(inner, "layers", None)
    if not layers:
        return "no decoder layers at model.model.layers"
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for name in PROJECTIONS:
            proj = getattr(
                attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else mlp, name, None
            )
            if proj is None or not isinstance(_linear(proj), nn.Linear):
                return f"layer {i} has no linear {name}"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return f"layer {i} normalises its queries and keys"
    return None


def _linear(proj: nn.Module) -> nn.Module:
    """The nn.Linear under a multi-LoRA wrapper (or the module itself)."""
    return getattr(proj, "base_layer", proj)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _proj(
    x: torch.Tensor, linear: tuple[torch.Tensor, torch.Tensor | None], mode: LoRAMode, f: Factors
) -> torch.Tensor:
    """x [B, in] through a linear's (weight, bias) and, per `mode`, its LoRA: `shared` A^T [in, r], B [r, out]
    for every row, `rows` A^T [B, in, r], B [B, r, out] a row."""
    out = F.linear(x, *linear)
    if f is None or mode == "none":
        return out
    A, B = f
    if mode == "shared":
        return out + (x @ A) @ B
    return out + torch.bmm(torch.bmm(x[:, None, :], A), B)[:, 0]


def _make_step(n_heads: int, n_kv: int, head_dim: int, eps: float, scaling: float, rope_scale: float) -> Any:
    """The step for one model's shape: its sizes are constants of the compiled graph, not dynamic inputs."""
    half = head_dim // 2

    def step(
        weights: dict[str, Any],
        tokens: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        mode: LoRAMode,
        factors: list[list[Factors]],
    ) -> torch.Tensor:
        """Logits [B, V] (float32) of the next token after `tokens` [B] at positions `pos` [B], with each layer's
        keys and values written into column L - 1 of its cache buffers [B, kv_heads, capacity, head_dim] and
        attention over columns [0, L) under `mask` [B, 1, 1, L] (True: a real token). L comes from the mask's
        shape: a size, not an int argument, so that dynamo keeps it symbolic rather than one graph per length."""
        dtype = weights["embed"].dtype
        h = F.embedding(tokens, weights["embed"])  # [B, H]
        freqs = pos[:, None].float() * weights["inv_freq"]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * rope_scale).to(dtype)[:, None, :]  # [B, 1, D]
        sin = (emb.sin() * rope_scale).to(dtype)[:, None, :]
        rows, seen = tokens.shape[0], mask.shape[-1]
        for i, lw in enumerate(weights["layers"]):
            f = factors[i]
            x = _rms(h, lw["in_norm"], eps)
            q = _proj(x, lw["q_proj"], mode, f[0]).view(rows, n_heads, head_dim)
            k = _proj(x, lw["k_proj"], mode, f[1]).view(rows, n_kv, head_dim)
            v = _proj(x, lw["v_proj"], mode, f[2]).view(rows, n_kv, head_dim)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            keys[i].narrow(2, seen - 1, 1).copy_(k[:, :, None])
            values[i].narrow(2, seen - 1, 1).copy_(v[:, :, None])
            # one query a row: attention written out, which inductor fuses (the CPU's flash-attention kernel
            # spends ~0.3 ms a call on 32 rows over 16 keys); a group of query heads shares its key head
            qg = q.view(rows, n_kv, n_heads // n_kv, head_dim)
            scores = torch.matmul(qg, keys[i].narrow(2, 0, seen).transpose(-1, -2)) * scaling
            p = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(dtype)
            a = torch.matmul(p, values[i].narrow(2, 0, seen))  # [B, kv_heads, group, D]
            h = h + _proj(a.reshape(rows, n_heads * head_dim), lw["o_proj"], mode, f[3])
            x = _rms(h, lw["post_norm"], eps)
            gate = _proj(x, lw["gate_proj"], mode, f[4])
            up = _proj(x, lw["up_proj"], mode, f[5])
            h = h + _proj(F.silu(gate) * up, lw["down_proj"], mode, f[6])
        h = _rms(h, weights["norm"], eps)
        return F.linear(h, weights["head"][0], weights["head"][1]).float()

    return step


class CompiledDecode:
    """The compiled decode step of one model, with its LoRA sites read from the engine's slot banks."""

    def __init__(self, model: nn.Module, ctx: LoRAContext):
        why = unsupported(model)
        if why is not None:
            raise UnsupportedBase(f"no compiled decode for this base: {why}")
        hf: Any = model  # a transformers causal LM, checked by `unsupported`
        cfg = hf.config
        inner = hf.model
        layers = list(inner.layers)
        attn0 = layers[0].self_attn
        head_dim = int(getattr(attn0, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
        head = hf.get_output_embeddings()
        self.ctx = ctx
        self.sites: list[list[Any]] = []  # per layer, the slot bank of each projection (None: no LoRA there)
        lws = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            lw: dict[str, Any] = {
                "in_norm": layer.input_layernorm.weight,
                "post_norm": layer.post_attention_layernorm.weight,
            }
            banks = []
            for name in PROJECTIONS:
                proj = getattr(attn if name in PROJECTIONS[:4] else mlp, name)
                lin = _linear(proj)
                lw[name] = (lin.weight, lin.bias)
                banks.append(getattr(proj, "bank", None))
            lws.append(lw)
            self.sites.append(banks)
        rotary = inner.rotary_emb
        step = _make_step(
            int(cfg.num_attention_heads),
            int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
            head_dim,
            float(cfg.rms_norm_eps),
            float(getattr(attn0, "scaling", head_dim**-0.5)),
            float(getattr(rotary, "attention_scaling", 1.0)),
        )
        self.weights: dict[str, Any] = {
            "embed": inner.embed_tokens.weight,
            "inv_freq": rotary.inv_freq.float(),
            "layers": lws,
            "norm": inner.norm.weight,
            "head": (head.weight, head.bias),
        }
        self._fn = torch.compile(step, dynamic=None)
        self._key: object = None
        self._plan: tuple[LoRAMode, list[list[Factors]]] = ("none", [])
        self.compiles = 0  # the first call at each composition kind compiles
        self._seen: set[LoRAMode] = set()

    def _factors(self) -> tuple[LoRAMode, list[list[Factors]]]:
        """The LoRA of the batch the context routes: its mode and each site's factors (kept per composition)."""
        ctx = self.ctx
        if ctx._key is not None and ctx._key == self._key:
            return self._plan
        rows = ctx.rows
        assert rows is not None
        runs = ctx.runs
        mode: LoRAMode
        if not ctx.any_lora:
            mode = "none"
        elif runs is not None and len(runs) == 1 and runs[0][1] - runs[0][0] == rows.numel():
            mode = "shared"
        else:
            mode = "rows"
        plan: list[list[Factors]] = []
        for banks in self.sites:
            fs: list[Factors] = []
            for bank in banks:
                if bank is None or bank.filled == 0 or mode == "none":
                    fs.append(None)
                elif mode == "shared":
                    assert runs is not None
                    fs.append(ctx.slot_factors(bank, runs[0][2]))
                else:
                    fs.append((bank.A.index_select(0, rows).transpose(1, 2), bank.B.index_select(0, rows)))
            plan.append(fs)
        if all(f is None for fs in plan for f in fs):
            mode = "none"
        self._key, self._plan = ctx._key, (mode, plan)
        return self._plan

    def __call__(
        self, tokens: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: RaggedCache
    ) -> torch.Tensor:
        """Logits [B, V] (float32) of one decode step over `cache`, which gains the step's keys and values.
        The LoRA context must already route the batch's rows."""
        layers = cache._ragged()
        length = layers[0].length
        if mask.shape[-1] != length + 1:
            raise ValueError(f"decode mask of {mask.shape[-1]} columns over a cache of {length}")
        for layer in layers:
            if length + 1 > layer._k.shape[2]:
                layer._grow(length + 1)
        mode, plan = self._factors()
        keys, values = [layer._k for layer in layers], [layer._v for layer in layers]
        # dynamic where a decode's shapes move (rows, cache columns and capacity), static everywhere else: one
        # graph for every step of every batch, and the weights' shapes are constants of it
        for t in (tokens, pos):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(mask, 0)
        torch._dynamo.mark_dynamic(mask, 3)
        for t in (*keys, *values):
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 2)
        if mode == "rows":
            for fs in plan:
                for f in fs:
                    if f is not None:
                        torch._dynamo.mark_dynamic(f[0], 0)
                        torch._dynamo.mark_dynamic(f[1], 0)
        first = mode not in self._seen
        if first:
            logger.info(
                "compiling the decode step (%s LoRA): once a process and kind, seconds to a minute", mode
            )
        t0 = time.perf_counter()
        # no duck sizing: a batch of as many rows as a head has dimensions would tie the two sizes, and the next
        # batch of another size would compile again
        with torch.fx.experimental._config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            logits = self._fn(
                self.weights,
                tokens,
                pos,
                mask,
                keys,
                values,
                mode,
                plan,
            )
        if first:
            self._seen.add(mode)
            self.compiles += 1
            logger.info("compiled decode step (%s LoRA) in %.1f s", mode, time.perf_counter() - t0)
        for layer in layers:
            layer.length = length + 1
            layer._views()
        return logits  # type: ignore[no-any-return]
