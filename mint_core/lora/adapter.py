"""Adapter revisions in PEFT's file layout: read, write, digest, and MoE expert packing.

On disk a revision is PEFT's own pair of files, so PEFT, vLLM and lm-eval load it unchanged:
`adapter_config.json` and `adapter_model.safetensors` with keys `base_model.model.<module>.lora_{A,B}.weight`.
mint adds its base fingerprint to the safetensors header metadata (`mint.base_fingerprint`).

MoE experts (fused 3D parameters in transformers 5) come in two layouts:
- packed: PEFT's `target_parameters` layout, one tensor pair per layer and parameter holding all experts:
  A [E*r, in] (row e*r + i), B [out, r*E] (column i*E + e); several targeted parameters of one module nest,
  the parameter declared last outermost, each one further in adding `.base_layer` to its key.
- unpacked: one pair per expert and projection, `<experts>.<e>.{gate_proj,up_proj,down_proj}` (vLLM's per-expert
  layout); gate and up split the fused gate_up_proj and share its A.
In memory a site holds A [r, in] / B [out, r] for a linear and A [E, r, in] / B [E, out, r] for experts.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save as save_safetensors

from mint_core.types import CONFIG_FILE, EXPERT_PARAMS, WEIGHTS_FILE, Digest, Site

PREFIX = "base_model.model."
FINGERPRINT_KEY = "mint.base_fingerprint"
DTYPE_KEY = "torch_dtype"
"""adapter_config.json key that may name the dtype of a revision's tensors (as config.json does for a transformers
model); checked against the tensors when present. mint does not write it: each tensor's dtype is in the
safetensors header already, and PEFT 0.21 warns on every load of a config with a key it does not know, telling
the user to upgrade PEFT."""
DTYPE_NAMES = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
Layout = Literal["packed", "unpacked"]

_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+?)(?P<nest>(?:\.base_layer)*)\.lora_(?P<ab>[AB])\.weight$"
)
_UNPACKED = re.compile(r"^(?P<experts>.+)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # the only modules _UNPACKED can match

SiteTensors = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AdapterWeights:
    """One adapter revision in memory: LoRA factors per site plus the config that scales them."""

    rank: int
    alpha: float
    tensors: SiteTensors
    base_fingerprint: str | None = None
    base_name: str | None = None
    use_rslora: bool = False
    digest: Digest | None = None
    extra_config: dict[str, object] = field(default_factory=dict)
    dtype: torch.dtype | None = None
    """The dtype its files are written in: the base's, for a revision made over a base (a trainer's export casts
    its factors to it, so files and every copy of them are as small as the base's precision allows); None writes
    each tensor in its own dtype."""
    prepared: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = field(
        default=None, compare=False, repr=False
    )
    """Its tensors already in an engine's slot layout (`LoRAModel.prepare`), when the read made them while the
    digest was still being hashed; the working set then keeps these instead of preparing again."""
    load_s: dict[str, float] = field(default_factory=dict, compare=False)
    """Seconds its read from files spent per step (`read`, `validate`, `digest`); empty for weights made in
    memory. For profiles and the load benchmark."""

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values()
        )


def digest_files(config_bytes: bytes, weights_bytes: bytes | bytearray | memoryview) -> Digest:
    """sha256 of a revision: both files' names and bytes in a fixed order (`Digest.of_files`)."""
    return Digest.of_files(config_bytes, weights_bytes)


def digest_dir(path: str | Path) -> Digest:
    path = Path(path)
    return digest_files((path / CONFIG_FILE).read_bytes(), (path / WEIGHTS_FILE).read_bytes())


# ---- site tensors <-> PEFT state dict -------------------------------------------------------------------


def _expert_params_of(module_path: str, sites: dict[str, Site]) -> list[str]:
    """Expert parameters of one module in declaration order (the order PEFT nests its wrappers in)."""
    return [p for p in EXPERT_PARAMS if f"{module_path}.{p}" in sites]


