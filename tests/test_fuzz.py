"""Property-based fuzzing (Hypothesis) of everything a reader parses.

Each example copies a template save root (two generations), mutates one thing, then runs one CLI
command on it (`verify`, `verify --all`, `ls`, `ls --fast`, `inspect`, `gc --dry-run`, drawn) and
the loader:

- targets: the manifest, the tracker, the training state (JSON), a safetensors header, raw bytes;
- mutations: a value anywhere replaced by any JSON value (NaN, Infinity, huge, negative, boolean,
  deeply nested ...), a key deleted or added, bytes flipped, inserted or cut; structured edits are
  resealed (digests recomputed, as a careless tool or a forger would), raw ones are not;
- with a signing key configured (`signed` runs), every edit is a forgery without the key.

Across all examples: zero tracebacks (every CLI exit code is 0, 1 or 2), zero hangs (a 10 s alarm
per example), and zero loads that are not bit-exact: an accepted load returns exactly the tensors
that were saved, or, where the tensor bytes themselves were resealed without a key, exactly what
the reference `safetensors` library reads from the accepted bytes.

CI runs 4 x 500 examples (derandomized, so reproducible); `make test-long` runs 4 x 5000 more,
randomized.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import signal
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as reference_load

from miles_lora_ckpt.core import lease
from miles_lora_ckpt.core import settings as core_settings
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.digest import digest_bytes
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import LEASE, MANIFEST, TRACKER, Topology, canonical_json
from miles_lora_ckpt.core.protocol import open_generation, save_generation
from miles_lora_ckpt.tools.cli import main as cli

ADAPTER = "adapter/dense_tp000_pp000.safetensors"
OPTIM = "optimizer/child0_tp000_pp000_ep000_etp000.safetensors"
STATE = "training_state.json"
KEY = "fuzzing-signing-key-0123456789abcdef"
CI_EXAMPLES, LONG_EXAMPLES = 500, 5000
TARGETS = ("manifest", "tracker", "training-state", "safetensors-header")
COMMANDS = (  # one per example, drawn: every command meets every kind of damage
    ("verify", "ROOT"),
    ("verify", "GEN"),
    ("verify", "ROOT", "--all"),
    ("ls", "ROOT", "--json"),
    ("ls", "ROOT", "--fast"),
    ("inspect", "ROOT", "--json"),
    ("gc", "ROOT", "--keep", "1", "--dry-run"),
)


def _tensors(iteration: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(iteration)
    return {
        ADAPTER: {"lora_A": torch.randn(3, 5, generator=gen), "lora_B": torch.randn(5, 3, generator=gen).bfloat16()},
        OPTIM: {"buf0.param": torch.randn(17, generator=gen), "buf0.exp_avg": torch.randn(17, generator=gen)},
    }


def _build_template(root: Path, key: str | None) -> dict[str, dict]:
    """Two generations (iterations 3 and 4); returns each one's saved tensors by directory name."""
    saved = {}
    with core_settings.overridden(**({"hmac_key": key} if key else {})):
        for iteration in (3, 4):
            tensors = _tensors(iteration)

            def write(writer, tensors=tensors, iteration=iteration):
                writer.write_tensors(ADAPTER, tensors[ADAPTER], binding={"role": "dense-adapter"})
                writer.write_tensors(OPTIM, tensors[OPTIM], binding={"role": "optimizer", "child": "0"})
                state = {
                    "iteration": iteration,
                    "generation": writer.generation,
                    "scheduler": {
                        "num_steps": iteration * 2,
                        "max_lr": 1e-3,
                        "min_lr": 0.0,
                        "lr_warmup_steps": 1,
                        "lr_decay_steps": 10,
                        "lr_decay_style": "cosine",
                    },
                    "optimizer_children": {"0:tp000": {"optimizer": {"param_groups": [{"lr": 1e-3, "eps": 1e-8}]}}},
                }
                writer.write_json(STATE, state, binding={"role": "training-state"})

            gen = save_generation(
                Consensus.single_process(),
                root,
                iteration=iteration,
                saver="fuzz",
                topology=Topology(),
                write_files=write,
            )
            saved[gen.name] = tensors
    lease.release(root)
    (root / LEASE).unlink(missing_ok=True)
    return saved


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    built = {}
    for signed in (False, True):
        root = tmp_path_factory.mktemp("fuzz-template") / "root"
        built[signed] = (root, _build_template(root, KEY if signed else None))
    return built


