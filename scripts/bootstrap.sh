#!/usr/bin/env bash
# Create or refresh .venv: torch pinned and installed first (a CPU build; an unpinned torch pulls CUDA),
# then mint and its dev tools. Re-runs only when pyproject.toml changed.
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
# pip warns once per index entry this machine's mirror lacks; those lines say nothing about mint.
pip_install() {
  "$VENV/bin/pip" install -q "$@" 2> >(grep -v -e "^WARNING: Location" -e "BuildBackendWarning" -e "^ *!!" -e "^ *\*\*\*" \
    -e "Please be careful with folders" -e "name as your package" -e "with strategy, WheelFile" -e "^ *$" >&2)
}
pip_install --upgrade pip >/dev/null
echo "bootstrap: installing torch==2.13.0 (CPU) into $VENV" >&2
pip_install "torch==2.13.0"
echo "bootstrap: installing mint and its dependencies" >&2
DS_BUILD_OPS=0 pip_install -e ".[dev]"  # DeepSpeed without compiled ops (its CPU accelerator needs none)
echo "$want" >"$stamp"
