"""Write a pool command into a run's control file, atomically.

    python -m launch.control --root RUN add 2
    python -m launch.control --root RUN remove 1
"""
from __future__ import annotations

import argparse
import sys

from buffer.layout import RunLayout
from buffer.storage import atomic_write, filesystem
from protocol import control


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.control", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="run folder")
    p.add_argument("action", choices=control.ACTIONS)
    p.add_argument("count", type=int, nargs="?", default=1)
    args = p.parse_args(argv)
    fs, root = filesystem(args.root)
    path = RunLayout(root).control
    try:
        old = fs.cat_file(path).decode() if fs.exists(path) else None
        text, cmd = control.append(old, args.action, args.count)
    except control.ControlError as e:
        print(f"launch.control: {e}", file=sys.stderr)
        return 2
    atomic_write(fs, path, text.encode())
    print(f"{path}: {cmd.action} {cmd.count} (command {cmd.id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
