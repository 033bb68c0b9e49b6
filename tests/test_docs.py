"""The documentation cannot rot: the site builds strictly (and a broken link fails it), the README's
links land, and the examples in the docs run against the code as it is.

Marked blocks (an HTML comment on the line before a fenced block, in README.md and docs/*.md):
- `<!-- docs-check: run -->`: every `miles-lora-ckpt ...` line runs, in this process, against a
  checkpoint root this test builds (`/ckpt/my-run` stands for it), and must exit 0;
- `<!-- docs-check: synopsis -->`: every `miles-lora-ckpt COMMAND ...` entry names exactly the
  flags the CLI's parser has for that command, and every command is there;
- `<!-- docs-check: python -->`: the block runs as it is, in an empty directory.
Every other Python block is checked statically: what it imports from `miles_lora_ckpt` exists,
and the keywords it passes to those functions are parameters they take.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles_lora_ckpt.tools.cli import build_parser
from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness.commands import build_parser as build_harness_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PACKAGE = REPO / "miles_lora_ckpt"
HARNESS = REPO / "harness" / "miles_lora_ckpt_harness"  # the harness distribution
PAGES = sorted(p for p in DOCS.glob("*.md"))
SOURCES = [REPO / "README.md", *PAGES]
MARKED = re.compile(r"<!-- docs-check: (\w+) -->\n([ \t]*)```(\w*)\n(.*?)\n\2```", re.DOTALL)
FENCED = re.compile(r"^([ \t]*)```(\w*)\n(.*?)\n\1```", re.DOTALL | re.MULTILINE)
PLACEHOLDER = "/ckpt/my-run"


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built strictly from the repository's docs/ and mkdocs.yml."""
    out = tmp_path_factory.mktemp("site")
    built = mkdocs_build(REPO / "mkdocs.yml", out)
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def marked_blocks(kind: str) -> list[tuple[str, str]]:
    """`(source file name, block text)` of every block marked `docs-check: <kind>`."""
    found = []
    for path in SOURCES:
        for match in MARKED.finditer(path.read_text()):
            if match.group(1) == kind:
                indent = match.group(2)
                body = "\n".join(line.removeprefix(indent) for line in match.group(4).splitlines())
                found.append((path.name, body))
    return found


# --------------------------------------------------------------------------- the site


def test_the_site_builds_strictly(site):
    for page in PAGES:
        assert (site / page.with_suffix(".html").name).is_file(), page.name
    assert not (site / "incoming").exists()  # other contributors' drafts stay out of the site


def test_a_broken_link_or_anchor_fails_the_strict_build(tmp_path):
    """Negative control: the same docs with one broken link (or anchor) must not build."""
    copy = tmp_path / "copy"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    drafts = copy / "docs" / "incoming"
    drafts.mkdir(exist_ok=True)
    (drafts / "a-draft.md").write_text("A draft may link [anywhere](nowhere.md).\n")  # excluded: no harm
    clean = mkdocs_build(copy / "mkdocs.yml", tmp_path / "clean")
    assert clean.returncode == 0, clean.stdout + clean.stderr

    page = copy / "docs" / "guarantees.md"
    original = page.read_text()
    for broken, says in (
        ("[the format](file-formats.md)", "file-formats.md"),  # a page that does not exist
        ("[the format](file-format.md#no-such-section)", "no-such-section"),  # an anchor that does not
        ("[above](#no-such-heading)", "no-such-heading"),  # an anchor of the same page
    ):
        page.write_text(original + f"\nSee {broken}.\n")
        failed = mkdocs_build(copy / "mkdocs.yml", tmp_path / "broken")
        assert failed.returncode != 0, broken
        assert says in failed.stdout + failed.stderr and "strict mode" in failed.stdout + failed.stderr
    page.write_text(original)
    (copy / "docs" / "orphan.md").write_text("# A page nobody put in the nav\n")
    failed = mkdocs_build(copy / "mkdocs.yml", tmp_path / "orphan")
    assert failed.returncode != 0 and "orphan.md" in failed.stdout + failed.stderr


def test_make_builds_the_docs_strictly():
    """`make lint` (so `make test`) and `make docs` run the strict build, without --quiet (which hides
    the warnings --strict counts: a broken link would pass)."""
    builds = [line for line in (REPO / "Makefile").read_text().splitlines() if "mkdocs build" in line and "\t" in line]
    assert len(builds) == 2
    for line in builds:
        assert "--strict" in line and "--quiet" not in line and " -q" not in line, line
    lint = (REPO / "Makefile").read_text().split("\nlint:")[1].split("\n\n")[0]
    assert "mkdocs build --strict" in lint
    assert re.search(r"^test: .*\blint\b", (REPO / "Makefile").read_text(), re.MULTILINE)


