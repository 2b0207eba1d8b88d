"""The console the `mint` commands print to: in a terminal, rich's own; in a file or a pipe, wide enough that no
table is cut or wrapped ("candida…"), so a kept log reads like the terminal did. And no progress bars from the
libraries underneath (`quiet_libraries`).

Light on purpose: every command imports it, `mint --help` included.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.rule import Rule
from rich.text import Text

KEPT_WIDTH = 400
"""Width of a console that writes to a file or a pipe (unless COLUMNS says otherwise): wider than any table the
commands print, which rich then renders at its natural width."""
RULE_WIDTH = 100
"""A rule (a step's heading) is drawn this wide at most, whatever the console's width."""


def make_console(*, stderr: bool = False) -> Console:
    """A console that keeps tables at their natural width when its output is not a terminal."""
    console = Console(stderr=stderr)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(stderr=stderr, width=KEPT_WIDTH)


def rule(console: Console, title: str | Text = "") -> None:
    """A heading rule, at most RULE_WIDTH wide (a kept log's console is KEPT_WIDTH wide)."""
    console.print(Rule(title), width=min(console.width, RULE_WIDTH))


QUIET_ENV = {
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # datasets' "Generating test split" bars (lm-eval's suites)
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",  # tqdm bars that take their default from the environment
}


def quiet_libraries() -> None:
    """No progress bars from the libraries the job runs: datasets (lm-eval's suites), the Hugging Face Hub,
    transformers, and tqdm's own default. The variables reach the job's subprocesses too; the calls cover the
    libraries already imported, which read their variable only once."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    import datasets
    import huggingface_hub.utils
    import transformers.utils.logging
    from datasets.utils import logging as datasets_logging

    datasets.disable_progress_bars()
    datasets_logging.set_verbosity_error()  # its cache notices
    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
