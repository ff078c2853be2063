"""The peer servers' environments for tests/test_peers.py and tests/test_peers_rapid.py, built
once and reused.

    python tests/peers/envs.py                  # build them (or find them), print each Python and the time
    python tests/peers/envs.py --env rapid-mlx  # only one of them
    python tests/peers/envs.py --force          # build them again

Two environments, each from PyPI exactly as its requirements file lists it (installed with
--no-deps: no resolution, the same on every machine; each file says why the servers' own
dependency lists are not used): ``servers`` holds vllm-mlx and mlx-vlm's server
(requirements.txt), ``rapid-mlx`` holds Rapid-MLX (requirements-rapid.txt), which installs a
module ``vllm_mlx`` of its own and so cannot share vllm-mlx's. Each lives outside the clone, under
``$MLX_WATCHDOG_PEERS_CACHE`` (default ``~/.cache/mlx-watchdog/peers``), in a folder named after
the environment and a stamp of its pins, the Python and the machine: a second run, or another
clone, reuses it; a changed pin builds a new one. A folder is complete once its ``.complete`` file
exists; builders take a lock, so two test runs never build the same folder at once.

Installs go through uv when it can be had (on PATH, importable, or installed once with pip into
the cache folder), else through pip. This checkout's mlx-watchdog is not in the environment:
:func:`install_checkout` puts it (``--no-deps``) in a folder of the test session, on the servers'
PYTHONPATH, so a shared environment never runs another clone's code.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent.parent


@dataclass(frozen=True)
class Environment:
    """One environment: its folder's name, its pins and the imports that prove it built."""

    name: str
    requirements: Path
    imports: str


ENVIRONMENTS = {
    e.name: e
    for e in (
        # vllm-mlx and mlx-vlm co-install: one environment for both
        Environment("servers", HERE / "requirements.txt", "vllm_mlx.server, mlx_vlm.server.app, mlx_lm"),
        # Rapid-MLX's module is named vllm_mlx too: an environment of its own
        Environment(
            "rapid-mlx", HERE / "requirements-rapid.txt", "rapid_mlx.server, vllm_mlx.server, mlx_lm"
        ),
    )
}
SERVERS = ENVIRONMENTS["servers"]
REQUIREMENTS = SERVERS.requirements
CACHE_ENV = "MLX_WATCHDOG_PEERS_CACHE"
UV_PIN = "uv==0.13.9"
COMPLETE = ".complete"


class InstallError(RuntimeError):
    """The environment could not be built; the message says which step failed and its output."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlx-watchdog" / "peers")


def stamp(requirements: Path = REQUIREMENTS) -> str:
    """What the environment depends on: the pins, the Python (version and build) and the machine."""
    key = b"\n".join(
        [
            requirements.read_bytes(),
            platform.python_implementation().encode(),
            ".".join(map(str, sys.version_info[:3])).encode(),
            platform.machine().encode(),
            sys.platform.encode(),
        ]
    )
    return hashlib.sha256(key).hexdigest()[:12]


def env_dir(root: Path | None = None, environment: Environment = SERVERS) -> Path:
    return (root or cache_root()) / f"{environment.name}-{stamp(environment.requirements)}"


def python_of(env: Path) -> Path:
    return env / "bin" / "python"


def _run(cmd: list[str], what: str, env: dict | None = None) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise InstallError(
            f"{what} failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def uv(root: Path | None = None) -> list[str] | None:
    """A command that runs uv: on PATH, importable here, or installed with pip into the cache
    folder (once); None when none of these works (pip is used then)."""
    found = shutil.which("uv")
    if found:
        return [found]
    with contextlib.suppress(ImportError):
        import uv as uv_module  # the PyPI package ships the binary

        return [uv_module.find_uv_bin()]
    tool = (root or cache_root()) / f"tool-{UV_PIN.replace('==', '-')}"
    binary = tool / "bin" / "uv"
    with _locked(tool.parent / f"{tool.name}.lock"):
        if not binary.exists():
            try:
                _run(
                    [sys.executable, "-m", "pip", "install", "-q", "--target", str(tool), UV_PIN],
                    "installing uv with pip",
                )
            except InstallError:
                shutil.rmtree(tool, ignore_errors=True)
                return None
    return [str(binary)]


def build(env: Path, installer: list[str] | None, environment: Environment = SERVERS) -> None:
    """A fresh environment at ``env`` with ``environment``'s requirements installed, --no-deps."""
    requirements = environment.requirements
    shutil.rmtree(env, ignore_errors=True)
    if installer is not None:
        _run([*installer, "venv", "-q", "-p", sys.executable, str(env)], "creating the environment (uv venv)")
        _run(
            [
                *installer,
                "pip",
                "install",
                "-q",
                "-p",
                str(python_of(env)),
                "--no-deps",
                "-r",
                str(requirements),
            ],
            f"installing {requirements.name} (uv)",
        )
    else:
        _run([sys.executable, "-m", "venv", str(env)], "creating the environment (venv)")
        _run(
            [str(python_of(env)), "-m", "pip", "install", "-q", "--no-deps", "-r", str(requirements)],
            f"installing {requirements.name} (pip)",
        )
    _run(
        [str(python_of(env)), "-W", "ignore::DeprecationWarning", "-c", f"import {environment.imports}"],
        f"importing the servers in the new environment ({environment.name})",
    )
    (env / COMPLETE).write_text(requirements.read_text())


def ensure(root: Path | None = None, *, force: bool = False, environment: Environment = SERVERS) -> Path:
    """The environment's folder, built first when missing, incomplete or ``force``."""
    env = env_dir(root, environment)
    with _locked(env.parent / f"{env.name}.lock"):
        if force or not (env / COMPLETE).exists():
            build(env, uv(root), environment)
    return env


def install_checkout(env: Path, target: Path) -> None:
    """This checkout's mlx-watchdog (--no-deps) into ``target``, for the servers' PYTHONPATH."""
    installer = uv()
    python = str(python_of(env))
    if installer is not None:
        cmd = [
            *installer,
            "pip",
            "install",
            "-q",
            "-p",
            python,
            "--no-deps",
            "--target",
            str(target),
            str(CHECKOUT),
        ]
    else:
        cmd = [python, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(CHECKOUT)]
    _run(cmd, "installing this checkout's mlx-watchdog")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, help=f"the cache folder (default ${CACHE_ENV} or ~/.cache/...)")
    parser.add_argument("--force", action="store_true", help="build the environments again")
    parser.add_argument(
        "--env", action="append", choices=list(ENVIRONMENTS), help="only this environment (default: all)"
    )
    args = parser.parse_args(argv)
    failed = 0
    for name in args.env or list(ENVIRONMENTS):
        started = time.monotonic()
        try:
            env = ensure(args.root, force=args.force, environment=ENVIRONMENTS[name])
        except InstallError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            failed = 1
            continue
        print(f"{name}: {python_of(env)}  ({time.monotonic() - started:.1f} s)")
    return failed


if __name__ == "__main__":
    sys.exit(main())
