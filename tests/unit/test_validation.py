"""Every way an adapter directory can be wrong is refused by Engine.load_adapter with one AdapterError that names
the adapter, the path and each problem, before any engine state changes and without ever unpickling."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mint_core.errors import AdapterError
from mint_core.lora.adapter import (
    CONFIG_FILE,
    FINGERPRINT_KEY,
    WEIGHTS_FILE,
    digest_dir,
    random_adapter,
    save_adapter,
)
from tests.conftest import TARGETS

RANK = 4
MAX_RANK = 16
MARKER = "pwned"
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
K1 = "base_model.model.model.layers.1.self_attn.k_proj"


# ---- a live pickle payload: unpickling it creates a file ---------------------------------------------------


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def _payload(marker: Path) -> bytes:
    return pickle.dumps(_Payload(marker))


def test_pickle_payload_is_live(tmp_path):
    # the refusal tests below mean something only if unpickling this payload really runs code
    pickle.loads(_payload(tmp_path / MARKER))
    assert (tmp_path / MARKER).exists()


# ---- editing a saved adapter ---------------------------------------------------------------------------------


def _edit_weights(
    d: Path, edit: Callable[[dict[str, torch.Tensor]], None], metadata: dict | None = None
) -> None:
    """Rewrite the safetensors with `edit` applied to the state (and `metadata` merged into the header)."""
    with safe_open(str(d / WEIGHTS_FILE), "pt") as f:
        meta = dict(f.metadata() or {})
    state = {k: v.clone() for k, v in load_file(str(d / WEIGHTS_FILE)).items()}
    edit(state)
    save_file(state, str(d / WEIGHTS_FILE), metadata={**meta, **(metadata or {})})


def _edit_header(d: Path, edit: Callable[[dict], None]) -> None:
    data = (d / WEIGHTS_FILE).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    (d / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def _edit_config(d: Path, **changes: object) -> None:
    config = json.loads((d / CONFIG_FILE).read_text())
    config.update(changes)
    (d / CONFIG_FILE).write_text(json.dumps(config))


def _set(key: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[key][0, 0] = value

    return edit


# Each change takes the valid adapter directory (inside the engine's allowed root) and tmp_path, corrupts
# something, and returns the path to load.


def _pickle_weights_only(d: Path, tmp: Path) -> Path:
    (d / WEIGHTS_FILE).unlink()
    (d / "adapter_model.bin").write_bytes(_payload(tmp / MARKER))
    return d


def _pt_file(d: Path, tmp: Path) -> Path:
    (d / "adapter.pt").write_bytes(_payload(tmp / MARKER))
    return d / "adapter.pt"


def _truncate(d: Path, tmp: Path) -> Path:
    data = (d / WEIGHTS_FILE).read_bytes()
    (d / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    return d


def _garbage_header(d: Path, tmp: Path) -> Path:
    # a plausible length, then noise where the JSON header should be
    data = (d / WEIGHTS_FILE).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    (d / WEIGHTS_FILE).write_bytes(data[:8] + random.Random(0).randbytes(n) + data[8 + n :])
    return d


def _garbage_file(d: Path, tmp: Path) -> Path:
    (d / WEIGHTS_FILE).write_bytes(random.Random(0).randbytes(4096))
    return d


def _header_longer_than_file(d: Path, tmp: Path) -> Path:
    data = (d / WEIGHTS_FILE).read_bytes()
    (d / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(data)) + data[8:])
    return d


def _offsets_not_integers(d: Path, tmp: Path) -> Path:
    def edit(header: dict) -> None:
        header[f"{Q0}.lora_A.weight"]["data_offsets"] = [None, None]

    _edit_header(d, edit)
    return d


def _metadata_not_strings(d: Path, tmp: Path) -> Path:
    def edit(header: dict) -> None:
        header["__metadata__"][FINGERPRINT_KEY] = 5

    _edit_header(d, edit)
    return d


def _nan(d: Path, tmp: Path) -> Path:
    _edit_weights(d, _set(f"{Q0}.lora_A.weight", float("nan")))
    return d


def _inf(d: Path, tmp: Path) -> Path:
    _edit_weights(d, _set(f"{K1}.lora_B.weight", float("inf")))
    return d


def _wrong_in_features(d: Path, tmp: Path) -> Path:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[f"{Q0}.lora_A.weight"] = state[f"{Q0}.lora_A.weight"][:, :-1].contiguous()

    _edit_weights(d, edit)
    return d


def _rank_32(d: Path, tmp: Path) -> Path:
    # config and every tensor agree on r=32, so the only problem is the engine's max rank
    def edit(state: dict[str, torch.Tensor]) -> None:
        for k, t in state.items():
            state[k] = torch.randn(32, t.shape[1]) if ".lora_A." in k else torch.randn(t.shape[0], 32)

    _edit_weights(d, edit)
    _edit_config(d, r=32, lora_alpha=64)
    return d


def _target_not_in_base(d: Path, tmp: Path) -> Path:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state["base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"] = torch.zeros(RANK, 64)
        state["base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight"] = torch.zeros(64, RANK)

    _edit_weights(d, edit)
    return d


def _other_base(d: Path, tmp: Path) -> Path:
    _edit_weights(d, lambda state: None, {FINGERPRINT_KEY: hashlib.sha256(b"another base").hexdigest()})
    return d


def _outside_root(d: Path, tmp: Path) -> Path:
    return d.rename(tmp / "outside" / d.name)


def _dotdot_escape(d: Path, tmp: Path) -> Path:
    d.rename(tmp / "outside" / d.name)
    return d.parent / ".." / "outside" / d.name


def _symlinked_dir(d: Path, tmp: Path) -> Path:
    target = d.rename(tmp / "outside" / d.name)
    link = d.parent / "link"
    link.symlink_to(target, target_is_directory=True)
    return link


def _symlinked_weights(d: Path, tmp: Path) -> Path:
    target = (d / WEIGHTS_FILE).rename(tmp / "outside" / WEIGHTS_FILE)
    (d / WEIGHTS_FILE).symlink_to(target)
    return d


def _no_config(d: Path, tmp: Path) -> Path:
    (d / CONFIG_FILE).unlink()
    return d


def _config_not_json(d: Path, tmp: Path) -> Path:
    (d / CONFIG_FILE).write_text('{"peft_type": "LORA", "r": 4,')
    return d


def _config_empty_object(d: Path, tmp: Path) -> Path:
    (d / CONFIG_FILE).write_text("{}")
    return d


def _not_lora(d: Path, tmp: Path) -> Path:
    _edit_config(d, peft_type="IA3")
    return d


def _dora(d: Path, tmp: Path) -> Path:
    _edit_config(d, use_dora=True)
    return d


def _no_lora_b(d: Path, tmp: Path) -> Path:
    _edit_weights(d, lambda state: state.pop(f"{Q0}.lora_B.weight"))
    return d


def _overlapping_tensors(d: Path, tmp: Path) -> Path:
    # two keys on one byte range: every offset inside the file, but not a valid safetensors file
    def edit(header: dict) -> None:
        header[f"{K1}.lora_A.weight"]["data_offsets"] = header[f"{Q0}.lora_A.weight"]["data_offsets"]

    _edit_header(d, edit)
    return d


def _nan_among_dtypes(d: Path, tmp: Path) -> Path:
    # tensors of several dtypes (finiteness is checked per run of one dtype): the bad one is still named
    def edit(state: dict[str, torch.Tensor]) -> None:
        for k in list(state)[::3]:
            state[k] = state[k].to(torch.bfloat16)
        state[f"{K1}.lora_B.weight"] = state[f"{K1}.lora_B.weight"].to(torch.float16)
        state[f"{K1}.lora_B.weight"][1, 2] = float("nan")

    _edit_weights(d, edit)
    return d


def _dtype_not_the_tensors(d: Path, tmp: Path) -> Path:
    _edit_config(d, torch_dtype="bfloat16")  # the tensors are float32
    return d


def _dtype_unknown(d: Path, tmp: Path) -> Path:
    _edit_config(d, torch_dtype="int8")
    return d


def _no_tensors(d: Path, tmp: Path) -> Path:
    save_file({}, str(d / WEIGHTS_FILE))
    return d


CASES = [
    ("pickle weights only", _pickle_weights_only, "weights only in pickle format ['adapter_model.bin']"),
    ("direct path to a .pt", _pt_file, "adapter.pt is a pickle-based checkpoint; refused without loading"),
    ("truncated safetensors", _truncate, f"{WEIGHTS_FILE} is truncated"),
    ("garbage header", _garbage_header, "header is not valid JSON"),
    ("garbage file", _garbage_file, "exceeds the file (4096 bytes)"),
    ("header length past the file", _header_longer_than_file, "exceeds the file"),
    (
        "header offsets not integers",
        _offsets_not_integers,
        f"tensor '{Q0}.lora_A.weight': malformed header entry",
    ),
    ("header metadata not strings", _metadata_not_strings, "__metadata__ is not an object of strings"),
    ("NaN", _nan, f"tensor '{Q0}.lora_A.weight' has 1 non-finite value(s)"),
    ("inf", _inf, f"tensor '{K1}.lora_B.weight' has 1 non-finite value(s)"),
    ("wrong in_features", _wrong_in_features, "shapes A(4, 63) B(64, 4), base needs A(4, 64) B(64, 4)"),
    ("rank above engine max", _rank_32, f"rank 32 is above the engine's max rank {MAX_RANK}"),
    (
        "target not in base",
        _target_not_in_base,
        "target module model.layers.9.self_attn.q_proj does not exist",
    ),
    ("base fingerprint mismatch", _other_base, "made for base"),
    ("outside allowed roots", _outside_root, "path is outside the allowed roots"),
    (".. escape from root", _dotdot_escape, "path is outside the allowed roots"),
    ("symlinked dir escapes root", _symlinked_dir, "path is outside the allowed roots"),
    (
        "symlinked weights escape root",
        _symlinked_weights,
        f"{WEIGHTS_FILE} resolves outside the allowed roots",
    ),
    ("config missing", _no_config, f"{CONFIG_FILE} is missing"),
    ("config not JSON", _config_not_json, f"{CONFIG_FILE} is not valid JSON"),
    ("config empty object", _config_empty_object, "peft_type is None, expected 'LORA'"),
    ("peft_type not LORA", _not_lora, "peft_type is 'IA3', expected 'LORA'"),
    ("DoRA", _dora, "DoRA is not supported"),
    ("lora_B missing", _no_lora_b, "module model.layers.0.self_attn.q_proj: lora_B is missing"),
    ("no tensors", _no_tensors, "no LoRA tensors found"),
    (
        "tensors overlap",
        _overlapping_tensors,
        "(tensors overlap or leave a gap): not a valid safetensors file",
    ),
    ("NaN among dtypes", _nan_among_dtypes, f"tensor '{K1}.lora_B.weight' has 1 non-finite value(s)"),
    (
        "torch_dtype not the tensors'",
        _dtype_not_the_tensors,
        "names torch_dtype 'bfloat16', but the tensors are",
    ),
    ("torch_dtype unknown", _dtype_unknown, "torch_dtype is 'int8', expected one of"),
]


@pytest.fixture
def rooted(make_engine, tmp_path):  # type: ignore[no-untyped-def]
    """An engine that loads only from tmp_path/root, and a valid adapter saved at tmp_path/root/adapter."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    engine = make_engine("dense", max_lora_rank=MAX_RANK, allowed_roots=[root])
    a = random_adapter(engine.sites, TARGETS["dense"], RANK, seed=1, base_fingerprint=engine.base.fingerprint)
    save_adapter(a, root / "adapter", engine.sites)
    return engine, root / "adapter"


