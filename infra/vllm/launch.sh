#!/usr/bin/env bash
# Start vLLM as mint's GPU serving backend: one resident base model, LoRA adapters loaded at runtime.
#
# usage: infra/vllm/launch.sh [--config FILE] [--dry-run] [-- EXTRA_VLLM_SERVE_ARGS...]
#   --config FILE  launch configuration (default: $MINT_VLLM_CONFIG, else serve.yaml next to this script)
#   --dry-run      print the command line (environment + `vllm serve ...`) instead of running it;
#                  the API key is printed as "$MINT_VLLM_API_KEY", never its value
#   -- ARGS        passed to `vllm serve` unchanged, after the generated flags (e.g. -- --enforce-eager)
#
# environment:
#   MINT_VLLM_API_KEY  required: the bearer token vLLM demands on every /v1 route, inference and the
#                      adapter admin routes (/v1/load_lora_adapter, /v1/unload_lora_adapter) alike
#   MINT_PYTHON        a python with PyYAML, used to read the config (default: python3)
#   MINT_VLLM_BIN      the vllm executable (default: vllm)
#   HF_HUB_OFFLINE     set to 1 unless already set, so a lora_path that is not a local directory is never
#                      fetched from the Hugging Face Hub
set -euo pipefail

script_dir=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
config=${MINT_VLLM_CONFIG:-$script_dir/serve.yaml}
python_bin=${MINT_PYTHON:-python3}
vllm_bin=${MINT_VLLM_BIN:-vllm}
dry_run=0
extra_args=()

