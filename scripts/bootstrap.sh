#!/usr/bin/env bash
# Create or refresh .venv: torch pinned (a CPU build; an unpinned torch pulls CUDA), then mint and its dev tools.
# Re-runs only when pyproject.toml changed.
#
# The packages go in with uv where it can be had (pip itself installs it into .venv first), with pip's own
# indexes, find-links, constraints and certificate: it resolves to the same versions as pip and byte-compiles in
# parallel. A new .venv took 68 s here against pip's 117 s, caches warm (pip's setup was a fifth of a fresh clone's
# `make run`). Where uv cannot be installed or fails, or with MINT_NO_UV=1, pip does it all, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MINT_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp="$VENV/.mint-installed"
# The browser tests (the MLflow UI and the Prefect dashboard, driven through Selenium) need Debian's Chromium and
# its driver; CI runs on a machine like this one, so the setup installs them where they are missing.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "bootstrap: installing chromium and chromium-driver (Debian) for the browser tests" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null
  else
    echo "bootstrap: chromium and chromium-driver are missing; the browser tests need them (apt-get install)" >&2
  fi
fi
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip_install, and uv_pip_sources: uv's arguments for the package sources pip is configured with (shared with
# scripts/bootstrap_vllm.sh)
source scripts/pip_sources.sh
uv_args=(--python "$VENV/bin/python" --compile-bytecode)
uv_pip_sources

uv_install() {
  echo "bootstrap: installing torch==2.13.0 (CPU), mint and its dependencies into $VENV (uv)" >&2
  "$VENV/bin/uv" pip install -q "${uv_args[@]}" "torch==2.13.0" &&
    DS_BUILD_OPS=0 "$VENV/bin/uv" pip install -q "${uv_args[@]}" -e ".[dev]"
}

pip_all() {
  pip_install --upgrade pip >/dev/null
  echo "bootstrap: installing torch==2.13.0 (CPU) into $VENV (pip)" >&2
  pip_install "torch==2.13.0"
  echo "bootstrap: installing mint and its dependencies (pip)" >&2
  DS_BUILD_OPS=0 pip_install -e ".[dev]" # DeepSpeed without compiled ops (its CPU accelerator needs none)
}

if [ -n "${MINT_NO_UV:-}" ]; then
  pip_all
elif pip_install "uv>=0.5" >/dev/null && uv_install; then
  :
else
  echo "bootstrap: uv could not install the packages; pip installs them instead" >&2
  pip_all
fi
cuda=$("$VENV/bin/python" -c "import torch; print(torch.version.cuda or '')")  # fails loudly if torch is broken
if [ -n "$cuda" ]; then
  echo "bootstrap: note: the torch in $VENV is a CUDA $cuda build (no CPU build of torch 2.13.0 was found)" >&2
fi
echo "$want" >"$stamp"
