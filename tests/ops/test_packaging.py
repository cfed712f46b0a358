"""Packaging and documentation: what is installed, what CI runs, what the README and
docs/configuration.md promise."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
CONFIGURATION = REPO / "docs" / "configuration.md"
DURABILITY = REPO / "docs" / "durability.md"
QUICKSTART_COMMANDS = ("sudo bash packaging/quickstart.sh", "sudo bash packaging/test.sh")
LONG_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
ROW_ID = re.compile(r"\bD\d{1,3}\b")


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `code` in an isolated interpreter of this environment (no cwd, no PYTHONPATH)."""
    return subprocess.run([sys.executable, "-I", "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def _mount_help() -> str:
    script = Path(sys.executable).parent / "lakefs-mount"
    command = [str(script)] if script.exists() else [shutil.which("lakefs-mount") or "lakefs-mount"]
    result = subprocess.run([*command, "mount", "--help"], capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_distribution_installs_no_top_level_cache_cli_or_uring_package(tmp_path):
    result = _run_python(
        "import importlib.util\n"
        "print([n for n in ('cache', 'cli', 'uring') if importlib.util.find_spec(n)])",
        tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_cache_uring_and_cli_import_inside_the_lakefs_mount_namespace(tmp_path):
    result = _run_python(
        "import lakefs_mount.cache.journal, lakefs_mount.uring, lakefs_mount.cli.main\n"
        "print(lakefs_mount.cli.main.cli.name)", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "lakefs-mount"


def test_a_plain_checkout_imports_the_card_folders_under_one_name_each(tmp_path):
    """No install needed to follow an import: lakefs_mount.cache is the top-level cache/."""
    result = _run_python(
        f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
        "import lakefs_mount.cache.journal as j, lakefs_mount.uring.ring as r\n"
        "import lakefs_mount.cli.main as c, lakefs_mount.s3.layout as s\n"
        "print(j.__file__, r.__file__, c.__file__, s.__file__)", tmp_path)
    assert result.returncode == 0, result.stderr
    paths = [Path(p) for p in result.stdout.split()]
    assert [p.resolve().relative_to(REPO).as_posix() for p in paths] == [
        "cache/journal.py", "uring/ring.py", "cli/main.py", "lakefs_mount/s3/layout.py"]
    assert all(p.is_relative_to(REPO / "lakefs_mount") for p in paths)


# docs/architecture.md: each layer (a folder of lakefs_mount/) imports only those below it.
LAYERS = {"cli": 7, "api": 7, "daemon": 6, "fuse": 5, "publish": 5, "fs": 4, "ops": 3,
          "namespace": 3, "cache": 2, "s3": 1, "base": 0}
BASE = ("metrics", "logsetup", "config", "filespan", "concurrency", "uring")


def _layer(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts or parts[0] in BASE:
        return "base"
    return parts[0]


def test_the_top_of_lakefs_mount_holds_few_modules_and_every_folder_is_a_layer():
    top = {p.stem for p in (REPO / "lakefs_mount").glob("*.py")} - {"__init__"}
    folders = {p.name for p in (REPO / "lakefs_mount").iterdir()
               if p.is_dir() and p.name != "__pycache__"}
    assert len(top) <= 12, sorted(top)
    assert top - set(BASE) <= {"api"}
    assert folders == set(LAYERS) - {"api", "base"} | {"uring"}


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    paths = [(path, ("lakefs_mount", *path.relative_to(REPO).with_suffix("").parts))
             for folder in ("cache", "uring", "cli") for path in (REPO / folder).rglob("*.py")]
    paths += [(path, path.relative_to(REPO).with_suffix("").parts)
              for path in (REPO / "lakefs_mount").rglob("*.py")]  # (symlinks not followed)
    assert len(paths) > 50
    for path, parts in paths:
        module = ".".join(parts)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if (name.startswith("lakefs_mount.")
                        and LAYERS[_layer(name)] > LAYERS[_layer(module)]):
                    upward.append(f"{module} -> {name}")
    assert upward == []


def test_ci_run_executes_the_readme_test_command():
    ci_run = (REPO / ".ci" / "run").read_text()
    lines = [line.strip() for line in ci_run.splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert ci_run.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in lines
    assert lines[-1] == "exec bash packaging/test.sh"
    assert f"```sh\n{QUICKSTART_COMMANDS[0]}\n{QUICKSTART_COMMANDS[1]}\n```" in README.read_text()


@pytest.mark.parametrize("script", ["setup.sh", "quickstart.sh", "test.sh"])
def test_packaging_script_is_valid_bash(script):
    path = REPO / "packaging" / script
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr


def test_test_script_treats_no_collected_tests_as_failure():
    text = (REPO / "packaging" / "test.sh").read_text()
    assert '-m pytest "${args[@]}"' in text and "args=(-q -ra --timeout=600" in text
    assert "paths=(tests)" in text  # the whole suite unless told a slice or --fast
    assert re.search(r"^\s*5\).*exit 1", text, re.MULTILINE)


def test_configuration_doc_documents_every_long_option_of_mount():
    options = sorted(set(LONG_OPTION.findall(_mount_help().split("Options:", 1)[1])))
    assert len(options) >= 15, options  # the parse found the option list
    doc = CONFIGURATION.read_text()
    missing = [o for o in options if not re.search(re.escape(o) + r"(?![\w-])", doc)]
    assert not missing, f"docs/configuration.md does not document: {missing}"


def test_durability_rows_are_unique_and_every_cited_row_exists():
    table = [line for line in DURABILITY.read_text().splitlines() if line.startswith("| D")]
    ids = [line.split("|")[1].strip() for line in table]
    assert ids[:3] == ["D1", "D2", "D3"]
    assert len(ids) == len(set(ids)), ids
    cited = {
        (path.name, row)
        for path in (REPO / "tests").rglob("test_*.py") if path.name != Path(__file__).name
        for row in ROW_ID.findall(path.read_text())
    }
    unknown = sorted(c for c in cited if c[1] not in ids)
    assert not unknown, f"tests cite rows that docs/durability.md lacks: {unknown}"


MACHINE_STATE = ("/etc/fstab", "PIPE_MAX_SIZE", "fuse_device_for", "throwaway_user",
                 "suite.py")  # what a test may change that the whole machine shares


def test_tests_that_change_what_the_machine_shares_run_one_at_a_time():
    """The full suite runs in two xdist workers; a module that touches machine-wide state
    holds the `machine` lock (tests/conftest.py) in each of its tests."""
    mark = 'pytestmark = pytest.mark.usefixtures("machine")'
    unmarked = [
        str(path.relative_to(REPO)) for path in sorted((REPO / "tests").rglob("test_*.py"))
        if any(word in path.read_text() for word in MACHINE_STATE)
        and path.name != "test_packaging.py" and mark not in path.read_text()]
    assert not unmarked, f"modules changing machine-wide state without the mark: {unmarked}"
