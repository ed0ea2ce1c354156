"""Reward functions: a custom one from a file, the built-in task's, or verl's by data_source."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Callable

from rollout import builtin_task

RewardFn = Callable[..., float]


class RewardError(ValueError):
    pass


def _load_custom(path: str, name: str) -> RewardFn:
    file = Path(path)
    if not file.is_file():
        raise RewardError(f"custom_reward_function.path: {path} is not a file")
    spec = importlib.util.spec_from_file_location(f"tandem_custom_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"custom_reward_function.name: {path} has no function {name!r}")
    return fn


def _default(data_source, solution_str, ground_truth, extra_info=None):
    if data_source in builtin_task.DATA_SOURCES:
        return builtin_task.compute_score(data_source, solution_str, ground_truth, extra_info)
    from verl.utils.reward_score import default_compute_score
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)


def resolve_details(path: str | None, name: str) -> Callable[[str, str, object, dict], tuple[float, dict]]:
    """The reward function as f(data_source, solution, ground_truth, extra_info) ->
    (score, extra): `extra` holds the other keys of a function that returns a dict (verl's
    reward_extra_info, e.g. acc or pred), which validation reports as val-aux metrics."""
    fn = _load_custom(path, name) if path else _default

    def score(data_source: str, solution_str: str, ground_truth, extra_info: dict) -> tuple[float, dict]:
        result = fn(data_source, solution_str, ground_truth, extra_info)
        extra = {}
        if isinstance(result, dict):  # verl's functions may return {"score": ..., ...}
            extra = {k: v for k, v in result.items() if k != "score"}
            result = result["score"]
        value = float(result)
        if not math.isfinite(value):
            raise RewardError(f"reward for data_source {data_source!r} is not finite: {value}")
        return value, extra

    return score


def resolve(path: str | None, name: str) -> Callable[[str, str, object, dict], float]:
    details = resolve_details(path, name)
    return lambda *args: details(*args)[0]