usage() {
    sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

die() {
    printf 'launch.sh: %s\n' "$*" >&2
    exit 2
}

while (($# > 0)); do
    case $1 in
        --dry-run) dry_run=1 ;;
        --config)
            (($# >= 2)) || die "--config needs a file"
            config=$2
            shift
            ;;
        --config=*) config=${1#--config=} ;;
        -h | --help)
            usage
            exit 0
            ;;
        --)
            shift
            extra_args=("$@")
            break
            ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done

if [[ -z ${MINT_VLLM_API_KEY:-} ]]; then
    die "MINT_VLLM_API_KEY is not set; refusing to start vLLM without an API key." \
        "It is the bearer token for /v1 inference and for the adapter load/unload routes." \
        "Set it first, e.g.: export MINT_VLLM_API_KEY=\"\$(openssl rand -hex 32)\""
fi
[[ -f $config ]] || die "config file not found: $config"

# Read the YAML and print one item per line: the adapter store (empty if none), the base model, then the
# flag/value pairs of `vllm serve`. Every field is checked here, so a mistake is reported by name before vLLM
# spends minutes starting.
read_config=$(
    cat <<'PY'
import os
import sys

try:
    import yaml
except ImportError:
    sys.exit(f"launch.sh: PyYAML is not importable by {sys.executable}; set MINT_PYTHON to a python that has it")

path = sys.argv[1]
with open(path, encoding="utf-8") as f:
    cfg = yaml.safe_load(f)
if not isinstance(cfg, dict):
    sys.exit(f"launch.sh: {path}: expected a mapping of settings")

# vLLM accepts only these values for --max-lora-rank (MaxLoRARanks in vllm/config/lora.py)
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
# key: (flag, kind, required)
FIELDS = {
    "model": (None, str, True),
    "adapter_store": (None, str, False),
    "served_model_name": ("--served-model-name", str, True),
    "host": ("--host", str, True),
    "port": ("--port", int, True),
    "dtype": ("--dtype", str, True),
    "max_model_len": ("--max-model-len", int, True),
    "gpu_memory_utilization": ("--gpu-memory-utilization", float, True),
    "tensor_parallel_size": ("--tensor-parallel-size", int, False),
    "generation_config": ("--generation-config", str, False),
    "max_loras": ("--max-loras", int, True),
    "max_cpu_loras": ("--max-cpu-loras", int, True),
    "max_lora_rank": ("--max-lora-rank", int, True),
}

problems = [f"{k}: unknown setting" for k in cfg if k not in FIELDS]
values = {}
for key, (flag, kind, required) in FIELDS.items():
    v = cfg.get(key)
    if v is None:
        if required:
            problems.append(f"{key}: missing")
        continue
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        problems.append(f"{key}: expected an integer, got {v!r}")
    elif kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        problems.append(f"{key}: expected a number, got {v!r}")
    elif kind is str and (not isinstance(v, str) or not v.strip() or "\n" in v):
        problems.append(f"{key}: expected a non-empty one-line string, got {v!r}")
    else:
        values[key] = v

def check(key, ok, why):
    if key in values and not ok(values[key]):
        problems.append(f"{key}: {values[key]!r} {why}")

for key in ("max_loras", "max_model_len", "tensor_parallel_size"):
    check(key, lambda v: v >= 1, "must be >= 1")
check("port", lambda v: 1 <= v <= 65535, "is not a TCP port")
check("gpu_memory_utilization", lambda v: 0 < v <= 1, "must be in (0, 1]")
check("dtype", lambda v: v in DTYPES, f"is not one of {', '.join(DTYPES)}")
check("max_lora_rank", lambda v: v in RANKS, f"is not a rank vLLM accepts ({', '.join(map(str, RANKS))})")
if "max_loras" in values:
    check("max_cpu_loras", lambda v: v >= values["max_loras"], f"must be >= max_loras ({values['max_loras']})")
if problems:
    sys.exit(f"launch.sh: {path}: " + "; ".join(problems))

# launch.sh starts vLLM inside the adapter store, so both paths are made absolute first
for key in ("model", "adapter_store"):
    if key in values:
        values[key] = os.path.abspath(os.path.expanduser(values[key]))
print(values.get("adapter_store", ""))
print(values["model"])
for key, (flag, _kind, _required) in FIELDS.items():
    if flag is not None and key in values:
        print(flag)
        print(values[key])
print("--enable-lora")
PY
)
serve_text=$("$python_bin" -c "$read_config" "$config") || exit 2
mapfile -t serve_args <<<"$serve_text"
adapter_store=${serve_args[0]}
serve_args=("${serve_args[@]:1}")

cmd=("$vllm_bin" serve "${serve_args[@]}" --api-key "$MINT_VLLM_API_KEY" "${extra_args[@]}")

# Runtime adapter loading: without it vLLM does not register /v1/load_lora_adapter and /v1/unload_lora_adapter.
export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
# Older vLLM let VLLM_API_KEY take precedence over --api-key; keep exactly one key, the one given here.
unset VLLM_API_KEY

# The command as one shell line (a `cd` into the adapter store first), with the key shown as the variable it
# comes from.
render() {
    local arg out=()
    for arg in "$@"; do
        if [[ $arg == "$MINT_VLLM_API_KEY" ]]; then
            # shellcheck disable=SC2016  # printed literally on purpose: the secret never reaches stdout
            out+=('"$MINT_VLLM_API_KEY"')
        else
            out+=("$(printf '%q' "$arg")")
        fi
    done
    if [[ -n $adapter_store ]]; then
        printf 'cd %q && ' "$adapter_store"
    fi
    printf 'VLLM_ALLOW_RUNTIME_LORA_UPDATING=%s HF_HUB_OFFLINE=%s %s\n' \
        "$VLLM_ALLOW_RUNTIME_LORA_UPDATING" "$HF_HUB_OFFLINE" "${out[*]}"
}

if ((dry_run)); then
    render "${cmd[@]}"
    exit 0
fi

command -v "$vllm_bin" >/dev/null 2>&1 ||
    die "'$vllm_bin' not found on PATH: install vLLM on this GPU host (pip install vllm) or set MINT_VLLM_BIN"
[[ -d ${serve_args[0]} ]] ||
    die "base model directory not found: ${serve_args[0]} (model in $config must be a local Hugging Face directory)"
if [[ -n $adapter_store ]]; then
    [[ -d $adapter_store ]] ||
        die "adapter store not found: $adapter_store (mount the store there, or fix adapter_store in $config)"
    # relative lora_paths of load requests resolve inside the store, as on mint's embedded server
    cd -- "$adapter_store"
fi
if [[ ${VLLM_SERVER_DEV_MODE:-0} == 1 ]]; then
    printf 'launch.sh: warning: VLLM_SERVER_DEV_MODE=1 exposes unauthenticated debug routes; never in production\n' >&2
fi

printf 'launch.sh: starting: %s\n' "$(render "${cmd[@]}")" >&2
exec "${cmd[@]}"
