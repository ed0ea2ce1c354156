"""Extract the config keys of every verl minor release into protocol/verl_releases/*.json.

    python scripts/extract_verl_keys.py --git-dir /work/.mirror/volcengine+verl/repo [--out DIR]
        [--installed]   # also the installed verl package's configs (a release newer than the history)

For each release (RELEASES: a tag, or a branch for an unreleased minor) it writes one JSON file:
  ppo_trainer          every leaf of the full PPO trainer config, dotted key -> value as in the
                       file (interpolations kept): `_generated_ppo_trainer.yaml` where the release
                       has it (with the keys composing adds), else `ppo_trainer.yaml` composed
                       with its Hydra defaults
  sft_trainer          the same for the old SFT config (`sft_trainer.yaml`, composed), if present
  sft_trainer_engine   the same for the new one (`sft_trainer_engine.yaml`, composed), if present
  examples             per script of examples/{grpo_trainer,ppo_trainer}/*.sh and
                       examples/sft/**/*.sh: the entry point and the `key=value` overrides it sets
The files are data for protocol/verl_keys.py (which keys tandem knows, and how each is treated)
and its tests; rerun this script when verl releases a new minor version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

# minor release -> the git ref its newest patch release is at
RELEASES = {
    "0.2": "v0.2.0.post2",
    "0.3": "v0.3.0.post1",
    "0.4": "v0.4.1",
    "0.5": "v0.5.0",
    "0.6": "v0.6.1",
    "0.7": "v0.7.0",
    "0.8.dev": "main",
}
CONFIG_DIR = "verl/trainer/config"
EXAMPLE_GLOBS = (re.compile(r"^examples/(grpo_trainer|ppo_trainer)/[^/]+\.sh$"), re.compile(r"^examples/sft/.+\.sh$"))
# a command-line override: dotted key (Hydra's + / ++ / ~ prefixes allowed) = value
OVERRIDE = re.compile(r"^(?:\+\+|\+|~)?([A-Za-z_][\w-]*(?:\.[\w-]+)+)=(.*)$", re.S)
ENTRY = re.compile(r"-m\s+(verl\.trainer\.[\w.]+)")


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True).stdout


def flatten(d, prefix: str = "") -> dict:
    """Dotted leaves of a nested mapping; an empty mapping is a leaf (its value {})."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def compose(config_dir: str, name: str) -> dict:
    """`name`.yaml of a Hydra config folder with its defaults list applied, unresolved."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        cfg = hydra_compose(config_name=name)
    return OmegaConf.to_container(cfg, resolve=False)


def load(path: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def config_keys(config_dir: str) -> dict:
    """The three config shapes of one release's config folder (those it has)."""
    out = {}
    generated = os.path.join(config_dir, "_generated_ppo_trainer.yaml")
    composed = flatten(compose(config_dir, "ppo_trainer"))
    # the generated file, plus what composing adds to it (a defaults selection such as 0.9's
    # model_engine), for users who compose ppo_trainer.yaml themselves
    out["ppo_trainer"] = {**composed, **flatten(load(generated))} if os.path.exists(generated) else composed
    for name in ("sft_trainer", "sft_trainer_engine"):
        if os.path.exists(os.path.join(config_dir, f"{name}.yaml")):
            out[name] = flatten(compose(config_dir, name))
    return out


def script_overrides(text: str) -> tuple[str, dict[str, str]]:
    """(the verl module the script runs, the key=value overrides on its command lines). Lines
    continued with a backslash are joined; shell syntax that shlex cannot split is skipped line
    by line. Values are kept as written ($VARS unexpanded)."""
    joined = re.sub(r"\\\n", " ", text)
    entry, overrides = "", {}
    for line in joined.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if m := ENTRY.search(line):
            entry = entry or m.group(1)
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for word in words:
            if (m := OVERRIDE.match(word)) and not m.group(1)[0].isupper():
                overrides[m.group(1)] = m.group(2)
    return entry, overrides


def examples(git_dir: str, ref: str) -> dict:
    out = {}
    for path in git(git_dir, "ls-tree", "-r", "--name-only", ref, "examples/").splitlines():
        if any(g.match(path) for g in EXAMPLE_GLOBS):
            entry, overrides = script_overrides(git(git_dir, "show", f"{ref}:{path}"))
            if entry and overrides:
                out[path] = {"entry": entry, "overrides": overrides}
    return out


def from_git(git_dir: str, release: str, ref: str) -> dict:
    sha = git(git_dir, "rev-parse", ref).strip()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "--git-dir", git_dir, "archive", sha, CONFIG_DIR], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        configs = config_keys(os.path.join(tmp, CONFIG_DIR))
    return {
        "release": release,
        "source": f"volcengine/verl {ref} ({sha})",
        **configs,
        "examples": examples(git_dir, sha),
    }


def from_installed() -> tuple[str, dict]:
    import verl

    version = verl.__version__
    release = ".".join(version.split(".")[:2])
    configs = config_keys(os.path.join(os.path.dirname(verl.__file__), "trainer", "config"))
    return release, {
        "release": release,
        "source": f"the verl {version} package (no examples: the package does not ship them)",
        **configs,
        "examples": {},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--git-dir", required=True, help="a clone of volcengine/verl (bare is fine)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "protocol" / "verl_releases"))
    p.add_argument("--installed", action="store_true", help="also the installed verl package")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    found = {release: from_git(args.git_dir, release, ref) for release, ref in RELEASES.items()}
    if args.installed:
        release, data = from_installed()
        found[release] = data
    for release, data in found.items():
        path = os.path.join(args.out, f"{release}.json")
        with open(path, "w") as f:
            json.dump(data, f, indent=0, sort_keys=True)
            f.write("\n")
        shapes = {k: len(v) for k, v in data.items() if k in ("ppo_trainer", "sft_trainer", "sft_trainer_engine")}
        print(f"{path}: {shapes}, {len(data['examples'])} example scripts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