def test_untouched_adapter_loads(rooted):
    # the baseline every case below corrupts: without the corruption it loads
    engine, path = rooted
    assert engine.load_adapter("ok", path)
    assert engine.working_set.digest_of("ok") == digest_dir(path)


@pytest.mark.parametrize(("case", "change", "expected"), CASES, ids=[c[0] for c in CASES])
def test_corruption_is_refused(case, change, expected, rooted, tmp_path):
    engine, adapter = rooted
    path = change(adapter, tmp_path)
    with pytest.raises(AdapterError) as info:
        engine.load_adapter("bad", path)
    err = info.value
    assert err.adapter == "bad" and err.path == str(path)
    assert "'bad'" in str(err) and str(path) in str(err)
    assert any(expected in p for p in err.problems), err.problems
    assert expected in str(err)
    assert not (tmp_path / MARKER).exists(), "a pickle was unpickled"
    assert engine.working_set.names() == {}


def test_every_problem_is_reported_in_one_error(rooted, tmp_path):
    # fixing problems one load attempt at a time is slow; all of them come back at once
    engine, adapter = rooted
    _dora(adapter, tmp_path)
    _nan(adapter, tmp_path)
    _target_not_in_base(adapter, tmp_path)
    with pytest.raises(AdapterError) as info:
        engine.load_adapter("bad", adapter)
    expected = ["DoRA is not supported", "non-finite", "model.layers.9.self_attn.q_proj does not exist"]
    problems = info.value.problems
    assert len(problems) == 3, problems
    for want in expected:
        assert sum(want in p for p in problems) == 1, (want, problems)
        assert want in str(info.value)


