"""The mint application: the `mint` CLI (cli/), the main job (`mint run`, job/) and the local services (`mint up`, services/).

It sits above `flows/` and `tasks/` and is the only package that knows every part; `mint_core` (the library)
never imports it.
"""

import os

# No progress bars of the libraries underneath (lm-eval's per-task and "Requesting API" bars, ...) unless the user
# sets TQDM_DISABLE: tqdm reads its TQDM_* defaults once, when it is imported, which the application's modules do
# right after this. mint's own bars (pretraining, `mint train`) pass `disable` themselves. Subprocesses (the
# services, DVC's stages, flow runs of the worker) inherit it.
os.environ.setdefault("TQDM_DISABLE", "1")

# No MLflow telemetry (no network here, and nothing to report to): its client thread sets and unsets
# _MLFLOW_TELEMETRY_SESSION_ID in os.environ while other threads read the environment, and a reader that iterates
# it then (pydantic-settings under Prefect's settings) fails with KeyError. Set before MLflow is imported; the
# services and flow runs inherit it.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
