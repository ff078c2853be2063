"""The docs run as written: every ```python block of README.md and docs/ (pages added later
included), the docs site builds with ``mkdocs build --strict`` (every link and anchor), and the
README's shell commands work after ``make demo`` in a fresh clone.

Fragments that cannot run alone are fenced ```text; a fence without a language is refused, so
that nothing escapes the run by accident.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import free_port

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LANGUAGES = {"python", "text", "sh", "bash", "yaml", "json", "promql"}
FENCE = re.compile(r"^([ \t]*)```(\S*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
FENCE_LINE = re.compile(r"^[ \t]*```", re.M)
BLOCK_SECONDS = 120


def blocks(page: Path) -> list[tuple[str, int, str]]:
    """(language, line, code) of each fenced block of ``page``."""
    text = page.read_text()
    return [
        (m.group(2), text.count("\n", 0, m.start()) + 1, textwrap.dedent(m.group(3)))
        for m in FENCE.finditer(text)
    ]


def python_blocks() -> list:
    return [
        pytest.param(code, id=f"{page.relative_to(REPO)}:{line}")
        for page in PAGES
        for language, line, code in blocks(page)
        if language == "python"
    ]


def test_every_block_is_fenced_with_a_known_language():
    for page in PAGES:
        found = blocks(page)
        fences = len(FENCE_LINE.findall(page.read_text()))
        assert 2 * len(found) == fences, f"{page}: an unclosed or nested fence"
        for language, line, _ in found:
            assert language in LANGUAGES, (
                f"{page.relative_to(REPO)}:{line}: fence language "
                f"{language!r}; use python (it is run) or text"
            )


@pytest.mark.parametrize("code", python_blocks())
def test_python_block_runs_as_written(code, tmp_path):
    """Copy, paste, run: a fresh interpreter in an empty folder, nothing but the block."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=BLOCK_SECONDS,
        env=dict(os.environ, PYTHONPATH=""),
    )
    assert done.returncode == 0, (
        f"exit status {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )


def _site_copy(tmp_path: Path) -> Path:
    """docs/ and mkdocs.yml in ``tmp_path`` (a build that may be broken on purpose)."""
    site = tmp_path / "src"
    shutil.copytree(REPO / "docs", site / "docs")
    shutil.copy(REPO / "mkdocs.yml", site / "mkdocs.yml")
    return site


def _build(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(site / "mkdocs.yml"),
            "-d",
            str(site / "site"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_docs_site_builds_strict_and_a_broken_link_fails_it(tmp_path):
    site = _site_copy(tmp_path)
    built = _build(site)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (site / "site" / "python-api" / "index.html").is_file()
    assert (site / "site" / "img" / "demo.png").is_file()
    # The same build with one broken anchor and one missing page must fail: the check is real.
    page = site / "docs" / "demo.md"
    page.write_text(page.read_text() + "\n[x](diagnose.md#no-such-heading) [y](nowhere.md)\n")
    broken = _build(site)
    assert broken.returncode != 0
    assert "no-such-heading" in broken.stderr and "nowhere.md" in broken.stderr


def test_readme_links_point_at_files():
    text = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"


def test_readme_picture_is_a_small_png():
    image = REPO / "docs" / "img" / "demo.png"
    assert "](docs/img/demo.png)" in (REPO / "README.md").read_text()
    data = image.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 150_000


# --------------------------------------------------------------------------- README's shell commands


def _expected_status(line: str) -> int:
    match = re.search(r"#\s*exit status (\d+)", line)
    return int(match.group(1)) if match else 0


def _checked(line: str) -> str:
    """``line`` as a bash step that fails the script unless it exits as its comment says."""
    want = _expected_status(line)
    quoted = line.replace("'", "'\\''")
    return (
        f"{line}\nstatus=$?; if [ $status -ne {want} ]; then echo 'FAILED (exit '$status', "
        f"expected {want}): {quoted}' >&2; exit 1; fi"
    )


def readme_script(text: str, api_port: int, metrics_port: int) -> str:
    """The README's ```sh blocks as one bash script, in order. A block after
    ``<!-- docs-test: background -->`` is a server: started in the background, waited for
    (its /health), and stopped with SIGTERM at the end (exit status 0). The ports 8080 and 9464
    become free ones, and `make demo` gets ``--metrics-port 0``: tests may run beside other
    servers on this machine."""
    steps, server = [], None
    for match in re.finditer(
        r"(<!-- docs-test: background -->\n)?```(?:sh|bash)\n(.*?)^```", text, re.S | re.M
    ):
        lines = [line for line in match.group(2).splitlines() if line.strip() and not line.startswith("#")]
        lines = [line.replace("8080", str(api_port)).replace("9464", str(metrics_port)) for line in lines]
        lines = [re.sub(r"^make demo\b", 'make demo ARGS="--metrics-port 0"', line) for line in lines]
        if match.group(1):
            assert len(lines) == 1, "a background block holds one command"
            server = lines[0]
            steps.append(
                f"{server} > server.log 2>&1 &\nSERVER=$!\n"
                f"for i in $(seq 240); do curl -sf http://127.0.0.1:{api_port}/health >/dev/null && break; "
                "kill -0 $SERVER 2>/dev/null || { echo 'server exited:' >&2; cat server.log >&2; exit 1; }; "
                "sleep 0.5; done"
            )
        else:
            steps += [_checked(line) for line in lines]
    if server is not None:
        steps.append(
            "kill -TERM $SERVER; wait $SERVER; status=$?; "
            '[ $status -eq 0 ] || { echo "server exit status $status" >&2; cat server.log >&2; exit 1; }'
        )
    return "set -u\n" + "\n".join(steps) + "\n"


@pytest.mark.slow
def test_readme_shell_commands_run_after_make_demo_in_a_fresh_clone(tmp_path):
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs the tests to run from the project's virtual environment (make test)")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    # The working tree as it is, not only its last commit: modified and new (not ignored) files.
    changed = subprocess.run(
        ["git", "ls-files", "-m", "-o", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in changed:
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    # The venv `make demo` would create (a minute of pip), lent from this one: its files linked, a
    # stamp of its own newer than the clone's pyproject.toml, so make installs nothing.
    venv = clone / ".venv"
    venv.mkdir()
    for entry in Path(sys.prefix).iterdir():
        if entry.name != ".installed":
            (venv / entry.name).symlink_to(entry)
    (venv / ".installed").touch()
    api_port, metrics_port = free_port(), free_port()
    script = readme_script((REPO / "README.md").read_text(), api_port, metrics_port)
    assert "make demo" in script and ". .venv/bin/activate" in script and "mlx-watchdog serve" in script
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    done = subprocess.run(
        ["bash", "-c", script], cwd=clone, capture_output=True, text=True, timeout=540, env=env
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert "VERDICT: the fix removes the leak" in done.stdout  # make demo ran
    assert (clone / "leak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # diagnose --plot wrote it
    assert '"finish_reason"' in done.stdout and "mlx_watchdog_buffers_per_step{" in done.stdout


def test_readme_script_checks_exit_statuses():
    script = readme_script("```sh\nfalse  # exit status 1\ntrue\n```\n", 1, 2)
    assert subprocess.run(["bash", "-c", script]).returncode == 0
    script = readme_script("```sh\ntrue  # exit status 1\n```\n", 1, 2)
    assert subprocess.run(["bash", "-c", script], capture_output=True).returncode == 1
