"""Reward functions: a custom one from a file, the built-in task's, or verl's by data_source."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path

from rollout import builtin_task

RewardFn = Callable[..., float]
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max


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


def verl_handles(data_source: str) -> bool:
    """Whether verl's `default_compute_score` has a reward for `data_source`, decided without
    scoring anything (some of its rewards run code or call a sandbox): its body is an if/elif
    chain on `data_source` ending in NotImplementedError, so each condition is evaluated alone.
    A condition that needs anything else counts as a match (the first scoring decides then)."""
    import ast
    import inspect
    import textwrap

    from verl.utils.reward_score import default_compute_score

    function = ast.parse(textwrap.dedent(inspect.getsource(default_compute_score))).body[0]
    body = function.body if isinstance(function, ast.FunctionDef) else []
    node: ast.stmt | None = next((n for n in body if isinstance(n, ast.If)), None)
    if node is None:
        return True  # not the shape we know: let the first scoring decide
    while isinstance(node, ast.If):
        try:
            if eval(
                compile(ast.Expression(node.test), "<verl condition>", "eval"),  # noqa: S307
                {"__builtins__": {}},
                {"data_source": data_source},
            ):
                return True
        except Exception:  # noqa: BLE001 - a condition on something else: assume it may match
            return True
        node = node.orelse[0] if len(node.orelse) == 1 else None
    return False


def check_data_sources(sources: dict[str, str], custom_path: str | None) -> None:
    """At start, before any engine loads: every data_source of the dataset (value -> file
    naming it) has a reward function. A custom function is trusted with all of them."""
    if custom_path:
        return
    for source, file in sources.items():
        if source not in builtin_task.DATA_SOURCES and not verl_handles(source):
            raise RewardError(
                f"data_source {source!r} (in {file}) has no reward function: it is neither the "
                f"built-in task's ({', '.join(sorted(builtin_task.DATA_SOURCES))}) nor one of "
                "verl's default_compute_score; set custom_reward_function.path"
            )


def resolve_details(path: str | None, name: str) -> Callable[[str, str, object, dict], tuple[float, dict]]:
    """The reward function as f(data_source, solution, ground_truth, extra_info) ->
    (score, extra): `extra` holds the other keys of a function that returns a dict (verl's
    reward_extra_info, e.g. acc or pred), which validation reports as val-aux metrics. The
    score is a float that float32 (the shard's column) holds; RewardError for anything else:
    the caller drops that one sample."""
    fn = _load_custom(path, name) if path else _default

    def score(data_source: str, solution_str: str, ground_truth, extra_info: dict) -> tuple[float, dict]:
        result = fn(data_source, solution_str, ground_truth, extra_info)
        extra = {}
        if isinstance(result, dict) and "score" in result:  # verl's may return {"score": ...}
            extra = {k: v for k, v in result.items() if k != "score"}
            result = result["score"]
        return check_value(result, data_source), extra

    return score


def resolve(path: str | None, name: str) -> Callable[[str, str, object, dict], float]:
    details = resolve_details(path, name)
    return lambda *args: details(*args)[0]


def check_value(result, data_source: str) -> float:
    """A reward function's result (a number; verl's may return {"score": ...}) as a float."""
    try:
        if isinstance(result, (str, bytes)):  # float("nan") must not sneak in as text
            raise TypeError("text")
        value = float(result)
    except (TypeError, ValueError, OverflowError) as e:
        raise RewardError(f"reward for data_source {data_source!r} is not a number: {result!r} ({e})") from None
    if not math.isfinite(value):
        raise RewardError(f"reward for data_source {data_source!r} is not finite: {value}")
    if abs(value) > FLOAT32_MAX:  # it would become inf in the shard's float32 column
        raise RewardError(
            f"reward for data_source {data_source!r} is out of range: {value:g} "
            f"(|reward| must be at most {FLOAT32_MAX:g}, float32)"
        )
    return value


def model_client(stores, rm):
    """The client of the run's reward servers when `rm` (reward_model) is enabled, else None:
    what a worker and the validator score with (stores: their WorkerRun)."""
    if not rm.enable:
        return None
    return stores.reward_client(rm.addresses, rm.wait_s, rm.call_timeout_s, rm.max_inflight)
