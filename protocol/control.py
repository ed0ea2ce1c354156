"""Control commands that grow or shrink the rollout pool while a run goes on.

`python -m launch.control` creates one file per command, `control.d/<id>.json`
(`RunLayout.control_command`), holding `{"id": ..., "action": ..., "count": ...}`. Its id is
allocated by creating the file under the next free name without overwriting (buffer.storage.
create_new), so concurrent commands never share an id and none is lost (rewriting one shared
file lost all but one of several commands given at once).

The control file (`RunLayout.control`, written by hand) holds either one command, as the seed
scripts wrote it,

    {"action": "add", "count": 2}

or a log of them, as `python -m launch.control` writes it:

    {"commands": [{"id": "c000001", "action": "add", "count": 2}, ...]}

A command's `role` says which pool it is for: "rollout" (the default; rollout workers) or
"reward" (reward servers, rollout/reward_server.py); each supervisor (launch/pool.py, pool.role)
applies the commands of its own role only.

A command's id makes it idempotent: a supervisor records the ids it applied and never applies
one twice, whether the file is rewritten, repeated, or the supervisor restarts. A command
without an id is identified by its content, so rewriting the same text does nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

ACTIONS = ("add", "remove")
ROLES = ("rollout", "reward")  # the pools a command can be for (launch/pool.py, pool.role)
MAX_COUNT = 1024


class ControlError(ValueError):
    """The control file cannot be understood; the message says why."""


@dataclasses.dataclass(frozen=True)
class Command:
    id: str
    action: str
    count: int
    role: str = "rollout"


def _command(obj, where: str) -> Command:
    if not isinstance(obj, dict):
        raise ControlError(f"{where}: a command must be an object, got {type(obj).__name__}")
    action, count = obj.get("action"), obj.get("count", 1)
    if action not in ACTIONS:
        raise ControlError(f"{where}: action must be one of {list(ACTIONS)}, got {action!r}")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
        raise ControlError(f"{where}: count must be an integer in [1, {MAX_COUNT}], got {count!r}")
    role = obj.get("role", "rollout")
    if role not in ROLES:
        raise ControlError(f"{where}: role must be one of {list(ROLES)}, got {role!r}")
    cid = obj.get("id")
    if cid is None:
        # the role joins the content only when given: a rollout command's id is what it was
        # before roles existed, so a supervisor that applied it does not apply it again
        content = {"action": action, "count": count, **({"role": role} if role != "rollout" else {})}
        digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode())
        cid = "content-" + digest.hexdigest()[:16]
    return Command(str(cid), action, count, role)


def parse(text: str | bytes, where: str = "control file") -> list[Command]:
    """The commands in a control file's text or raw bytes; ControlError for anything else."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested beyond reason
        raise ControlError(f"{where}: not JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if isinstance(obj, dict) and "commands" in obj:
        if not isinstance(obj["commands"], list):
            raise ControlError(f"{where}: 'commands' must be a list")
        cmds = [_command(c, f"{where} command {i}") for i, c in enumerate(obj["commands"])]
    else:
        cmds = [_command(obj, where)]
    ids = [c.id for c in cmds]
    if len(set(ids)) != len(ids):
        raise ControlError(f"{where}: command ids repeat")
    return cmds


def next_id(taken: set[str]) -> str:
    """The id after the highest `c<number>` id in `taken`."""
    numbers = [int(t[1:]) for t in taken if t[:1] == "c" and t[1:].isdigit()]
    return f"c{max(numbers, default=0) + 1:06d}"


def new_command(cid: str, action: str, count: int, role: str = "rollout") -> tuple[str, Command]:
    """The text of a command file and its command (validated)."""
    cmd = _command({"id": cid, "action": action, "count": count, "role": role}, "new command")
    return json.dumps(dataclasses.asdict(cmd)) + "\n", cmd


def parse_command_file(text: str | bytes, cid: str, where: str) -> Command:
    """The one command of `control.d/<cid>.json`; its id must be the file's name."""
    cmds = parse(text, where)
    if len(cmds) != 1 or cmds[0].id != cid:
        raise ControlError(f"{where}: expected one command with id {cid!r}")
    return cmds[0]
