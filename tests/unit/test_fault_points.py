"""The lifecycle's fault points run only the hooks a test installs: none by default, so the library path never
fails or kills its process on an environment variable alone; the tests' hook reads `$MINT_LIFECYCLE_FAULT`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mint_core.lifecycle.faults import InjectedFault, fault
from tests.fault_points import FAULT_ENV, installed


def test_a_fault_point_without_a_hook_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "export")
    fault("export")  # no hook installed: the variable alone changes nothing


def test_the_tests_hook_fails_the_named_point_on_its_nth_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "evaluate:2, promote")
    with installed() as hook:
        fault("export")
        fault("evaluate")  # the first time: not yet
        with pytest.raises(InjectedFault, match="injected fault at evaluate"):
            fault("evaluate")
        fault("evaluate")  # the third time: no more
        with pytest.raises(InjectedFault, match="at promote"):
            fault("promote")
        assert hook.hits == {"export": 1, "evaluate": 3, "promote": 1}
    fault("promote")  # removed with the block


def test_kill_ends_the_process_with_sigkill() -> None:
    code = (
        "import os; os.environ['MINT_LIFECYCLE_FAULT'] = 'export:kill'\n"
        "from mint_core.lifecycle.faults import fault\n"
        "from tests.fault_points import installed\n"
        "with installed():\n"
        "    fault('export')\n"
        "print('survived')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9 and "survived" not in proc.stdout, proc.stderr
