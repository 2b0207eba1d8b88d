"""Byte-compile what mint's processes import, by importing it with bytecode writes on (scripts/bootstrap*.sh).

An environment installed without bytecode holds only sources. Where PYTHONDONTWRITEBYTECODE is set (as on this
project's machines and CI), every process would then compile what it imports at every start. Compiling every file
at install (`uv pip install --compile-bytecode`) was most of a new environment's time: 43 s of the 46 s a new
.venv-vllm took on two cores, caches warm. About a fifth of those files are ever imported (vLLM's server, engine
and worker load about 4,500 modules of 21,000 files; anthropic's 3,201 files are never imported, nor most of
transformers' models). Importing the modules that mint's processes start from writes the
bytecode of exactly what they load. mint's services (`mint_app.services.control`) then cache whatever else they
import the first time they import it.

    python scripts/warm_bytecode.py MODULE [MODULE ...]   (run with PYTHONDONTWRITEBYTECODE unset)

A module that does not import is named, and then every file of the environment is compiled, as before: nothing is
left slower than a full compile would leave it. Exit status 0 either way; the imports themselves are checked by
the scripts that call this one.
"""

from __future__ import annotations

import compileall
import importlib
import sys
import sysconfig
import time
import warnings


def main(modules: list[str]) -> int:
    if sys.dont_write_bytecode:
        print("warm_bytecode: PYTHONDONTWRITEBYTECODE is set; run it without", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    failed: list[str] = []
    warnings.simplefilter("ignore")
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # a module that needs what this host lacks: the full compile covers it
            failed.append(f"{name} ({type(e).__name__}: {str(e)[:120]})")
    if failed:
        print(
            "warm_bytecode: did not import: " + "; ".join(failed) + "; compiling every file instead",
            file=sys.stderr,
        )
        compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=1, workers=0)
    print(
        f"warm_bytecode: {len(sys.modules)} modules compiled in {time.monotonic() - t0:.0f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