# --------------------------------------------------------------------------- strategies

SPECIAL_INTS = st.sampled_from([-1, 0, 1, 2**31, 2**53 + 1, 2**63, 2**64, 10**30, -(10**30)])
SPECIAL_FLOATS = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 0.5, 1e-320])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | SPECIAL_INTS
    | st.floats(allow_nan=True, allow_infinity=True)
    | SPECIAL_FLOATS
    | st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
DEEP = "@deeply-nested@"  # replaced by 10 000 levels of nesting in the text


def _paths(value, prefix=()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            out += _paths(child, (*prefix, index))
    return out


def _mutate_json(data, document):
    """A structured edit of a parsed JSON document (returned as new JSON text)."""
    document = json.loads(json.dumps(document))
    path = data.draw(st.sampled_from(_paths(document)), label="path")
    operation = data.draw(st.sampled_from(["replace", "replace", "delete", "add", "deep"]), label="operation")
    if not path:
        replacement = data.draw(JSON_VALUES) if operation != "deep" else DEEP
        document = replacement
    else:
        parent = document
        for step in path[:-1]:
            parent = parent[step]
        last = path[-1]
        if operation == "delete" and isinstance(parent, dict):
            del parent[last]
        elif operation == "add" and isinstance(parent, dict):
            parent[data.draw(st.text(max_size=10), label="new key")] = data.draw(JSON_VALUES)
        else:
            parent[last] = DEEP if operation == "deep" else data.draw(JSON_VALUES, label="value")
    text = json.dumps(document, sort_keys=True)
    return text.replace(json.dumps(DEEP), "[" * 10_000 + "]" * 10_000)


def _mutate_bytes(data, raw: bytes) -> bytes:
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4), label="byte edits")):
        operation = data.draw(st.sampled_from(["flip", "insert", "cut", "truncate"]), label="byte operation")
        where = data.draw(st.integers(0, max(0, len(raw) - 1)), label="offset")
        if operation == "flip" and raw:
            raw[where] ^= 1 << data.draw(st.integers(0, 7))
        elif operation == "insert":
            raw[where:where] = data.draw(st.binary(min_size=1, max_size=8))
        elif operation == "cut" and raw:
            del raw[where : where + data.draw(st.integers(1, 8))]
        elif operation == "truncate":
            del raw[where:]
    return bytes(raw)


# --------------------------------------------------------------------------- resealing


def _reseal_manifest_text(gen: Path, text: str) -> None:
    """Write a manifest from JSON text, with a self-digest over its canonical form when it parses."""
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        (gen / MANIFEST).write_text(text)
        return
    if isinstance(body, dict):
        signature = body.pop("signature", None)
        body.pop("manifest_digest", None)
        try:
            sealed = dict(body, manifest_digest=digest_bytes(canonical_json(body)))
        except (ValueError, RecursionError):
            sealed = body
        if signature is not None:
            sealed["signature"] = signature
        text = json.dumps(sealed)
    (gen / MANIFEST).write_text(text)


def _reseal_file(gen: Path, rel: str, raw: bytes) -> None:
    (gen / rel).write_bytes(raw)
    body = json.loads((gen / MANIFEST).read_text())
    body["files"][rel].update(bytes=len(raw), digest=digest_bytes(raw))
    _reseal_manifest_text(gen, json.dumps(body))


