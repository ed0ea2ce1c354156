"""Give the rollout pool a command: one new file `control.d/<id>.json` per command.

    python -m launch.control --root RUN add 2
    python -m launch.control --root RUN remove 1

The id is the next free one; the file is created without overwriting anything
(buffer.storage.create_new), so commands given at the same time all count, each once.
"""
from __future__ import annotations

import argparse
import sys

from buffer.layout import RunLayout
from buffer.storage import create_new, filesystem
from protocol import control

MAX_ATTEMPTS = 1000  # ids taken by concurrent commands between listing and creating


def taken_ids(fs, layout: RunLayout) -> set[str]:
    """Ids of the commands in control.d/ and in the hand-written control file."""
    ids = {p.rstrip("/").rsplit("/", 1)[-1][: -len(".json")]
           for p in (fs.ls(layout.control_dir, detail=False) if fs.exists(layout.control_dir) else [])
           if p.endswith(".json")}
    if fs.exists(layout.control):
        ids |= {c.id for c in control.parse(fs.cat_file(layout.control).decode(), layout.control)}
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.control", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="run folder")
    p.add_argument("action", choices=control.ACTIONS)
    p.add_argument("count", type=int, nargs="?", default=1)
    args = p.parse_args(argv)
    fs, root = filesystem(args.root)
    layout = RunLayout(root)
    try:
        for _ in range(MAX_ATTEMPTS):
            text, cmd = control.new_command(control.next_id(taken_ids(fs, layout)), args.action,
                                            args.count)
            if create_new(fs, layout.control_command(cmd.id), text.encode()):
                break
        else:
            raise control.ControlError(f"no free command id in {layout.control_dir} after "
                                       f"{MAX_ATTEMPTS} attempts")
    except control.ControlError as e:
        print(f"launch.control: {e}", file=sys.stderr)
        return 2
    print(f"{layout.control_command(cmd.id)}: {cmd.action} {cmd.count} (command {cmd.id})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
