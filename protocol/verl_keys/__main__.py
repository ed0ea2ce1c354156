"""python -m protocol.verl_keys [--sft|--rl] [FILE.yaml]: which verl release(s) a config file's
keys match and how tandem treats each key (protocol/verl_keys/__init__.py)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from protocol.config import treatments
from protocol.fields import ConfigError, _read_yaml, yaml_leaves
from protocol.verl_keys import SFT_ROLE, UNKNOWN, _load, matching_releases, release_keys, role_schemas, verl_config_path


def report(path: str, sft: bool | None = None) -> int:
    """Print which releases a config file matches and how each of its keys is treated by the
    roles that read it, then the counts; 1 if any key is unknown."""
    if sft is None:  # verl's SFT configs have a top-level model section, the RL ones do not
        sft = "model" in _read_yaml(path) and "actor_rollout_ref" not in _read_yaml(path)
    keys = yaml_leaves(path)
    verl, best = matching_releases(set(keys), sft)
    have = len(verl & release_keys(best[0], sft)) if best else 0
    print(
        f"{path}: a verl {'SFT' if sft else 'PPO/GRPO'} config: "
        + (
            f"its {len(verl)} verl keys are all in verl "
            if have == len(verl)
            else f"no verl release has all its {len(verl)} verl keys; closest, with {have}: "
        )
        + ", ".join(best)
        + f" ({len(keys) - len(verl)} keys of no verl release)"
    )
    schemas = [_load(SFT_ROLE)] if sft else role_schemas()
    verdicts = treatments(schemas, path)
    counts = Counter(t.verdict for t in verdicts.values())
    for key, t in verdicts.items():
        print(f"{t.verdict:8s} {key}" + (f"  ({t.reason})" if t.reason else ""))
    print("\n" + ", ".join(f"{c}: {n}" for c, n in counts.most_common()) + f"; total {len(verdicts)}")
    return 1 if counts[UNKNOWN] else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m protocol.verl_keys",
        description=(
            "Say which verl release(s) a config file's keys match and how tandem treats each key "
            "(applied, ignored with why, refused with why, unknown)."
        ),
    )
    p.add_argument(
        "file",
        nargs="?",
        help="a verl PPO/GRPO or SFT YAML (default: the installed verl's _generated_ppo_trainer.yaml)",
    )
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--sft", action="store_true", default=None, help="read it as an SFT config")
    shape.add_argument("--rl", dest="sft", action="store_false", help="read it as a PPO/GRPO config")
    args = p.parse_args(argv)
    try:
        return report(args.file or verl_config_path(), args.sft)
    except ConfigError as e:
        print(f"python -m protocol.verl_keys: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
