"""The distribution: the folders map onto `mlx_watchdog`, never onto the name `watchdog`.

watchdog/ is installed as ``mlx_watchdog`` and exporters/ as ``mlx_watchdog.exporters``, with
every subpackage (core, attach, commands, tiny) and the py.typed marker; the command is
``mlx_watchdog.commands.main:main``."""

import concurrent.futures
import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support import missing

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("core", "attach", "commands", "tiny", "exporters")
ENTRY_POINT = "mlx_watchdog.commands.main:main"
# What a checkout may hold besides its files: a wheel built from a copy without them is the
# wheel of a fresh clone (a stale build/lib would add the modules of an older layout).
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", ".venv-*", ".cache", "build", "dist", "site", "*.egg-info", "__pycache__"
)


def _installed_names() -> set[str]:
    """The files the wheel must hold, named as installed: watchdog/X -> mlx_watchdog/X,
    exporters/X -> mlx_watchdog/exporters/X."""
    names = {"mlx_watchdog/py.typed", "mlx_watchdog/core/process_count.c"}  # the C source the count builds
    for folder, package in (("watchdog", "mlx_watchdog"), ("exporters", "mlx_watchdog/exporters")):
        for path in (ROOT / folder).rglob("*.py"):
            names.add(f"{package}/{path.relative_to(ROOT / folder).as_posix()}")
    return names


def test_the_tree_has_every_subpackage_and_the_typed_marker():
    names = _installed_names()
    for sub in SUBPACKAGES:
        assert f"mlx_watchdog/{sub}/__init__.py" in names
    assert (ROOT / "watchdog" / "py.typed").is_file()


def test_editable_install_maps_the_package_onto_this_tree():
    import importlib

    import mlx_watchdog
    import mlx_watchdog.exporters.prometheus as prom

    assert Path(mlx_watchdog.__file__).resolve().parent == ROOT / "watchdog"
    assert Path(prom.__file__).resolve().parent == ROOT / "exporters"
    for sub in SUBPACKAGES:
        module = importlib.import_module(f"mlx_watchdog.{sub}")
        folder = ROOT / "exporters" if sub == "exporters" else ROOT / "watchdog" / sub
        assert Path(module.__file__).resolve() == folder / "__init__.py", sub


