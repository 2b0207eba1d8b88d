#!/usr/bin/env bash
# Start the Prefect server (API under /api and dashboard on :4200) in the background: `mint up --only prefect`.
#
# usage: infra/prefect/start.sh [MINT_UP_OPTIONS...]
#   e.g. infra/prefect/start.sh --prefect-port 4201 --prefect-database-url postgresql+asyncpg://prefect@db:5432/prefect
#   Runs from the repository root, so its state (pid file, log, SQLite database) lands in .mint/run/ unless
#   --state-dir says otherwise. Reuses a server already running there. Stop it: mint down --only prefect.
#   Every option of `mint up --help` works, as do MINT_SERVICES_<FIELD> environment variables.
#
# environment:
#   MINT_BIN  the mint executable (default: .venv/bin/mint of this repository, else mint on PATH)
set -euo pipefail

repo=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd)
mint_bin=${MINT_BIN:-$repo/.venv/bin/mint}
if [[ ! -x $mint_bin ]]; then
    mint_bin=$(command -v mint) || {
        printf 'start.sh: mint not found (run make venv, or set MINT_BIN)\n' >&2
        exit 2
    }
fi
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
cd -- "$repo"
exec "$mint_bin" up --only prefect "$@"