def to_peft_state(
    tensors: SiteTensors, sites: dict[str, Site], layout: Layout = "packed"
) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor for the given site tensors."""
    state: dict[str, torch.Tensor] = {}
    for name, (A, B) in tensors.items():
        site = sites[name]
        if not site.experts:
            state[f"{PREFIX}{name}.lora_A.weight"] = A.contiguous()
            state[f"{PREFIX}{name}.lora_B.weight"] = B.contiguous()
            continue
        E, r = A.shape[0], A.shape[1]
        module = site.module_path
        if layout == "packed":
            targeted = [p for p in _expert_params_of(module, sites) if f"{module}.{p}" in tensors]
            nest = ".base_layer" * (len(targeted) - 1 - targeted.index(site.short))
            state[f"{PREFIX}{module}{nest}.lora_A.weight"] = A.reshape(E * r, -1).contiguous()
            state[f"{PREFIX}{module}{nest}.lora_B.weight"] = (
                B.permute(1, 2, 0).reshape(B.shape[1], r * E).contiguous()
            )
        elif site.short == "gate_up_proj":
            half = B.shape[1] // 2
            for e in range(E):
                for proj, Bp in (("gate_proj", B[e, :half]), ("up_proj", B[e, half:])):
                    # a copy each: gate and up share A, and safetensors refuses two keys on one storage
                    state[f"{PREFIX}{module}.{e}.{proj}.lora_A.weight"] = A[e].clone()
                    state[f"{PREFIX}{module}.{e}.{proj}.lora_B.weight"] = Bp.contiguous()
        else:
            for e in range(E):
                state[f"{PREFIX}{module}.{e}.down_proj.lora_A.weight"] = A[e].contiguous()
                state[f"{PREFIX}{module}.{e}.down_proj.lora_B.weight"] = B[e].contiguous()
    return state


def from_peft_state(
    state: dict[str, torch.Tensor],
    sites: dict[str, Site],
    rank: int,
    problems: list[str],
    base_modules: Collection[str] = (),
) -> SiteTensors:
    """Site tensors from a PEFT state dict in either expert layout; appends what is wrong to `problems`."""
    pairs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    unpacked: dict[str, dict[int, dict[str, dict[str, torch.Tensor]]]] = {}
    for key, t in state.items():
        m = _KEY.match(key)
        if not m:
            problems.append(
                f"tensor {key!r} is not a PEFT LoRA key (base_model.model.<module>.lora_A|B.weight)"
            )
            continue
        module, depth, ab = m["module"], m["nest"].count(".base_layer"), m["ab"]
        u = _UNPACKED.match(module) if module.endswith(_EXPERT_PROJS) else None
        if u and depth == 0 and f"{u['experts']}.gate_up_proj" in sites:
            proj = unpacked.setdefault(u["experts"], {}).setdefault(int(u["e"]), {}).setdefault(u["proj"], {})
            proj[ab] = t
        else:
            pairs.setdefault((module, depth), {})[ab] = t

    out: SiteTensors = {}
    # Linear sites, and packed expert parameters: which parameter a nesting depth means depends on how many
    # of the module's expert parameters this adapter targets, so count them first.
    depth_count: dict[str, int] = {}
    for module, depth in pairs:
        depth_count[module] = max(depth_count.get(module, 0), depth + 1)
    for (module, depth), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            problems.append(f"module {module}: lora_{'B' if 'A' in ab else 'A'} is missing")
            continue
        A, B = ab["A"], ab["B"]
        if module in sites and depth == 0:
            site = sites[module]
            if (
                A.dim() != 2
                or B.dim() != 2
                or A.shape != (rank, site.in_features)
                or B.shape != (site.out_features, rank)
            ):
                problems.append(
                    f"module {module}: shapes A{tuple(A.shape)} B{tuple(B.shape)}, base needs "
                    f"A({rank}, {site.in_features}) B({site.out_features}, {rank}) for rank {rank}"
                )
                continue
            out[module] = (A, B)
            continue
        params = _expert_params_of(module, sites)
        if not params:
            problems.append(_missing(module, base_modules))
            continue
        count = depth_count[module]
        if count > len(params):
            problems.append(f"module {module}: nesting depth {depth} but the module has only {params}")
            continue
        # The adapter's targeted params are ordered as declared; guess which by shape when fewer than all.
        candidates = [
            p for p in params if sites[f"{module}.{p}"].in_features == (A.shape[-1] if A.dim() == 2 else -1)
        ]
        name = (
            f"{module}.{params[count - 1 - depth]}"
            if count == len(params)
            else (f"{module}.{candidates[0]}" if len(candidates) == 1 else None)
        )
        if name is None:
            problems.append(
                f"module {module}: cannot tell which expert parameter tensors at depth {depth} belong to"
            )
            continue
        site = sites[name]
        E = site.experts
        if (
            A.dim() != 2
            or B.dim() != 2
            or A.shape != (E * rank, site.in_features)
            or B.shape != (site.out_features, rank * E)
        ):
            problems.append(
                f"expert parameter {name}: shapes A{tuple(A.shape)} B{tuple(B.shape)}, base needs "
                f"A({E * rank}, {site.in_features}) B({site.out_features}, {rank * E}) for rank {rank} x {E} experts"
            )
            continue
        out[name] = (A.reshape(E, rank, -1), B.reshape(B.shape[0], rank, E).permute(2, 0, 1))

    for module, experts in unpacked.items():
        _pack_unpacked(module, experts, sites, rank, out, problems)
    return out


def _missing(module: str, base_modules: Collection[str]) -> str:
    if module in base_modules:
        return f"target module {module} exists in the base but is not a LoRA site of this engine (see target_modules)"
    return f"target module {module} does not exist in the base"


def _pack_unpacked(
    module: str,
    experts: dict[int, dict[str, dict[str, torch.Tensor]]],
    sites: dict[str, Site],
    rank: int,
    out: SiteTensors,
    problems: list[str],
) -> None:
    gu, down = sites[f"{module}.gate_up_proj"], sites.get(f"{module}.down_proj")
    E = gu.experts
    if sorted(experts) != list(range(E)):
        problems.append(
            f"experts {module}: unpacked tensors for experts {sorted(experts)}, base has 0..{E - 1}"
        )
        return
    projs = set(experts[0])
    if any(set(experts[e]) != projs for e in experts) or any(
        set(ab) != {"A", "B"} for p in experts.values() for ab in p.values()
    ):
        problems.append(f"experts {module}: every expert needs lora_A and lora_B for the same projections")
        return
    if ("gate_proj" in projs) != ("up_proj" in projs):
        problems.append(
            f"experts {module}: gate_proj and up_proj must both be present (transformers fuses them)"
        )
        return
    half = gu.out_features // 2
    if "gate_proj" in projs:
        As, Bs = [], []
        for e in range(E):
            g, u = experts[e]["gate_proj"], experts[e]["up_proj"]
            if not torch.equal(g["A"], u["A"]):
                problems.append(
                    f"experts {module}.{e}: gate_proj and up_proj have different lora_A; the packed layout shares "
                    "one A across the fused gate_up_proj, so this adapter cannot be packed without loss"
                )
                return
            if (
                g["A"].shape != (rank, gu.in_features)
                or g["B"].shape != (half, rank)
                or u["B"].shape != (half, rank)
            ):
                problems.append(f"experts {module}.{e}: gate/up shapes do not match the base at rank {rank}")
                return
            As.append(g["A"])
            Bs.append(torch.cat([g["B"], u["B"]], dim=0))
        out[gu.name] = (torch.stack(As), torch.stack(Bs))
    if "down_proj" in projs and down is None:
        # the packed layout reports this too; serving the adapter without its down_proj would be silently wrong
        problems.append(f"target module {module}.down_proj is not a LoRA site of this engine")
        return
    if "down_proj" in projs and down is not None:
        d = [experts[e]["down_proj"] for e in range(E)]
        if any(
            x["A"].shape != (rank, down.in_features) or x["B"].shape != (down.out_features, rank) for x in d
        ):
            problems.append(f"experts {module}: down_proj shapes do not match the base at rank {rank}")
            return
        out[down.name] = (torch.stack([x["A"] for x in d]), torch.stack([x["B"] for x in d]))


# ---- config ------------------------------------------------------------------------------------------------


def peft_config(
    adapter: AdapterWeights, sites: dict[str, Site], layout: Layout = "packed"
) -> dict[str, object]:
    """PEFT's adapter_config.json for these tensors (keys PEFT, vLLM and lm-eval read)."""
    modules: set[str] = set()
    params: set[str] = set()
    for name in adapter.tensors:
        site = sites[name]
        if not site.experts:
            modules.add(site.short)
        elif layout == "packed":
            # matched by PEFT as a suffix of "<module path>.<param>": "mlp.experts.gate_up_proj"
            params.add(re.sub(r"^.*?\.layers\.\d+\.", "", site.name))
        else:
            modules.update({"gate_proj", "up_proj"} if site.short == "gate_up_proj" else {"down_proj"})
    cfg: dict[str, object] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "use_rslora": adapter.use_rslora,
        "target_modules": sorted(modules),
        "base_model_name_or_path": adapter.base_name,
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    if params:
        cfg["target_parameters"] = sorted(params)
    return cfg


