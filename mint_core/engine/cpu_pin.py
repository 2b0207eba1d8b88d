"""The instruction set the built-in base is pretrained with, so that every machine builds the same bytes.

A thousand steps of pretraining amplify the last bit of every sum. The same run with AVX-512 kernels and with AVX2
kernels ends in different bases (final loss 0.18 against 0.30, `add` right 0.665 against 0.495 of the time), so a
base built on one machine was not the base `dvc.lock` records on another, and what GRPO learned on it differed.
`mint base pretrain` therefore computes with AVX2 whatever the CPU offers beyond it: PyTorch's own kernels, MKL
(whose conditional numerical reproducibility makes its sums CPU-independent at that level) and oneDNN. With the
thread count of params.yaml, a rebuild on one machine gives the same weights whatever its environment shows. Across
CPU vendors it does not (an Intel Xeon and an AMD EPYC part by step 100 of 1,000): the main job takes the published
base instead of rebuilding it (docs/builtin-base.md, "The published base").

No torch here: the variables are read once, when torch first computes, so they are set before it loads.
"""

from __future__ import annotations

import os

REPRODUCIBLE_CPU_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
"""Environment variables that pin the kernels: PyTorch's CPU dispatch, MKL and oneDNN. MKL takes
`MKL_ENABLE_INSTRUCTIONS` over `MKL_CBWR`: with `MKL_CBWR=AVX2` alone, an exported `MKL_ENABLE_INSTRUCTIONS=AVX512`
changed the weights on an Intel Xeon after 8 steps."""

PINNED_CAPABILITY = "AVX2"
"""What `torch.backends.cpu.get_cpu_capability()` reports once the pin holds."""


def pin_cpu_kernels() -> None:
    """Set `REPRODUCIBLE_CPU_ENV` in this process, over any value the environment gave: a shell or CI that exports
    `ATEN_CPU_CAPABILITY=avx512` or `ONEDNN_MAX_CPU_ISA=ALL` would otherwise build another base. Call it before
    torch computes anything; after that the kernels are chosen and the pin has no effect.

    Where the pin cannot hold (a CPU vendor's own rounding in a kernel the variables do not reach), the main job
    does not rebuild the base: it takes the published one, checked against dvc.lock's md5 (mint_app/job/build.py).
    """
    os.environ.update(REPRODUCIBLE_CPU_ENV)