@pytest.mark.slow
def test_wheel_holds_mlx_watchdog_and_imports(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("mlx_watchdog-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = configparser.ConfigParser()
        entry_points.read_string(
            archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
        )
    package_files = {n for n in names if n.startswith("mlx_watchdog/")}
    assert package_files == _installed_names(), (
        f"missing: {sorted(_installed_names() - package_files)}; "
        f"extra: {sorted(package_files - _installed_names())}"
    )
    assert not any(n.startswith("watchdog/") or n.startswith("exporters/") for n in names)
    assert dict(entry_points["console_scripts"]) == {"mlx-watchdog": ENTRY_POINT}

    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    # Import from the wheel's files only (the tree's editable finder is not on this path).
    modules = [
        "mlx_watchdog",
        *(f"mlx_watchdog.{sub}" for sub in SUBPACKAGES),
        "mlx_watchdog.exporters.prometheus",
    ]
    module_path, function = ENTRY_POINT.split(":")
    probe = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            "import importlib, sys; sys.path[:0] = sys.argv[1:3]\n"
            "for name in sys.argv[3:]: print(importlib.import_module(name).__file__)\n"
            f"assert callable(importlib.import_module({module_path!r}).{function})",
            str(target),
            _site_packages(),
            *modules,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    files = probe.stdout.split()
    assert len(files) == len(modules) and all(f.startswith(str(target)) for f in files), files


def _site_packages() -> str:
    import mlx

    return str(Path(mlx.__path__[0]).parent)


# --------------------------------------------------------------------------- beside the servers

# The servers of docs/servers.md that PyPI has, at the versions the page names: their pins of mlx
# and mlx-lm decide ours (mlx-openai-server, through mflux 0.17, and mlx-omni-server, which the
# page does not list but users run, require mlx < 0.32 on macOS; vllm-mlx and Rapid-MLX mlx-lm
# < 0.32). Not here: oMLX (GitHub jundot/omlx) and LM Studio's mlx-engine (GitHub
# lmstudio-ai/mlx-engine) are not on PyPI; each installs from its repository, with mlx-lm (and
# mlx-vlm) at git commits that only a clone of theirs resolves.
SERVERS = {
    "mlx_lm.server": "mlx-lm==0.32.2",
    "vllm-mlx": "vllm-mlx==0.6.0",
    "mlx-vlm": "mlx-vlm==0.7.10",
    "mlx-openai-server": "mlx-openai-server==1.8.1",
    "Rapid-MLX": "rapid-mlx==0.16.10",
    "mlx-omni-server": "mlx-omni-server==0.5.3",
}
# Where the resolution is checked: Apple silicon (macOS 14, the oldest macOS MLX ships wheels for),
# where every server runs; for the two the tests run (tests/peers), also this machine and the
# oldest Python the package supports.
TARGETS = {
    "macos": ["--python-platform", "aarch64-apple-darwin", "--python-version", "3.12"],
    "here": [],
    "macos-3.10": ["--python-platform", "aarch64-apple-darwin", "--python-version", "3.10"],
}
PACKAGE = f"mlx-watchdog @ {ROOT.as_uri()}"
CASES = {
    **{(server, "macos"): ([PACKAGE, pin], "macos", ()) for server, pin in SERVERS.items()},
    **{
        (s, t): ([PACKAGE, SERVERS[s]], t, ())
        for s in ("vllm-mlx", "mlx-vlm")
        for t in ("here", "macos-3.10")
    },
    # The check can fail: mlx-lm >= 0.32 (this package's pin before 0.31 was supported) beside
    # vllm-mlx, which pins mlx-lm < 0.32; mlx >= 0.32.4 (its pin before mlx 0.31.2 was) beside
    # mlx-openai-server.
    ("conflict: mlx-lm>=0.32.2", "here"): ([PACKAGE, SERVERS["vllm-mlx"]], "here", ("mlx-lm>=0.32.2",)),
    ("conflict: mlx>=0.32.4", "macos"): ([PACKAGE, SERVERS["mlx-openai-server"]], "macos", ("mlx>=0.32.4",)),
}


def _resolve(folder: Path, requirements: list[str], target: str, constraints=()):
    """``uv pip compile`` of ``requirements`` for ``target``: metadata only (uv reads a wheel's
    METADATA with range requests where the index serves no PEP 658 file; pip downloads every
    wheel, ~1 GB here, torch's CUDA build too). Returns (exit status, resolved pins, stderr)."""
    uv = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    if uv is None:
        return None, {}, "uv is not installed (it comes with the test extras: pip install -e '.[test]')"
    folder.mkdir(parents=True)
    (folder / "requirements.in").write_text("\n".join(requirements) + "\n")
    (folder / "constraints.txt").write_text("\n".join(constraints) + "\n")
    command = [uv, "pip", "compile", "--quiet", "--no-header", "--python", sys.executable]
    command += [*TARGETS[target], "--constraint", str(folder / "constraints.txt")]
    try:
        result = subprocess.run(
            [*command, str(folder / "requirements.in")],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "MACOSX_DEPLOYMENT_TARGET": "14.0"},
        )
    except subprocess.TimeoutExpired:
        return None, {}, "uv pip compile took more than 300 s"
    pins = dict(
        line.split("==", 1)
        for line in result.stdout.splitlines()
        if "==" in line and not line.startswith(" ")
    )
    return result.returncode, pins, result.stderr


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory):
    """Every case resolved at once, a few at a time: each waits on the index more than it computes
    (one case alone: 15-30 s here, its cache warm or not)."""
    folder = tmp_path_factory.mktemp("resolve")
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            case: pool.submit(_resolve, folder / f"case{i}", *arguments)
            for i, (case, arguments) in enumerate(CASES.items())
        }
        return {case: future.result() for case, future in futures.items()}


def _resolved(resolutions, case):
    status, pins, stderr = resolutions[case]
    if status is None or (status != 0 and "No solution found" not in stderr):
        missing(f"uv could not resolve from PyPI (offline?): {stderr[-1000:]}")
    return status, pins, stderr


@pytest.mark.parametrize("server, target", [case for case in CASES if not case[0].startswith("conflict")])
def test_the_package_installs_beside_the_servers_users_run(resolutions, server, target):
    status, pins, stderr = _resolved(resolutions, (server, target))
    assert status == 0, stderr[-3000:]
    name, version = SERVERS[server].split("==")
    assert pins[name] == version and "mlx-lm" in pins and "mlx" in pins, pins
    # torch (vllm-mlx's torchvision) resolved from its metadata, never downloaded: see _resolve.


def test_mlx_0_31_is_what_the_servers_that_pin_mlx_below_0_32_get(resolutions):
    for server in ("mlx-openai-server", "mlx-omni-server"):
        _, pins, _ = _resolved(resolutions, (server, "macos"))
        assert pins and pins["mlx"].startswith("0.31."), (server, pins)


@pytest.mark.parametrize("case", [case for case in CASES if case[0].startswith("conflict")])
def test_a_pin_that_conflicts_with_a_server_is_found(resolutions, case):
    status, _, stderr = _resolved(resolutions, case)
    version = CASES[case][2][0].split(">=")[1]  # uv names the bound it could not meet
    assert status != 0 and "No solution found" in stderr and version in stderr, stderr[-3000:]
