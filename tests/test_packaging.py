"""The distribution: the folders map onto `mlx_watchdog`, never onto the name `watchdog`."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_imports_mlx_watchdog_from_this_tree():
    import mlx_watchdog
    import mlx_watchdog.exporters.prometheus as prom

    assert Path(mlx_watchdog.__file__).resolve().parent == ROOT / "watchdog"
    assert Path(prom.__file__).resolve().parent == ROOT / "exporters"


@pytest.mark.slow
def test_wheel_holds_mlx_watchdog_and_imports(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("mlx_watchdog-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mlx_watchdog/__init__.py" in names
    assert "mlx_watchdog/exporters/prometheus.py" in names
    assert not any(n.startswith("watchdog/") or n.startswith("exporters/") for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert (
        "mlx-watchdog = mlx_watchdog.commands.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    )

    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    # Import from the wheel's files only (the tree's editable finder is not on this path).
    probe = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            "import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import mlx_watchdog, mlx_watchdog.exporters.prometheus;"
            "print(mlx_watchdog.__file__)",
            str(target),
            _site_packages(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().startswith(str(target))


def _site_packages() -> str:
    import mlx

    return str(Path(mlx.__path__[0]).parent)
