"""mint's CPU LoRA ops for vLLM (vllm_plugin/mint_vllm_lora_cpu.py): one product per adapter slot in the batch.

The ops are checked here against a row-by-row reference (each row times its own slot's weights), and, in vLLM's
own environment, against vLLM's native ops on every row that has a slot and through the install that vLLM's plugin
loader runs (`register`)."""

from __future__ import annotations

import importlib.util
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from mint_core.serving.vllm_process import vllm_available
from mint_testkit.harness import VLLM_PYTHON
from mint_testkit.skips import require

PLUGIN = Path(__file__).resolve().parents[2] / "vllm_plugin"
SPEC = importlib.util.spec_from_file_location("mint_vllm_lora_cpu", PLUGIN / "mint_vllm_lora_cpu.py")
assert SPEC is not None and SPEC.loader is not None
ops = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ops)

SLOTS, RANK, HIDDEN, OUT = 4, 8, 64, 96
INDICES = {
    "one slot for every row": [2, 2, 2, 2, 2, 2, 2],
    "mixed slots": [0, 1, 1, 3, 0, 2, 2],
    "no slot anywhere": [-1, -1, -1, -1, -1],
    "slots and rows without one": [1, -1, 1, -1, 2],
    "one row": [3],
}


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SLOTS, 1, RANK, HIDDEN, generator=g), torch.randn(SLOTS, 1, OUT, RANK, generator=g)


