"""What a person reads while the main job trains: one progress bar per training phase (steps, mean reward,
seconds per step) instead of a log line per GRPO step, and no progress bars of the libraries underneath.

The wave flow logs every GRPO step with the step's numbers attached (`flows.lifecycle.STEP_RECORD`); those lines
stay in the flow run's log on the Prefect server, and each step's metrics in MLflow. On the console, `StepBar`
takes them off the log handlers and moves a bar instead; when the output is not a terminal (a kept log, a pipe),
the bar becomes a few lines: a quarter of the steps each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from flows.lifecycle import STEP_RECORD


@dataclass
class _Seen:
    """The steps of one phase seen so far."""

    first_step: int = 0
    first_at: float = 0.0
    step: int = 0
    steps: int = 0
    reward: dict[str, float] = field(default_factory=dict)
    at: float = 0.0

    def pace(self, started: float) -> float:
        """Seconds per step: over the steps seen after the first, else since the phase began."""
        if self.step > self.first_step:
            return (self.at - self.first_at) / (self.step - self.first_step)
        return self.at - started

    def numbers(self, started: float) -> str:
        reward = ", ".join(f"{k} {v:.3f}" for k, v in self.reward.items())
        return f"mean reward {reward} · {self.pace(started):.2f} s/step"


class StepBar(logging.Filter):
    """On the console's log handlers for one training phase: each GRPO step's record moves the bar (or, in a
    kept log, prints a line at each quarter of the steps) instead of printing its own line. While the bar is
    drawn, every other record prints above it, as the handler would have formatted it."""

    def __init__(
        self, console: Console, title: str, handlers: Sequence[logging.Handler], lines: int = 4
    ) -> None:
        super().__init__()
        self.console = console
        self.title = title
        self.handlers = handlers
        self.lines = lines
        self.started = time.time()
        self.seen = _Seen()
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._printed: set[int] = set()  # the quarters already printed (kept log)
        self._last: logging.LogRecord | None = None  # a record is filtered once per handler: act once

    def filter(self, record: logging.LogRecord) -> bool:
        step = getattr(record, STEP_RECORD, None)
        if record is self._last:
            return step is None and self._progress is None
        self._last = record
        if isinstance(step, Mapping):
            self._step(step, record.created)
            return False
        if self._progress is not None:
            fmt = self.handlers[0].formatter or logging.Formatter()
            self._progress.console.print(Text(fmt.format(record)), soft_wrap=True)
            return False
        return True

    def _step(self, step: Mapping[str, Any], at: float) -> None:
        seen = self.seen
        if seen.steps == 0:
            seen.first_step, seen.first_at = int(step["step"]), at
        seen.step, seen.steps, seen.at = int(step["step"]), int(step["steps"]), at
        seen.reward = {str(k): float(v) for k, v in dict(step["reward"]).items()}
        if self.console.is_terminal:
            self._draw()
            if (
                seen.step >= seen.steps
            ):  # the phase's last step: the bar stays drawn, what follows prints below
                self.close()
            return
        quarter = seen.step * self.lines // max(seen.steps, 1)
        if quarter > 0 and quarter not in self._printed:
            self._printed.add(quarter)
            self.console.print(
                Text(f"  {self.title}: step {seen.step}/{seen.steps} · {seen.numbers(self.started)}"),
                soft_wrap=True,
            )

    def _draw(self) -> None:
        seen = self.seen
        if self._progress is None:
            self._progress = Progress(
                TextColumn("  {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[numbers]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task(self.title, total=seen.steps, numbers="")
            self._progress.start()
        assert self._task is not None
        self._progress.update(
            self._task, completed=seen.step, total=seen.steps, numbers=seen.numbers(self.started)
        )

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


@contextmanager
def step_bar(console: Console, title: str) -> Iterator[StepBar]:
    """One progress bar for the GRPO steps logged inside the block (by the flows this process runs)."""
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)]
    bar = StepBar(console, title, handlers)
    for h in handlers:
        h.addFilter(bar)
    try:
        yield bar
    finally:
        bar.close()
        for h in handlers:
            h.removeFilter(bar)