FAILING = [("NaN", _nan), ("target not in base", _target_not_in_base)]


@pytest.mark.parametrize(("case", "change"), FAILING, ids=[c[0] for c in FAILING])
def test_failed_load_changes_nothing(case, change, make_engine, adapter_dir, tmp_path):
    engine = make_engine("dense", max_lora_rank=MAX_RANK)
    fp = engine.base.fingerprint
    good = adapter_dir / "good"
    old = save_adapter(
        random_adapter(engine.sites, TARGETS["dense"], RANK, seed=1, base_fingerprint=fp), good, engine.sites
    )
    engine.load_adapter("a", good)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    served = engine.logits(ids, ["a"])  # puts "a" in a device slot

    newer = random_adapter(engine.sites, TARGETS["dense"], RANK, seed=2, base_fingerprint=fp)
    save_adapter(newer, adapter_dir / "newer", engine.sites)
    save_adapter(newer, adapter_dir / "broken", engine.sites)
    change(adapter_dir / "broken", tmp_path)

    ws = engine.working_set
    before = (ws.names(), ws.slot_table(), ws.host_size())
    for name, replace in (("a", True), ("b", False)):
        with pytest.raises(AdapterError):
            engine.load_adapter(name, adapter_dir / "broken", replace=replace)
        assert (ws.names(), ws.slot_table(), ws.host_size()) == before
    assert ws.digest_of("a") == old
    assert torch.equal(engine.logits(ids, ["a"]), served)

    # the same revision uncorrupted does replace "a": the checks above could see a change
    assert engine.load_adapter("a", adapter_dir / "newer", replace=True)
    assert ws.digest_of("a") != old
    assert not torch.allclose(engine.logits(ids, ["a"]), served)


def test_symlink_inside_root_to_inside_root_is_allowed(rooted):
    # the roots check resolves links; one that stays inside the root is fine
    engine, adapter = rooted
    link = adapter.parent / "link"
    link.symlink_to(adapter, target_is_directory=True)
    assert engine.load_adapter("linked", link)
