"""Write this task's data: sums of two numbers from 50 to 99 (answers from 100 to 198), as a tenant who needs
only three-digit sums would collect them. Every pair is enumerated once, shuffled by a fixed seed, and any prompt
that is a row of mint's built-in `add` data (data/tasks, what the built-in base was pretrained and is evaluated
on) is left out, so no row here is one of the built-in task's. 340 rows are held out (the gate's items), the rest
train. Run from the repository root: `python examples/sums-over-100/make_data.py` (the DVC stage
`sums_over_100_data` does)."""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILTIN = [Path("data/tasks/train/add.jsonl"), Path("data/tasks/heldout/add.jsonl")]
HELDOUT = 340


def main() -> None:
    taken = set()
    for path in BUILTIN:
        if not path.is_file():
            raise SystemExit(f"{path} is missing: build mint's task data first (dvc repro task_data)")
        taken |= {json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()}
    pairs = [(a, b) for a in range(50, 100) for b in range(50, 100) if f"add: {a}+{b} =" not in taken]
    random.Random(100).shuffle(pairs)
    rows = [{"prompt": f"add: {a}+{b} =", "answer": str(a + b), "a": a, "b": b} for a, b in pairs]
    out = HERE / "data"
    out.mkdir(exist_ok=True)
    for name, part in (("heldout", rows[:HELDOUT]), ("train", rows[HELDOUT:])):
        with (out / f"{name}.jsonl").open("w") as f:
            for i, row in enumerate(part):
                f.write(json.dumps({"id": f"{name}-{i}", **row}) + "\n")
    print(f"wrote {len(rows) - HELDOUT} train and {HELDOUT} held-out rows to {out}")


if __name__ == "__main__":
    main()
