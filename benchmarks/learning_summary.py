"""Learning-curve summary of launch.local run folders, one line each (the issue-12 table).

    python benchmarks/learning_summary.py runs/demo runs/gae ...

Per run: mean reward of the first and last 10 steps, the first step at which the mean of the
10 steps ending there reaches 0.5 and 0.9, the wall time from the first to the last step, and
the largest actor/pg_clipfrac of the run.
"""

from __future__ import annotations

import json
import sys


def summary(root: str) -> str:
    with open(f"{root}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    reward = [r["reward/mean"] for r in rows]

    def reached(level: float):
        for end in range(10, len(reward) + 1):
            if sum(reward[end - 10 : end]) / 10 >= level:
                return rows[end - 1]["step"]
        return None

    seconds = rows[-1]["time/unix"] - rows[0]["time/unix"]
    clip = max(r.get("actor/pg_clipfrac", 0.0) for r in rows)
    return (
        f"| {root} | {sum(reward[:10]) / 10:.3f} | {sum(reward[-10:]) / 10:.3f} | "
        f"{reached(0.5)} | {reached(0.9)} | {seconds:.0f} | {clip:.3f} |"
    )


if __name__ == "__main__":
    print("| run | first 10 | last 10 | step at 0.5 | step at 0.9 | first to last step, s | max pg_clipfrac |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for root in sys.argv[1:]:
        print(summary(root))