def save_adapter(
    adapter: AdapterWeights, path: str | Path, sites: dict[str, Site], layout: Layout = "packed"
) -> Digest:
    """Write PEFT's two files into `path` (created); returns the revision's digest.

    Writes into a temporary sibling directory and renames it into place, so a crash leaves no half revision.
    """
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"refusing to overwrite non-empty adapter directory {path}")
    config_bytes, weights_bytes = adapter_bytes(adapter, sites, layout)
    tmp = path.with_name(f".{path.name}.tmp-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / WEIGHTS_FILE).write_bytes(weights_bytes)
    (tmp / CONFIG_FILE).write_bytes(config_bytes)
    if path.exists():
        path.rmdir()
    tmp.rename(path)
    adapter.digest = digest_files(config_bytes, weights_bytes)
    return adapter.digest


def adapter_bytes(
    adapter: AdapterWeights, sites: dict[str, Site], layout: Layout = "packed"
) -> tuple[bytes, bytes]:
    """PEFT's two files as bytes: (adapter_config.json, adapter_model.safetensors), the tensors in
    `adapter.dtype` (when set; the safetensors header names it). The same weights always give the same bytes, so
    the same digest."""
    state = {
        k: v.detach().to("cpu", adapter.dtype).contiguous()
        for k, v in to_peft_state(adapter.tensors, sites, layout).items()
    }
    meta = {"format": "pt"}
    if adapter.base_fingerprint:
        meta[FINGERPRINT_KEY] = adapter.base_fingerprint
    data = save_safetensors(state, metadata=meta)
    # safetensors writes the metadata map in hash order, different on every save; sort it so the same weights
    # always give the same bytes, and so the same digest
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    weights_bytes = len(raw).to_bytes(8, "little") + raw + data[8 + n :]
    config = peft_config(adapter, sites, layout)
    config_bytes = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    return config_bytes, weights_bytes


def initial_adapter(
    sites: dict[str, Site],
    targets: list[str],
    rank: int,
    alpha: float,
    generator: torch.Generator,
    base_fingerprint: str | None = None,
) -> AdapterWeights:
    """PEFT's default init, a training run's step 0: A kaiming-uniform (a=sqrt(5)), B zero, so the adapter
    answers exactly as the base until its first update."""
    tensors: SiteTensors = {}
    for name, site in sites.items():
        if site.short not in targets:
            continue
        lead = (site.experts,) if site.experts else ()
        bound = 1.0 / math.sqrt(site.in_features)
        A = (torch.rand(*lead, rank, site.in_features, generator=generator) * 2 - 1) * bound
        tensors[name] = (A, torch.zeros(*lead, site.out_features, rank))
    return AdapterWeights(rank, alpha, tensors, base_fingerprint)


def random_adapter(
    sites: dict[str, Site],
    targets: list[str],
    rank: int,
    alpha: float | None = None,
    seed: int = 0,
    std: float = 0.05,
    base_fingerprint: str | None = None,
) -> AdapterWeights:
    """An adapter with random A and B (nonzero B, unlike a fresh PEFT init) on every site whose short name is in
    `targets`; for tests, demos and benchmarks."""
    g = torch.Generator().manual_seed(seed)
    tensors: SiteTensors = {}
    for name, site in sites.items():
        if site.short not in targets:
            continue
        lead = (site.experts,) if site.experts else ()
        A = torch.randn(*lead, rank, site.in_features, generator=g) * std
        B = torch.randn(*lead, site.out_features, rank, generator=g) * std
        tensors[name] = (A, B)
    if not tensors:
        raise ValueError(f"none of {targets} names a site of this base")
    return AdapterWeights(rank, float(alpha if alpha is not None else 2 * rank), tensors, base_fingerprint)
