"""A process of mint's own freezes its objects at exit, after the atexit handlers registered later have run, so
the interpreter's teardown does not pass the garbage collector over them (mint_core/process.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_freeze_at_exit_freezes_after_later_handlers_and_registers_once() -> None:
    script = textwrap.dedent(
        """
        import atexit, gc
        from mint_core.process import freeze_at_exit

        # registered first, so it runs last: it sees what freeze_at_exit's handler left
        atexit.register(lambda: print("frozen at the end:", gc.get_freeze_count() > 0))
        before = atexit._ncallbacks()
        freeze_at_exit()
        freeze_at_exit()
        atexit.register(lambda: print("frozen for a later handler:", gc.get_freeze_count() > 0))
        print("registered:", atexit._ncallbacks() - before - 1)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "registered: 1",
        "frozen for a later handler: False",  # a handler registered later still runs on a live collector
        "frozen at the end: True",
    ], out


def test_the_mint_command_and_the_flows_register_it() -> None:
    script = textwrap.dedent(
        """
        import atexit, gc, sys
        atexit.register(lambda: print("frozen:", gc.get_freeze_count() > 0))
        if sys.argv[1] == "cli":
            from mint_app.cli.app import app
            sys.argv = ["mint", "task", "list"]
            try:
                app()
            except SystemExit:
                pass
        else:
            import flows  # the package a flow run's entry point is imported from
        """
    )
    for which in ("cli", "flows"):
        done = subprocess.run(
            [sys.executable, "-c", script, which], capture_output=True, text=True, check=True
        )
        assert done.stdout.splitlines()[-1] == "frozen: True", (which, done.stdout[-500:], done.stderr[-500:])
