"""Writes ``data/arithmetic/{train,test}.jsonl``: short arithmetic word problems for SmolLM2.

One or two additions / subtractions with small numbers in a one-sentence story; the answer is a
non-negative integer. Deterministic (seeded), so the shipped files are reproducible::

    python experiments/make_arithmetic_problems.py            # 512 train, 64 test rows
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Tom", "Anna", "Lee", "Maria", "Sam", "Priya", "Omar", "Lena"]
ITEMS = ["apples", "marbles", "books", "coins", "stickers", "pencils", "cookies", "cards"]
GAIN = ["buys {n} more", "finds {n} more", "gets {n} more from a friend"]
LOSS = ["gives away {n}", "loses {n}", "eats {n}"]


def render(rng: random.Random) -> dict:
    """A record with its question text: start amount, the changes, then the question."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start = rng.randint(2, 20)
    total, clauses = start, []
    for _ in range(rng.randint(1, 2)):
        if total > 1 and rng.random() < 0.5:
            n = rng.randint(1, total - 1)
            clauses.append(rng.choice(LOSS).format(n=n))
            total -= n
        else:
            n = rng.randint(1, 15)
            clauses.append(rng.choice(GAIN).format(n=n))
            total += n
    story = f"{name} has {start} {item}. {name} " + ", then ".join(clauses) + "."
    return {"question": f"{story} How many {item} does {name} have now?", "answer": str(total)}


def main() -> None:
    """Writes the two files (train and test drawn from different seeds)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="data/arithmetic")
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--test", type=int, default=64)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", args.train, 0), ("test", args.test, 1)):
        rng = random.Random(seed)
        with (out / f"{split}.jsonl").open("w") as f:
            for _ in range(n):
                f.write(json.dumps(render(rng)) + "\n")
        print(f"wrote {n} rows to {out / split}.jsonl")


if __name__ == "__main__":
    main()