def _split_header(raw: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _join_header(text: str, data_section: bytes) -> bytes:
    header = text.encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data_section


# --------------------------------------------------------------------------- one example


def _damage(data, target: str, root: Path, newest: Path) -> set[str]:
    """Apply one mutation; returns the relative paths whose content was resealed (tensor files)."""
    resealed: set[str] = set()
    raw_mode = data.draw(st.booleans(), label="raw bytes (not resealed)")
    if target == "manifest":
        raw = (newest / MANIFEST).read_bytes()
        if raw_mode:
            (newest / MANIFEST).write_bytes(_mutate_bytes(data, raw))
        else:
            _reseal_manifest_text(newest, _mutate_json(data, json.loads(raw)))
    elif target == "tracker":
        raw = (root / TRACKER).read_bytes()
        mutated = _mutate_bytes(data, raw) if raw_mode else _mutate_json(data, json.loads(raw)).encode()
        (root / TRACKER).write_bytes(mutated)
    elif target == "training-state":
        raw = (newest / STATE).read_bytes()
        mutated = _mutate_bytes(data, raw) if raw_mode else _mutate_json(data, json.loads(raw)).encode()
        if not raw_mode or data.draw(st.booleans(), label="reseal raw edit"):
            _reseal_file(newest, STATE, mutated)
        else:
            (newest / STATE).write_bytes(mutated)
    else:
        rel = data.draw(st.sampled_from([ADAPTER, OPTIM]), label="tensor file")
        raw = (newest / rel).read_bytes()
        if raw_mode:
            mutated = _mutate_bytes(data, raw)
        else:
            header, data_section = _split_header(raw)
            mutated = _join_header(_mutate_json(data, header), data_section)
        if not raw_mode or data.draw(st.booleans(), label="reseal raw edit"):
            _reseal_file(newest, rel, mutated)
            resealed.add(rel)
        else:
            (newest / rel).write_bytes(mutated)
    return resealed


def _run_cli(*args: str) -> int:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(list(args))
    text = out.getvalue() + err.getvalue()
    assert code in (0, 1, 2), (args, code, text)
    assert "Traceback" not in text and "INTERNAL ERROR" not in text, (args, text)
    return code


class Workspace:
    """A copy of a template root, put back to the template's bytes before every example (cheaper
    than a fresh copy: only files are rewritten, no directory is made)."""

    def __init__(self, template: Path, where: Path):
        self.root = where / "root"
        shutil.copytree(template, self.root)
        self.files = {p: p.read_bytes() for p in self.root.rglob("*") if p.is_file()}
        self.dirs = {p for p in self.root.rglob("*") if p.is_dir()} | {self.root}

    def reset(self) -> Path:
        for path in sorted(self.root.rglob("*"), reverse=True):
            if path in self.files or path in self.dirs:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        for path, raw in self.files.items():
            path.write_bytes(raw)
        return self.root


def _check_example(data, target: str, workspace: Workspace, saved: dict, signed: bool) -> None:
    root = workspace.reset()
    newest = root / max(saved)  # names sort by iteration: gen-000000004-... is the newest
    resealed = _damage(data, target, root, newest)
    command = data.draw(st.sampled_from(COMMANDS), label="command")
    with core_settings.overridden(**({"hmac_key": KEY} if signed else {})):
        _run_cli(*(str(root) if arg == "ROOT" else str(newest) if arg == "GEN" else arg for arg in command))
        try:
            opened = open_generation(Consensus.single_process(), root, lambda m: [ADAPTER, OPTIM, STATE])
        except CheckpointError:
            return
    for rel in (ADAPTER, OPTIM):
        got = opened.tensors(rel)
        if rel in resealed and opened.path == newest and not signed:
            expected = reference_load((newest / rel).read_bytes())
        else:
            expected = saved[opened.path.name][rel]
        assert sorted(got) == sorted(expected), (rel, sorted(got))
        for name, tensor in expected.items():
            same = got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
            assert same and torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def _fuzz(templates, target: str, signed: bool, examples: int, derandomize: bool) -> None:
    template, saved = templates[signed]
    scratch = tempfile.TemporaryDirectory()
    workspace = Workspace(template, Path(scratch.name))

    def hung(signum, frame):
        raise TimeoutError(f"an example hung for 10 s (target {target})")

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(data=st.data())
    def property_holds(data):
        previous = signal.signal(signal.SIGALRM, hung)
        signal.alarm(10)
        try:
            _check_example(data, target, workspace, saved, signed)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    with scratch:
        property_holds()


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz(templates, target):
    # half the examples with a signing key configured: every edit is then a forgery without the key
    _fuzz(templates, target, signed=False, examples=CI_EXAMPLES // 2, derandomize=True)
    _fuzz(templates, target, signed=True, examples=CI_EXAMPLES - CI_EXAMPLES // 2, derandomize=True)


@pytest.mark.long
@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_long(templates, target):
    _fuzz(templates, target, signed=False, examples=LONG_EXAMPLES // 2, derandomize=False)
    _fuzz(templates, target, signed=True, examples=LONG_EXAMPLES - LONG_EXAMPLES // 2, derandomize=False)
