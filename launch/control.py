"""Give a pool a command: one new file `control.d/<id>.json` per command.

    python -m launch.control --root RUN add 2                    # rollout workers
    python -m launch.control --root RUN remove 1
    python -m launch.control --root RUN --role reward add 1      # reward servers (pool.role=reward)

The id is the next free one; the file is created without overwriting anything
(buffer.storage.create_new), so commands given at the same time all count, each once.
"""

from __future__ import annotations

import argparse
import logging
import sys

from buffer.run import setup_trainer_run
from protocol import control


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launch.control", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", required=True, help="run folder")
    p.add_argument("action", choices=control.ACTIONS)
    p.add_argument("count", type=int, nargs="?", default=1)
    p.add_argument("--role", choices=control.ROLES, default="rollout", help="the pool the command is for")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="launch.control: %(message)s")  # e.g. control.json set aside
    try:
        cmd, where = setup_trainer_run(args.root).control.submit(args.action, args.count, args.role)
    except control.ControlError as e:
        print(f"launch.control: {e}", file=sys.stderr)
        return 2
    print(f"{where}: {cmd.role} pool: {cmd.action} {cmd.count} (command {cmd.id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
