"""Control-file commands that grow or shrink the rollout pool while a run goes on.

The control file (`RunLayout.control`) holds either one command, as the seed scripts wrote it,

    {"action": "add", "count": 2}

or a log of them, as `python -m launch.control` writes it:

    {"commands": [{"id": "c000001", "action": "add", "count": 2}, ...]}

A command's id makes it idempotent: a supervisor records the ids it applied and never applies
one twice, whether the file is rewritten, repeated, or the supervisor restarts. A command
without an id is identified by its content, so rewriting the same text does nothing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

ACTIONS = ("add", "remove")
MAX_COUNT = 1024


class ControlError(ValueError):
    """The control file cannot be understood; the message says why."""


@dataclasses.dataclass(frozen=True)
class Command:
    id: str
    action: str
    count: int


def _command(obj, where: str) -> Command:
    if not isinstance(obj, dict):
        raise ControlError(f"{where}: a command must be an object, got {type(obj).__name__}")
    action, count = obj.get("action"), obj.get("count", 1)
    if action not in ACTIONS:
        raise ControlError(f"{where}: action must be one of {list(ACTIONS)}, got {action!r}")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
        raise ControlError(f"{where}: count must be an integer in [1, {MAX_COUNT}], got {count!r}")
    cid = obj.get("id")
    if cid is None:
        digest = hashlib.sha256(json.dumps({"action": action, "count": count}, sort_keys=True).encode())
        cid = "content-" + digest.hexdigest()[:16]
    return Command(str(cid), action, count)


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


def append(text: str | None, action: str, count: int) -> tuple[str, Command]:
    """The control file's new text with one more command (a fresh id) appended."""
    cmds = parse(text) if text and text.strip() else []
    new = _command({"id": f"c{len(cmds) + 1:06d}", "action": action, "count": count}, "new command")
    if new.id in {c.id for c in cmds}:
        new = dataclasses.replace(new, id=f"{new.id}-{hashlib.sha256(text.encode()).hexdigest()[:8]}")
    body = {"commands": [dataclasses.asdict(c) for c in [*cmds, new]]}
    return json.dumps(body, indent=1) + "\n", new