def by_row(x: torch.Tensor, w: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """Each row times its own slot's weights ([slots, 1, out, in]); zero for a row without a slot."""
    rows = [x[i] @ w[s, 0].t() if s >= 0 else torch.zeros(w.shape[2]) for i, s in enumerate(indices)]
    return torch.stack(rows)


@pytest.mark.parametrize("indices", list(INDICES.values()), ids=list(INDICES))
def test_shrink_is_each_rows_product_with_its_slot_scaled(indices: list[int]) -> None:
    a, _ = weights()
    x = torch.randn(len(indices), HIDDEN)
    out = torch.full((len(indices), RANK + 3), 7.0)  # wider than the rank: the columns past it stay
    ops.bgmv_shrink(x, a, out, torch.tensor(indices), 0.5)
    torch.testing.assert_close(out[:, :RANK], 0.5 * by_row(x, a, indices))
    assert (out[:, RANK:] == 7.0).all()


@pytest.mark.parametrize("indices", list(INDICES.values()), ids=list(INDICES))
@pytest.mark.parametrize("add", [True, False], ids=["added", "written"])
def test_expand_slice_touches_only_its_columns(indices: list[int], add: bool) -> None:
    _, b = weights()
    x = torch.randn(len(indices), RANK)
    before = torch.randn(len(indices), 3 * OUT)
    out = before.clone()
    ops.bgmv_expand_slice(x, b, out, torch.tensor(indices), OUT, OUT, add)
    delta = by_row(x, b, indices)
    torch.testing.assert_close(out[:, OUT : 2 * OUT], before[:, OUT : 2 * OUT] + delta if add else delta)
    assert torch.equal(out[:, :OUT], before[:, :OUT]) and torch.equal(out[:, 2 * OUT :], before[:, 2 * OUT :])


def test_expand_into_a_narrower_output_keeps_its_common_columns() -> None:
    _, b = weights()
    indices = INDICES["mixed slots"]
    x = torch.randn(len(indices), RANK)
    before = torch.randn(len(indices), OUT - 10)
    out = before.clone()
    ops.bgmv_expand(x, b, out, torch.tensor(indices), True)
    torch.testing.assert_close(out, before + by_row(x, b, indices)[:, : OUT - 10])


def test_a_prefill_gives_each_sequence_its_slot() -> None:
    a, b = weights()
    seq_lens, slots = torch.tensor([3, 2, 4]), torch.tensor([1, -1, 3])
    per_token = [1] * 3 + [-1] * 2 + [3] * 4
    x = torch.randn(9, HIDDEN)
    buf = torch.zeros(9, RANK)
    ops.sgmv_shrink(x, a, buf, None, seq_lens, slots, 3, 4, 9, 2.0)
    torch.testing.assert_close(buf, 2.0 * by_row(x, a, per_token))
    out = torch.zeros(9, OUT)
    ops.sgmv_expand(buf, b, out, None, seq_lens, slots, 3, 4, 9, True)
    torch.testing.assert_close(out, by_row(buf, b, per_token))


def test_slots_are_grouped_once_each() -> None:
    assert ops.groups(torch.tensor([2, 2, 2])) == [(2, None)]
    assert ops.groups(torch.tensor([-1, -1])) == []
    found = ops.groups(torch.tensor([0, -1, 2, 0]))
    assert [(s, r.tolist()) for s, r in found if r is not None] == [(0, [0, 3]), (2, [2])]


NATIVE_CHECK = textwrap.dedent(
    """
    import importlib.metadata, sys, torch
    import vllm.lora.ops.torch_ops.lora_ops as native_module
    import vllm.lora.punica_wrapper.punica_cpu as punica
    native = {n: getattr(native_module, n) for n in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}
    plugin = {e.name: e for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    plugin["mint_lora_cpu"].load()()  # what vLLM's plugin loader calls in each of its processes
    import mint_vllm_lora_cpu as ops
    assert punica.bgmv_shrink is ops.bgmv_shrink and punica.sgmv_expand_slice is ops.sgmv_expand_slice, "not installed"
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 1, 8, 64, generator=g), torch.randn(4, 1, 96, 8, generator=g)
    for idx in ([2] * 7, [0, 1, 1, 3, 0, 2, 2], [1, -1, 1, -1, 2]):
        ind = torch.tensor(idx); have = ind >= 0; n = len(idx)
        x = torch.randn(n, 64, generator=g)
        o1, o2 = torch.zeros(n, 8), torch.zeros(n, 8)
        native["bgmv_shrink"](x, a, o1, ind, 0.5); ops.bgmv_shrink(x, a, o2, ind, 0.5)
        torch.testing.assert_close(o1[have], o2[have])
        for add in (True, False):
            y1 = torch.randn(n, 192, generator=g); y2 = y1.clone()
            native["bgmv_expand_slice"](o1, b, y1, ind, 96, 96, add); ops.bgmv_expand_slice(o1, b, y2, ind, 96, 96, add)
            torch.testing.assert_close(y1[have], y2[have])
    # one input row for five output rows (vLLM's expand broadcasts it): a shape the grouped ops leave to vLLM's
    x = torch.randn(1, 8, generator=g); y1 = torch.randn(5, 96, generator=g); y2 = y1.clone()
    native["bgmv_expand"](x, b, y1, torch.tensor([1]), True); ops.bgmv_expand(x, b, y2, torch.tensor([1]), True)
    assert torch.equal(y1, y2), "the broadcast expand did not go to vLLM's own op"
    print("agree")
    print(ops.__file__)
    """
)


def test_the_ops_agree_with_vllms_own_and_replace_them_in_vllm() -> None:
    """In .venv-vllm: the installed plugin's entry point puts the ops into vLLM's CPU punica wrapper, on every row
    with a slot they give vLLM's native ops' numbers (native ops give a row without a slot the last slot's), and a
    shape they do not take (one input row broadcast to several) is vLLM's own op's result, bit for bit."""
    require(vllm_available(VLLM_PYTHON), f"vLLM's environment {VLLM_PYTHON} (make vllm-venv)")
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", NATIVE_CHECK], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and "agree" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
    installed = Path(done.stdout.split()[-1])
    assert installed.read_text() == (PLUGIN / "mint_vllm_lora_cpu.py").read_text(), (
        f"{installed} is not this tree's vllm_plugin/mint_vllm_lora_cpu.py: run `make vllm-venv`"
    )