def test_the_readmes_links_land(site):
    """The README is outside the site: its links into docs/ are checked here, anchors included."""
    links = re.findall(r"\]\(([^)\s]+)\)", (REPO / "README.md").read_text())
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len([link for link in local if link.startswith("docs/")]) >= 12
    for link in local:
        target, _, anchor = link.partition("#")
        assert (REPO / target).exists(), link
        if anchor:
            assert target.startswith("docs/") and target.endswith(".md"), link
            html = (site / Path(target).with_suffix(".html").name).read_text()
            assert f'id="{anchor}"' in html, link


def test_docs_named_in_code_configs_and_help_exist():
    """Every `docs/<page>.md` the package, the configs, the Makefile or the CLI's help texts name is a
    page; the package refers to the docs, not to the README, for what moved there."""
    texts = {str(p.relative_to(REPO)): p.read_text() for root in (PACKAGE, HARNESS) for p in root.rglob("*.py")}
    texts.update({str(p.relative_to(REPO)): p.read_text() for p in (REPO / "configs").iterdir() if p.is_file()})
    texts["Makefile"] = (REPO / "Makefile").read_text()
    texts["--help"] = build_parser().format_help()
    texts.update({f"{name} --help": sub.format_help() for name, sub in command_parsers().items()})
    assert "docs/cli.md" in texts["--help"]
    for where, text in texts.items():
        for page in re.findall(r"docs/([\w-]+\.md)", text):
            assert (DOCS / page).is_file(), f"{where} names docs/{page}"
        if where.startswith("miles_lora_ckpt/"):
            assert "README" not in text, f"{where} refers to the README; the documentation is in docs/"


# --------------------------------------------------------------------------- examples that run


def make_root(root: Path) -> None:
    """A save root with three generations, as the protocol writes them (single process, no megatron)."""
    import torch

    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.core.layout import Topology
    from miles_lora_ckpt.core.protocol import save_generation

    root.mkdir(parents=True)
    for iteration in (1, 2, 3):

        def write(writer, iteration=iteration):
            writer.write_tensors(
                "adapter/dense_tp000_pp000.safetensors",
                {"chunk0.decoder.layers.0.linear.adapter.linear_in.weight": torch.full((2, 4), float(iteration))},
                binding={"role": "dense-adapter", "coordinate": "tp000_pp000"},
            )
            state = {
                "iteration": iteration,
                "generation": writer.generation,
                "scheduler": {
                    "num_steps": iteration,
                    "max_lr": 1e-3,
                    "min_lr": 1e-5,
                    "lr_warmup_steps": 2,
                    "lr_decay_steps": 100,
                    "lr_decay_style": "cosine",
                },
            }
            writer.write_json("training_state.json", state, binding={"role": "training-state"})

        save_generation(
            Consensus.single_process(),
            root,
            iteration=iteration,
            saver="docs-example",
            topology=Topology(),
            write_files=write,
        )


def test_command_examples_run_against_a_real_root(tmp_path, capsys):
    blocks = marked_blocks("run")
    assert {name for name, _ in blocks} >= {"README.md", "cli.md", "use-with-miles.md"}
    base = tmp_path / "ckpt" / "my-run"
    make_root(base / "lora")
    ran = 0
    for name, block in blocks:
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if not argv:
                continue
            assert argv[0] == "miles-lora-ckpt", f"{name}: a run block holds only miles-lora-ckpt commands: {line}"
            argv = [arg.replace(PLACEHOLDER, str(base)) for arg in argv[1:]]
            code = cli(argv)
            out = capsys.readouterr()
            assert code == 0, f"{name}: `{line}` exited {code}: {out.out}{out.err}"
            assert "Traceback" not in out.out + out.err
            ran += 1
    assert ran >= 10


def test_the_installed_command_answers_help():
    command = shutil.which("miles-lora-ckpt", path=str(Path(sys.executable).parent))
    assert command, "the miles-lora-ckpt console script is not installed next to this Python"
    helped = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "docs/cli.md" in helped.stdout, helped.stderr


FLAG = re.compile(r"--(\[no-\])?([a-z][a-z0-9-]*)")
COMMON = {"--debug", "--hmac-key-file"}  # documented on the first line, given before or after the command


def documented_flags(text: str) -> set[str]:
    flags = set()
    for negatable, name in FLAG.findall(text):
        flags.add(f"--{name}")
        if negatable:
            flags.add(f"--no-{name}")
    return flags


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser: the plugin CLI's, with `demo` and `bench` as the harness parses them (the
    plugin's CLI hands their arguments to the harness unparsed)."""

    def choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    return {**choices(build_parser()), **choices(build_harness_parser())}


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")} - {"--help"}


