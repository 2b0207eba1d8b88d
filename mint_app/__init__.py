"""The mint application: the `mint` CLI, the main job (`mint run`) and the service supervisor (`mint up`).

It sits above `flows/` and `tasks/` and is the only package that knows every part; `mint_core` (the library)
never imports it.
"""

import os

# No progress bars of the libraries underneath (lm-eval's per-task and "Requesting API" bars, ...) unless the user
# sets TQDM_DISABLE: tqdm reads its TQDM_* defaults once, when it is imported, which the application's modules do
# right after this. mint's own bars (pretraining, `mint train`) pass `disable` themselves. Subprocesses (the
# services, DVC's stages, flow runs of the worker) inherit it.
os.environ.setdefault("TQDM_DISABLE", "1")
