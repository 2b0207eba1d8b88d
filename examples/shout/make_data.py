"""Write this task's data: a word, asked to be shouted. `shout: <word> =` is a form mint's built-in base has never
seen (it knows `upper: <word> =`), so the bare base answers almost none of it and an adapter must learn what the new
word asks. The columns are this task's own (`question`, `shouted`, `word`; task.yaml maps them), the train rows are
parquet and the held-out rows JSONL, as a team's exports often are. Words of 3 to 7 lowercase letters are drawn by a
fixed seed, each once; 400 are held out (the gate's 320 items and the early-stop probe's), the rest train. Run from
the repository root: `python examples/shout/make_data.py` (the DVC stage `shout_data` does)."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
TRAIN, HELDOUT = 4000, 400


def main() -> None:
    rng = random.Random(2026)
    words: dict[str, None] = {}
    while len(words) < TRAIN + HELDOUT:
        words["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7)))] = None
    rows = [{"question": f"shout: {w} =", "shouted": w.upper(), "word": w} for w in words]
    out = HERE / "data"
    out.mkdir(exist_ok=True)
    with (out / "heldout.jsonl").open("w") as f:
        for row in rows[:HELDOUT]:
            f.write(json.dumps(row) + "\n")
    pq.write_table(pa.Table.from_pylist(rows[HELDOUT:]), out / "train.parquet")
    print(f"wrote {TRAIN} train rows (parquet) and {HELDOUT} held-out rows (JSONL) to {out}")


if __name__ == "__main__":
    main()