def test_the_cli_synopsis_names_exactly_the_parsers_flags():
    blocks = marked_blocks("synopsis")
    assert [name for name, _ in blocks] == ["cli.md"]
    entries: dict[str, str] = {}
    current = None
    for line in blocks[0][1].splitlines():
        if line.startswith("miles-lora-ckpt "):
            words = line.split()
            current = "" if words[1].startswith("[") else words[1]
            entries[current] = line
        elif current is not None and line.startswith(" "):
            entries[current] += "\n" + line
    parser = build_parser()
    commands = command_parsers()
    assert set(entries) == {"", *commands}, "every command has a synopsis entry, and only they do"
    assert documented_flags(entries[""]) == parser_flags(parser)
    for name, sub in commands.items():
        assert documented_flags(entries[name]) == parser_flags(sub) - COMMON, name


def test_python_examples_run(tmp_path, monkeypatch):
    blocks = marked_blocks("python")
    assert blocks
    for index, (name, block) in enumerate(blocks):
        workdir = tmp_path / str(index)
        workdir.mkdir()
        monkeypatch.chdir(workdir)
        exec(compile(block, f"<{name} example {index}>", "exec"), {"__name__": "__docs_example__"})  # noqa: S102


def python_blocks() -> list[tuple[str, str]]:
    found = []
    for path in SOURCES:
        text = path.read_text()
        runnable = {m.group(4) for m in MARKED.finditer(text)}
        for match in FENCED.finditer(text):
            if match.group(2) == "python" and match.group(3) not in runnable:
                found.append((path.name, match.group(3)))
    return found


def test_python_examples_name_what_exists():
    """What the (not runnable) Python examples import exists, and the keywords they pass to it are its."""
    checked = 0
    for name, block in python_blocks():
        tree = ast.parse(block, filename=name)
        bound = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("miles_lora_ckpt"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{name}: {node.module} has no {alias.name}"
                    bound[alias.asname or alias.name] = getattr(module, alias.name)
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                assert hasattr(bound[node.value.id], node.attr), f"{name}: {node.value.id}.{node.attr}"
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id in bound:
                    target = bound[func.id]
                elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in bound:
                    target = getattr(bound[func.value.id], func.attr)
            if target is not None and callable(target):
                parameters = inspect.signature(target).parameters
                if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                    continue
                for keyword in node.keywords:
                    if keyword.arg is not None:
                        assert keyword.arg in parameters, f"{name}: {ast.unparse(node.func)}() takes no {keyword.arg}="
                checked += 1
    assert checked >= 8


# --------------------------------------------------------------------------- the package map


HARNESS_MAP = "## The harness distribution"  # the heading of the harness's map on docs/architecture.md


def test_the_package_map_names_every_module():
    """docs/architecture.md's maps, the plugin's (paths under `miles_lora_ckpt/`) then, under its own
    heading, the harness's (paths under `harness/miles_lora_ckpt_harness/`): every module of each package
    is named (by its path, or by its name in the row of its directory), and every path a map names exists."""
    plugin_map, heading, harness_map = (DOCS / "architecture.md").read_text().partition(HARNESS_MAP)
    assert heading, f"docs/architecture.md has no '{HARNESS_MAP}' section"
    missing = _unmapped(plugin_map, PACKAGE) + _unmapped(harness_map, HARNESS)
    assert missing == [], f"modules missing from the package maps in docs/architecture.md: {missing}"


def _unmapped(page: str, package: Path) -> list[str]:
    rows = [line for line in page.splitlines() if line.startswith("| ") and line.count("|") >= 4]
    directories: dict[str, set[str]] = {}
    named_paths = set(re.findall(r"`([\w/]+\.py)`", page))
    for row in rows:
        module_cell = row.split("|")[2]
        for path in re.findall(r"`([\w/.]+)`", module_cell):
            if "/" not in path and not path.endswith(".py"):
                continue  # a word in the cell, not a path
            assert (package / path).exists(), f"the map names {path}, which is not in {package.name}"
            if path.endswith("/"):
                directories.setdefault(path, set()).update(re.findall(r"`([\w.]+)`", row))
    missing = []
    for module in sorted(package.rglob("*.py")):
        rel = module.relative_to(package).as_posix()
        if module.name == "__init__.py" or rel.startswith("miles_standin/"):
            continue  # a package is named by its directory; the Miles stand-in's trees by theirs
        parent, _, stem = rel.rpartition("/")
        in_row = directories.get(f"{parent}/" if parent else "", set())
        if rel not in named_paths and stem not in in_row and stem.removesuffix(".py") not in in_row:
            missing.append(f"{package.name}/{rel}")
    return missing
