"""The adversarial corpus: hostile and careless roots, one case per way of breaking them.

Two kinds of case, both tagged with the class of failure they belong to (`CLASSES`):

- `CASES` damage one freshly committed generation: `verify` must exit 1 with an `ERROR <file>:`
  line naming the file, and loading must refuse. Loading goes through `protocol.open_generation`,
  the only door every loader of this project uses, so a refusal here is a refusal before any model
  or optimizer is touched.
- `ROOT_CASES` break a save root (its tracker, lease, entries, clocks, retention); each checks
  what the CLI and the loader must do.

Every case runs under a 20 s alarm: nothing may hang (a FIFO anywhere must fail within seconds).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from damage import (
    edit_manifest,
    edit_training_state,
    nested,
    reseal_file,
    rewrite_header,
    swap_files,
    write_manifest_text,
)

from miles_lora_ckpt.core import lease, safetensors_write, settings
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError, GenerationDamaged, IncompatibleCheckpoint
from miles_lora_ckpt.core.layout import LEASE, MANIFEST, TRACKER, Topology
from miles_lora_ckpt.core.protocol import open_generation, save_generation
from miles_lora_ckpt.tools.cli import main as cli

ADAPTER = "adapter/tp00_pp00.safetensors"
OPTIM = "optim/child0.safetensors"
OPTIM1 = "optim/child1.safetensors"
STATE = "state.json"
KEY = "corpus-signing-key-0123456789abcdef"
OTHER_KEY = "another-signing-key-0123456789abcdef"
CLASSES = {
    "bytes": "integrity of bytes (the original 28 cases)",
    "retention": "#1 retention and ls judge content, never names and sizes",
    "exceptions": "#2 any exception examining a candidate is damage to it, never a crash",
    "non-regular": "#3 FIFOs, sockets, directories and dangling links fail within seconds",
    "root-entries": "#4 links and files among a root's entries never wedge gc",
    "writers": "#5 one writer per root, retention spares a live writer's staging",
    "verify-is-load": "#6 verify runs exactly the loader's content rules",
    "clocks": "#7 order by sequence, never by wall clocks; tracker disagreements are warnings",
    "binding": "semantic binding: files carry their generation, path, role and coordinate",
    "training-state": "training-state invariants",
    "signing": "tamper evidence with a key configured",
    "messages": "stray files and missing keys are named",
    "compat": "format v1 generations",
    "encodings": "names and numbers are ASCII, JSON is UTF-8 only",
}


@pytest.fixture(autouse=True)
def _no_hang_and_clean_settings():
    def hung(signum, frame):
        raise TimeoutError("the case hung for 20 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    settings.reset()
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
    settings.reset()


def training_state(iteration: int, generation: str, **scheduler) -> dict:
    return {
        "iteration": iteration,
        "generation": generation,
        "scheduler": {
            "num_steps": iteration,
            "max_lr": 1e-3,
            "min_lr": 1e-5,
            "lr_warmup_steps": 2,
            "lr_decay_steps": 100,
            "lr_decay_style": "cosine",
            **scheduler,
        },
        "optimizer_children": {
            "0:tp000": {
                "optimizer": {"param_groups": [{"lr": 1e-3, "eps": 1e-8, "betas": {"__tuple__": [0.9, 0.999]}}]}
            }
        },
    }


def make_generation(root: Path, iteration: int = 7, *, key: str | None = None, adapter_scale: float = 1.0) -> Path:
    def write(writer):
        gen = torch.Generator().manual_seed(iteration)
        adapter = {"lora_A": torch.randn(4, 8, generator=gen) * adapter_scale, "lora_B": torch.randn(8, 4).bfloat16()}
        writer.write_tensors(ADAPTER, adapter, binding={"role": "dense-adapter", "coordinate": "tp00_pp00"})
        for child, rel in enumerate((OPTIM, OPTIM1)):
            state = {"param": torch.randn(64, generator=gen), "exp_avg": torch.randn(64, generator=gen)}
            writer.write_tensors(rel, state, binding={"role": "optimizer", "coordinate": "tp00", "child": str(child)})
        writer.write_json(STATE, training_state(iteration, writer.generation), binding={"role": "training-state"})

    with settings.overridden(**({"hmac_key": key} if key else {})):
        return save_generation(
            Consensus.single_process(), root, iteration=iteration, saver="test", topology=Topology(), write_files=write
        )


def load(path: Path, files=(ADAPTER, OPTIM, STATE)):
    return open_generation(Consensus.single_process(), path, lambda manifest: [f for f in files if f in manifest.files])


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def tensor_file_with(value: float) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        safetensors_write.save_tensors(
            Path(tmp) / "x.safetensors", {"lora_A": torch.tensor([1.0, value]), "lora_B": torch.ones(2)}
        )
        return (Path(tmp) / "x.safetensors").read_bytes()


def pickle_payload() -> bytes:
    return pickle.dumps({"lora_A": [1.0, 2.0]})


def torch_pickle_payload(tmp: Path) -> bytes:
    torch.save({"lora_A": torch.ones(2)}, tmp / "p.pt")
    return (tmp / "p.pt").read_bytes()


def replace_with_socket(path: Path) -> None:
    path.unlink()
    cwd = os.getcwd()
    os.chdir(path.parent)  # a socket path may be at most ~100 characters: bind relative to its folder
    try:
        socket.socket(socket.AF_UNIX).bind(path.name)
    finally:
        os.chdir(cwd)


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def sparse(path: Path, size: int) -> None:
    os.truncate(path, size)


def copy_in(src: Path, rel: str):
    """Damage: replace `rel` with the same file of another generation, manifest resealed."""
    return lambda g, t: reseal_file(g, rel, (src(t) / rel).read_bytes())


def set_group(**values):
    def change(state):
        state["optimizer_children"]["0:tp000"]["optimizer"]["param_groups"][0].update(values)

    return change


SPARSE = 2**40  # a 1 TiB file that holds almost nothing

# name: (class, damage(gen, tmp_path), file the error must name[, options])
# options: "key_at_save" / "key_at_check" (the signing key is configured then)
CASES: dict[str, tuple] = {
    # ------------------------------------------------------------------ bytes (the original corpus)
    "truncated tensor file": (
        "bytes",
        lambda g, t: (g / ADAPTER).write_bytes((g / ADAPTER).read_bytes()[:-9]),
        ADAPTER,
    ),
    "truncated to zero": ("bytes", lambda g, t: (g / OPTIM).write_bytes(b""), OPTIM),
    "bit flip in tensor data": ("bytes", lambda g, t: flip_byte(g / ADAPTER, -3), ADAPTER),
    "bit flip in safetensors header": ("bytes", lambda g, t: flip_byte(g / OPTIM, 12), OPTIM),
    "bit flip in json": ("bytes", lambda g, t: flip_byte(g / STATE, 3), STATE),
    "deleted tensor file": ("bytes", lambda g, t: (g / OPTIM).unlink(), OPTIM),
    "deleted json": ("bytes", lambda g, t: (g / STATE).unlink(), STATE),
    "deleted manifest": ("bytes", lambda g, t: (g / MANIFEST).unlink(), MANIFEST),
    "extra file": (
        "bytes",
        lambda g, t: (g / "adapter" / "stray.safetensors").write_bytes(b"x"),
        "adapter/stray.safetensors",
    ),
    "leftover temp file": (
        "bytes",
        lambda g, t: (g / ".state.json.tmp-1234").write_bytes(b"{}"),
        ".state.json.tmp-1234",
    ),
    "renamed file": ("bytes", lambda g, t: os.rename(g / ADAPTER, g / "adapter/tp01_pp00.safetensors"), ADAPTER),
    "edited manifest (digest not resealed)": (
        "bytes",
        lambda g, t: (g / MANIFEST).write_text((g / MANIFEST).read_text().replace('"iteration": 7', '"iteration": 8')),
        MANIFEST,
    ),
    "truncated manifest": (
        "bytes",
        lambda g, t: (g / MANIFEST).write_bytes((g / MANIFEST).read_bytes()[:50]),
        MANIFEST,
    ),
    "resealed manifest with a wrong size": (
        "bytes",
        lambda g, t: edit_manifest(g, lambda b: b["files"][OPTIM].update(bytes=b["files"][OPTIM]["bytes"] + 4)),
        OPTIM,
    ),
    "resealed manifest with a wrong digest": (
        "bytes",
        lambda g, t: edit_manifest(g, lambda b: b["files"][STATE].update(digest="xxh3_128:" + "0" * 32)),
        STATE,
    ),
    "manifest of another generation": (
        "bytes",
        lambda g, t: shutil.copy(make_generation(t / "other") / MANIFEST, g / MANIFEST),
        MANIFEST,
    ),
    "file of another generation": (
        "bytes",
        lambda g, t: shutil.copy(make_generation(t / "other", iteration=7) / ADAPTER, g / ADAPTER),
        ADAPTER,
    ),
    "symlink escaping the generation": (
        "bytes",
        lambda g, t: ((g / OPTIM).unlink(), (t / "outside").write_bytes(b"x"), (g / OPTIM).symlink_to(t / "outside")),
        OPTIM,
    ),
    "symlinked directory": ("bytes", lambda g, t: (g / "linkdir").symlink_to(t, target_is_directory=True), "linkdir"),
    "manifest path escaping with ..": (
        "bytes",
        lambda g, t: edit_manifest(g, lambda b: b["files"].__setitem__("../escape.json", b["files"].pop(STATE))),
        "../escape.json",
    ),
    "absolute path in manifest": (
        "bytes",
        lambda g, t: edit_manifest(g, lambda b: b["files"].__setitem__("/etc/passwd", b["files"].pop(STATE))),
        "/etc/passwd",
    ),
    "pickle payload in place of safetensors": (
        "bytes",
        lambda g, t: (g / ADAPTER).write_bytes(pickle_payload()),
        ADAPTER,
    ),
    "resealed torch.save payload in place of safetensors": (
        "bytes",
        lambda g, t: reseal_file(g, ADAPTER, torch_pickle_payload(t)),
        ADAPTER,
    ),
    "resealed pickle in place of json": ("bytes", lambda g, t: reseal_file(g, STATE, pickle_payload()), STATE),
    "resealed NaN where finite values are required": (
        "bytes",
        lambda g, t: reseal_file(g, ADAPTER, tensor_file_with(float("nan"))),
        ADAPTER,
    ),
    "resealed Inf where finite values are required": (
        "bytes",
        lambda g, t: reseal_file(g, ADAPTER, tensor_file_with(float("-inf"))),
        ADAPTER,
    ),
    "resealed unsupported format version": (
        "bytes",
        lambda g, t: edit_manifest(g, lambda b: b.update(format_version=99)),
        MANIFEST,
    ),
    "resealed format version as a float (2.0 is not the integer 2)": (
        "bytes",
        lambda g, t: edit_manifest(g, lambda b: b.update(format_version=2.0)),
        MANIFEST,
    ),
    "resealed non-finite JSON constant": ("bytes", lambda g, t: reseal_file(g, STATE, b'{"iteration": NaN}'), STATE),
    # ------------------------------------------------------------------ #2 exceptions are damage
    "deeply nested JSON as the manifest": (
        "exceptions",
        lambda g, t: (g / MANIFEST).write_bytes(nested(100_000)),
        MANIFEST,
    ),
    "deeply nested manifest metadata (resealed)": (
        "exceptions",
        lambda g, t: edit_manifest(g, lambda b: b["metadata"].update(x=json.loads(nested(200)))),
        MANIFEST,
    ),
    "deeply nested training state (resealed)": (
        "exceptions",
        lambda g, t: reseal_file(g, STATE, nested(100_000)),
        STATE,
    ),
    "deeply nested safetensors header (resealed)": (
        "exceptions",
        lambda g, t: rewrite_header(g, ADAPTER, lambda h: b'{"__metadata__":' + nested(100_000) + b"}"),
        ADAPTER,
    ),
    "Infinity in an integer field (resealed)": (
        "exceptions",
        lambda g, t: edit_manifest(g, lambda b: b.update(iteration=float("inf"))),
        MANIFEST,
    ),
    "1e999 in an integer field": (
        "exceptions",
        lambda g, t: write_manifest_text(g, lambda b: b.update(iteration="@big@"), {"@big@": "1e999"}),
        MANIFEST,
    ),
    "integer out of range (resealed)": (
        "exceptions",
        lambda g, t: edit_manifest(g, lambda b: b.update(iteration=10**30)),
        MANIFEST,
    ),
    "boolean as an integer (resealed)": (
        "exceptions",
        lambda g, t: edit_manifest(g, lambda b: b.update(sequence=True)),
        MANIFEST,
    ),
    "float as a file size (resealed)": (
        "exceptions",
        lambda g, t: edit_manifest(g, lambda b: b["files"][OPTIM].update(bytes=float(b["files"][OPTIM]["bytes"]))),
        MANIFEST,
    ),
    "declared size of 1 TiB, sparse (resealed)": (
        "exceptions",
        lambda g, t: (sparse(g / OPTIM, SPARSE), edit_manifest(g, lambda b: b["files"][OPTIM].update(bytes=SPARSE))),
        OPTIM,
    ),
    "sparse 1 TiB manifest": ("exceptions", lambda g, t: sparse(g / MANIFEST, SPARSE), MANIFEST),
    "sparse 1 TiB training state (resealed)": (
        "exceptions",
        lambda g, t: (sparse(g / STATE, SPARSE), edit_manifest(g, lambda b: b["files"][STATE].update(bytes=SPARSE))),
        STATE,
    ),
    "boolean dimension in a shape (resealed)": (
        "exceptions",
        lambda g, t: rewrite_header(g, OPTIM, lambda h: h["exp_avg"].update(shape=[True, 64])),
        OPTIM,
    ),
    "dimensions whose product overflows (resealed)": (
        "exceptions",
        lambda g, t: rewrite_header(
            g, OPTIM, lambda h: h.update(extra={"dtype": "F32", "shape": [0, 2**40, 2**40], "data_offsets": [512, 512]})
        ),
        OPTIM,
    ),
    "negative data offset (resealed)": (
        "exceptions",
        lambda g, t: rewrite_header(g, OPTIM, lambda h: h["exp_avg"].update(data_offsets=[-256, 0])),
        OPTIM,
    ),
    "unknown dtype (resealed)": (
        "exceptions",
        lambda g, t: rewrite_header(g, OPTIM, lambda h: h["param"].update(dtype="F8")),
        OPTIM,
    ),
    "duplicate tensor name in a header (resealed)": (
        "exceptions",
        lambda g, t: rewrite_header(
            g, OPTIM, lambda h: json.dumps(h)[:-1].encode() + b',"param":' + json.dumps(h["param"]).encode() + b"}"
        ),
        OPTIM,
    ),
    "non-string safetensors metadata (resealed)": (
        "exceptions",
        lambda g, t: rewrite_header(g, ADAPTER, lambda h: h["__metadata__"].update(file=7)),
        ADAPTER,
    ),
    "dangling symlink in place of a listed file": (
        "exceptions",
        lambda g, t: ((g / OPTIM).unlink(), (g / OPTIM).symlink_to(t / "nowhere")),
        OPTIM,
    ),
    # ------------------------------------------------------------------ #3 non-regular files
    "FIFO in place of a tensor file": ("non-regular", lambda g, t: replace_with_fifo(g / OPTIM), OPTIM),
    "FIFO as the manifest": ("non-regular", lambda g, t: replace_with_fifo(g / MANIFEST), MANIFEST),
    "FIFO in place of the training state": ("non-regular", lambda g, t: replace_with_fifo(g / STATE), STATE),
    "unlisted FIFO in the generation": ("non-regular", lambda g, t: os.mkfifo(g / "adapter" / "pipe"), "adapter/pipe"),
    "socket in place of a tensor file": ("non-regular", lambda g, t: replace_with_socket(g / ADAPTER), ADAPTER),
    "directory in place of a tensor file": (
        "non-regular",
        lambda g, t: ((g / OPTIM).unlink(), (g / OPTIM).mkdir()),
        OPTIM,
    ),
    # ------------------------------------------------------------------ #6 verify runs the loader's rules
    "NaN with the finite flag stripped (resealed)": (
        "verify-is-load",
        lambda g, t: reseal_file(g, ADAPTER, tensor_file_with(float("nan")), finite=False),
        ADAPTER,
    ),
    "scalar tensor of an unknown dtype in the training state (resealed)": (
        "verify-is-load",
        lambda g, t: edit_training_state(g, set_group(step={"__scalar_tensor__": 2.0, "dtype": "Tensor"}), rel=STATE),
        STATE,
    ),
    "scalar tensor of dtype int64 holding 2.5 (resealed)": (
        "verify-is-load",
        lambda g, t: edit_training_state(g, set_group(step={"__scalar_tensor__": 2.5, "dtype": "int64"}), rel=STATE),
        STATE,
    ),
    "scalar tensor of dtype float32 holding 1e300, inf once decoded (resealed)": (
        "verify-is-load",
        lambda g, t: edit_training_state(
            g, set_group(step={"__scalar_tensor__": 1e300, "dtype": "float32"}), rel=STATE
        ),
        STATE,
    ),
    "scalar tensor of dtype uint8 holding -1, 255 once decoded (resealed)": (
        "verify-is-load",
        lambda g, t: edit_training_state(g, set_group(step={"__scalar_tensor__": -1, "dtype": "uint8"}), rel=STATE),
        STATE,
    ),
    "malformed tuple tag in the training state (resealed)": (
        "verify-is-load",
        lambda g, t: edit_training_state(g, set_group(betas={"__tuple__": [0.9, 0.99], "x": 1}), rel=STATE),
        STATE,
    ),
    "unknown scheduler decay style (resealed)": (
        "verify-is-load",
        lambda g, t: edit_training_state(g, lambda s: s["scheduler"].update(lr_decay_style="warp"), rel=STATE),
        STATE,
    ),
    "unknown weight decay increment style (resealed)": (
        "verify-is-load",
        lambda g, t: edit_training_state(
            g,
            lambda s: s["scheduler"].update(start_wd=0.0, end_wd=0.1, wd_incr_steps=10, wd_incr_style="zigzag"),
            rel=STATE,
        ),
        STATE,
    ),
    "scheduler without a key megatron reads (resealed)": (
        "verify-is-load",
        lambda g, t: edit_training_state(g, lambda s: s["scheduler"].pop("lr_decay_steps"), rel=STATE),
        STATE,
    ),
    "tensor name with a path character (resealed)": (
        "verify-is-load",
        lambda g, t: rewrite_header(g, ADAPTER, lambda h: h.__setitem__("../lora_A", h.pop("lora_A"))),
        ADAPTER,
    ),
    "tensor name with a control character (resealed)": (
        "verify-is-load",
        lambda g, t: rewrite_header(g, OPTIM, lambda h: h.__setitem__("param\n", h.pop("param"))),
        OPTIM,
    ),
    "optimizer_saved false with optimizer files listed (resealed)": (
        "verify-is-load",
        lambda g, t: edit_manifest(g, lambda b: b["metadata"].update(optimizer_saved=False)),
        MANIFEST,
    ),
    "optimizer_saved null with optimizer files listed (resealed)": (
        "verify-is-load",
        lambda g, t: edit_manifest(g, lambda b: b["metadata"].update(optimizer_saved=None)),
        MANIFEST,
    ),
    "optimizer_saved the string false (resealed)": (
        "verify-is-load",
        lambda g, t: edit_manifest(g, lambda b: b["metadata"].update(optimizer_saved="false")),
        MANIFEST,
    ),
    # ------------------------------------------------------------------ names and encodings
    "UTF-16 manifest": (
        "encodings",
        lambda g, t: (g / MANIFEST).write_bytes((g / MANIFEST).read_text().encode("utf-16")),
        MANIFEST,
    ),
    "UTF-8 manifest with a byte order mark": (
        "encodings",
        lambda g, t: (g / MANIFEST).write_bytes(b"\xef\xbb\xbf" + (g / MANIFEST).read_bytes()),
        MANIFEST,
    ),
    "UTF-16 training state (resealed)": (
        "encodings",
        lambda g, t: reseal_file(g, STATE, (g / STATE).read_text().encode("utf-16-le")),
        STATE,
    ),
    # ------------------------------------------------------------------ semantic binding
    "tensor file of another generation, same iteration (resealed)": (
        "binding",
        copy_in(lambda t: make_generation(t / "other", iteration=7), OPTIM),
        OPTIM,
    ),
    "optimizer files swapped between children (resealed)": (
        "binding",
        lambda g, t: swap_files(g, OPTIM, OPTIM1),
        OPTIM,
    ),
    "generation stamp removed from a tensor file (resealed)": (
        "binding",
        lambda g, t: rewrite_header(g, ADAPTER, lambda h: h["__metadata__"].pop("generation")),
        ADAPTER,
    ),
    "binding changed in the manifest (resealed)": (
        "binding",
        lambda g, t: edit_manifest(g, lambda b: b["files"][OPTIM]["binding"].update(child="1")),
        OPTIM,
    ),
    "training state of another generation, same iteration (resealed)": (
        "binding",
        copy_in(lambda t: make_generation(t / "other", iteration=7), STATE),
        STATE,
    ),
    "training state without its generation (resealed)": (
        "binding",
        lambda g, t: edit_training_state(g, lambda s: s.pop("generation"), rel=STATE),
        STATE,
    ),
    # ------------------------------------------------------------------ training-state invariants
    "eps NaN through the JSON codec (resealed)": (
        "training-state",
        lambda g, t: edit_training_state(g, set_group(eps={"__float__": "nan"}), rel=STATE),
        STATE,
    ),
    "negative scheduler num_steps (resealed)": (
        "training-state",
        lambda g, t: edit_training_state(g, lambda s: s["scheduler"].update(num_steps=-3), rel=STATE),
        STATE,
    ),
    "fresh scheduler at iteration 7 (resealed)": (
        "training-state",
        lambda g, t: edit_training_state(g, lambda s: s["scheduler"].update(num_steps=0), rel=STATE),
        STATE,
    ),
    "beta of 1.5 (resealed)": (
        "training-state",
        lambda g, t: edit_training_state(g, set_group(betas={"__tuple__": [1.5, 0.999]}), rel=STATE),
        STATE,
    ),
    "negative learning rate (resealed)": (
        "training-state",
        lambda g, t: edit_training_state(g, set_group(lr=-1e-3), rel=STATE),
        STATE,
    ),
    "training-state iteration differs from the manifest (resealed)": (
        "training-state",
        lambda g, t: edit_training_state(g, lambda s: s.update(iteration=8), rel=STATE),
        STATE,
    ),
    "infinite scheduler rate (resealed)": (
        "training-state",
        lambda g, t: edit_training_state(g, lambda s: s["scheduler"].update(max_lr={"__float__": "inf"}), rel=STATE),
        STATE,
    ),
    # ------------------------------------------------------------------ signing (a key is configured)
    "unsigned generation, key configured to check": ("signing", lambda g, t: None, MANIFEST, {"key_at_check": True}),
    "signature stripped (resealed)": (
        "signing",
        lambda g, t: edit_manifest(g, lambda b: None, keep_signature=False),
        MANIFEST,
        {"key_at_save": True, "key_at_check": True},
    ),
    "content forged and resealed under a signature": (
        "signing",
        lambda g, t: reseal_file(g, ADAPTER, tensor_file_with(0.5)),
        MANIFEST,
        {"key_at_save": True, "key_at_check": True},
    ),
    "signed with another key": (
        "signing",
        lambda g, t: None,
        MANIFEST,
        {"key_at_save": OTHER_KEY, "key_at_check": True},
    ),
    "malformed signature object": (
        "signing",
        lambda g, t: _set_signature(g, {"algorithm": "hmac-sha256", "mac": 7}),
        MANIFEST,
        {"key_at_save": True, "key_at_check": True},
    ),
    "signature mac with non-ASCII characters": (
        "signing",
        lambda g, t: _set_signature(g, {"algorithm": "hmac-sha256", "key_id": "x", "mac": "\u00e9" * 64}),
        MANIFEST,
        {"key_at_save": True, "key_at_check": True},
    ),
}


def _set_signature(gen: Path, signature) -> None:
    body = json.loads((gen / MANIFEST).read_text())
    body["signature"] = signature
    (gen / MANIFEST).write_text(json.dumps(body))


def _key_option(value) -> str | None:
    return None if not value else (value if isinstance(value, str) else KEY)


@contextlib.contextmanager
def _checking(options: dict):
    key = _key_option(options.get("key_at_check"))
    with settings.overridden(**({"hmac_key": key} if key else {})):
        yield


@pytest.fixture(params=sorted(CASES), ids=lambda name: name.replace(" ", "-"))
def damaged(request, tmp_path):
    _, damage, named_file, *rest = CASES[request.param]
    options = rest[0] if rest else {}
    gen = make_generation(tmp_path / "root", key=_key_option(options.get("key_at_save")))
    damage(gen, tmp_path)
    return gen, named_file, options


def test_verify_exits_1_naming_the_file_and_loading_refuses(damaged, capsys):
    gen, named_file, options = damaged
    started = time.monotonic()
    with _checking(options):
        assert cli(["verify", str(gen)]) == 1
        out = capsys.readouterr()
        assert f"ERROR {named_file}:" in out.out, out
        assert "Traceback" not in out.out + out.err and "INTERNAL ERROR" not in out.err
        with pytest.raises(CheckpointError) as info:
            load(gen)
    assert named_file in str(info.value), str(info.value)
    # verify = the loader: the loader refuses for the very reason verify gave for that file
    reasons = [line.split(": ", 1)[1] for line in out.out.splitlines() if line.startswith(f"ERROR {named_file}: ")]
    assert any(f"{named_file}: {why}" in str(info.value) for why in reasons), (reasons, str(info.value))
    assert time.monotonic() - started < 10


# =========================================================================== save-root cases

ROOT_CASES: dict[str, tuple[str, Callable]] = {}


def root_case(klass: str, name: str):
    def register(check):
        ROOT_CASES[name] = (klass, check)
        return check

    return register


def ls_json(root: Path, capsys, *extra: str) -> dict:
    capsys.readouterr()
    assert cli(["ls", str(root), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    started = time.monotonic()
    code = cli(list(args))
    out = capsys.readouterr()
    assert time.monotonic() - started < 10, args
    assert "Traceback" not in out.out + out.err and "INTERNAL ERROR" not in out.err, out
    return code, out.out, out.err


@root_case("retention", "#1 newest has a flipped bit: verify falls back, gc --keep 1 keeps the older")
def _(tmp, capsys):
    older = make_generation(tmp, 5)
    newest = make_generation(tmp, 6)
    flip_byte(newest / ADAPTER, -3)
    code, out, err = run_cli(capsys, "verify", str(tmp))
    assert code == 0 and older.name in out and newest.name in err
    code, out, _ = run_cli(capsys, "gc", str(tmp), "--keep", "1")
    assert code == 0 and f"keeping {older.name} (content verified)" in out
    assert older.exists() and newest.exists()  # the damaged newer one is left for an operator
    assert load(tmp).path == older


@root_case("signing", "a newer generation with a non-ASCII signature mac is skipped, never a crash")
def _(tmp, capsys):
    with settings.overridden(hmac_key=KEY):
        older = make_generation(tmp, 5, key=KEY)
        newest = make_generation(tmp, 6, key=KEY)
        _set_signature(newest, {"algorithm": "hmac-sha256", "key_id": "x", "mac": "\u00e9" * 64})
        code, out, err = run_cli(capsys, "verify", str(tmp))
        assert code == 0 and older.name in out and newest.name in err
        assert "signature does not match" in err or "signed with another key" in err, err
        code, out, err = run_cli(capsys, "ls", str(tmp))
        assert code == 0 and "damaged" in out
        assert load(tmp).path == older
        next_one = make_generation(tmp, 7, key=KEY)  # numbering (next_sequence) skips it too
    assert next_one.exists()


@root_case("verify-is-load", "a generation link given as the path: verify and the loader both take its generation")
def _(tmp, capsys):
    older = make_generation(tmp, 5)
    newest = make_generation(tmp, 6)
    os.symlink(older.name, tmp / "step_5")  # a reader link to an older generation of the root
    os.symlink(str(newest.resolve()), tmp / "absolute")  # not a relative sibling link: never followed
    code, out, _ = run_cli(capsys, "verify", str(tmp / "step_5"))
    assert code == 0 and older.name in out and newest.name not in out
    assert load(tmp / "step_5").path == older
    code, out, _ = run_cli(capsys, "verify", str(tmp / "absolute"))
    assert code == 1 and "generation directory is a symlink" in out, out
    with pytest.raises(CheckpointError, match="generation directory is a symlink"):
        load(tmp / "absolute")


@root_case("retention", "gc never counts a damaged generation among the N kept")
def _(tmp, capsys):
    gens = [make_generation(tmp, i) for i in (1, 2, 3, 4)]
    flip_byte(gens[2] / OPTIM, -5)
    code, out, _ = run_cli(capsys, "gc", str(tmp), "--keep", "2")
    assert code == 0
    assert [p.exists() for p in gens] == [False, True, True, True], out  # kept: 4 and 2 (3 is damaged)


@root_case("retention", "gc with no intact generation removes nothing and says so")
def _(tmp, capsys):
    gens = [make_generation(tmp, i) for i in (1, 2)]
    for gen in gens:
        flip_byte(gen / STATE, 4)
    code, out, _ = run_cli(capsys, "gc", str(tmp), "--keep", "1")
    assert code == 1 and "no generation passed content verification" in out
    assert all(g.exists() for g in gens)


@root_case("retention", "ls shows content state; --fast skips digests and says so")
def _(tmp, capsys):
    make_generation(tmp, 1)
    newest = make_generation(tmp, 2)
    flip_byte(newest / ADAPTER, -3)
    full = ls_json(tmp, capsys)
    assert full["content_checked"] and [e["state"] for e in full["entries"]] == ["damaged", "intact"]
    assert any(ADAPTER in p for p in full["entries"][0]["problems"])
    fast = ls_json(tmp, capsys, "--fast")
    assert not fast["content_checked"] and [e["state"] for e in fast["entries"]] == ["committed", "committed"]
    code, out, _ = run_cli(capsys, "ls", str(tmp), "--fast")
    assert code == 0 and "content NOT checked (--fast)" in out


@root_case("retention", "save-time retention keeps the newest content-verified generations only")
def _(tmp, capsys):
    first = make_generation(tmp, 1)
    second = make_generation(tmp, 2)
    flip_byte(second / OPTIM, -5)

    def write(writer):
        writer.write_json("x.json", {})

    third = save_generation(
        Consensus.single_process(), tmp, iteration=3, saver="test", topology=Topology(), write_files=write, keep=2
    )
    assert first.exists() and second.exists() and third.exists()  # 2 is damaged: 1 is still one of the 2 kept


@root_case("non-regular", "FIFO as the tracker: every command and the loader finish, naming it")
def _(tmp, capsys):
    gen = make_generation(tmp, 1)
    replace_with_fifo(tmp / TRACKER)
    for args in (("verify", str(tmp)), ("ls", str(tmp)), ("gc", str(tmp), "--keep", "1"), ("inspect", str(tmp))):
        code, out, err = run_cli(capsys, *args)
        assert code == 0 and f"tracker {TRACKER} is unusable (is a fifo" in out + err, (args, out, err)
    assert load(tmp).path == gen


@root_case("non-regular", "FIFO as the writer lease: a save is refused within seconds, naming it")
def _(tmp, capsys):
    make_generation(tmp, 1)
    lease.release(tmp)
    os.mkfifo(tmp / LEASE)
    with pytest.raises(CheckpointError, match="unreadable lease .is a fifo"):
        make_generation(tmp, 2)
    assert [n for n in os.listdir(tmp) if n.startswith(".staging")] == []
    code, out, _ = run_cli(capsys, "ls", str(tmp))
    assert code == 0 and "is a fifo" in out


@root_case("non-regular", "FIFO named like a generation in the root")
def _(tmp, capsys):
    gen = make_generation(tmp, 1)
    os.mkfifo(tmp / "gen-000000009-00000000000000ff")
    code, out, _ = run_cli(capsys, "verify", str(tmp), "--all")
    assert code == 1 and "generation directory is a fifo" in out
    assert load(tmp).path == gen
    code, out, _ = run_cli(capsys, "gc", str(tmp), "--keep", "1")
    assert code == 0 and not os.path.lexists(tmp / "gen-000000009-00000000000000ff")


@root_case("non-regular", "the path given is a FIFO")
def _(tmp, capsys):
    os.mkfifo(tmp / "pipe")
    code, _, err = run_cli(capsys, "verify", str(tmp / "pipe"))
    assert code == 2 and "is a fifo, not a checkpoint directory" in err
    with pytest.raises(CheckpointError, match="is a fifo"):
        load(tmp / "pipe")


def _linked_entry(tmp: Path, name: str, capsys) -> None:
    gen = make_generation(tmp, 1)
    target = tmp.parent / f"target-of-{name}"
    target.mkdir()
    (target / "precious").write_text("keep me")
    (tmp / name).symlink_to(target, target_is_directory=True)
    lease.release(tmp)  # no live writer: gc may touch staging
    for _ in range(2):  # and a second gc does not fail the same way
        code, out, _ = run_cli(capsys, "gc", str(tmp), "--keep", "1", "--staging-min-age", "0")
        assert code == 0, out
    assert not os.path.lexists(tmp / name) and (target / "precious").read_text() == "keep me"
    assert load(tmp).path == gen


@root_case("root-entries", "a gen-* symlink: gc removes the link, never its target")
def _(tmp, capsys):
    _linked_entry(tmp, "gen-000000000-00000000000000aa", capsys)


@root_case("root-entries", "a .staging-* symlink: gc unlinks it")
def _(tmp, capsys):
    _linked_entry(tmp, ".staging-00000000000000aa", capsys)


@root_case("root-entries", "a .deleting-* symlink: gc finishes it")
def _(tmp, capsys):
    _linked_entry(tmp, ".deleting-gen-000000000-00000000000000aa", capsys)


@root_case("root-entries", "a plain file named like a generation is damaged and removed")
def _(tmp, capsys):
    make_generation(tmp, 2)
    (tmp / "gen-000000001-00000000000000aa").write_text("not a directory")
    code, out, _ = run_cli(capsys, "ls", str(tmp))
    assert "generation directory is a regular file" in out
    assert run_cli(capsys, "gc", str(tmp), "--keep", "1")[0] == 0
    assert not (tmp / "gen-000000001-00000000000000aa").exists()


@root_case("exceptions", "a dangling gen-* symlink in the root is skipped, never a crash")
def _(tmp, capsys):
    gen = make_generation(tmp, 1)
    (tmp / "gen-000000099-00000000000000ab").symlink_to(tmp / "nowhere")
    code, out, err = run_cli(capsys, "verify", str(tmp))
    assert code == 0 and gen.name in out
    assert load(tmp).path == gen


@root_case("exceptions", "a deeply nested tracker becomes a warning")
def _(tmp, capsys):
    gen = make_generation(tmp, 1)
    (tmp / TRACKER).write_bytes(nested(10_000))
    code, _, err = run_cli(capsys, "verify", str(tmp))
    assert code == 0 and "nested" in err
    assert load(tmp).path == gen


@root_case("exceptions", "Infinity in the tracker becomes a warning")
def _(tmp, capsys):
    gen = make_generation(tmp, 1)
    tracker = json.loads((tmp / TRACKER).read_text())
    (tmp / TRACKER).write_text(json.dumps(dict(tracker, sequence=float("inf"))))
    code, _, err = run_cli(capsys, "verify", str(tmp))
    assert code == 0 and "non-finite JSON constant Infinity" in err
    assert load(tmp).path == gen


@root_case("clocks", "#7 a node's clock ran ahead: order by sequence, and tracker, ls and load agree")
def _(tmp, capsys):
    first = make_generation(tmp, 10)
    edit_manifest(first, lambda b: b.update(created_unix_ns=b["created_unix_ns"] + 10**15))  # clock ahead
    second = make_generation(tmp, 12)
    assert load(tmp).path == second
    listing = ls_json(tmp, capsys)
    assert [e["name"] for e in listing["entries"]] == [second.name, first.name]
    assert listing["tracker"] == second.name and listing["warnings"] == []
    assert [e["sequence"] for e in listing["entries"]] == [2, 1]


@root_case("clocks", "the tracker names an older generation: a warning names both")
def _(tmp, capsys):
    first = make_generation(tmp, 1)
    second = make_generation(tmp, 2)
    tracker = json.loads((tmp / TRACKER).read_text())
    (tmp / TRACKER).write_text(
        json.dumps(dict(tracker, generation_dir=first.name, generation=first.name[-16:], iteration=1, sequence=1))
    )
    code, _, err = run_cli(capsys, "verify", str(tmp))
    assert code == 0 and f"tracker names {first.name} (sequence 1)" in err and f"{second.name} (sequence 2)" in err
    opened = load(tmp)
    assert opened.path == second and any(first.name in w and second.name in w for w in opened.warnings)


@root_case("clocks", "the tracker names a generation that is gone: a warning names both")
def _(tmp, capsys):
    first = make_generation(tmp, 1)
    second = make_generation(tmp, 2)
    shutil.rmtree(second)
    code, _, err = run_cli(capsys, "verify", str(tmp))
    assert code == 0 and f"tracker names {second.name} (sequence 2), which is not in this root" in err
    assert f"{first.name} (sequence 1)" in err


@root_case("clocks", "a new save numbers itself after every committed generation and the tracker")
def _(tmp, capsys):
    make_generation(tmp, 5)
    second = make_generation(tmp, 3)  # a run restarted from an older iteration
    edit_manifest(second, lambda b: b.update(sequence=41))
    third = make_generation(tmp, 4)
    assert json.loads((third / MANIFEST).read_text())["sequence"] == 42
    assert load(tmp).path == third


@root_case("messages", "a stray manifest.json in a save root is named and ignored")
def _(tmp, capsys):
    gen = make_generation(tmp, 1)
    shutil.copy(gen / MANIFEST, tmp / MANIFEST)
    code, out, err = run_cli(capsys, "verify", str(tmp))
    assert code == 0 and gen.name in out and f"{tmp / MANIFEST}: a stray manifest.json in a save root" in err
    code, _, err = run_cli(capsys, "ls", str(tmp))
    assert code == 0 and f"{tmp / MANIFEST}: a stray manifest.json in a save root" in err
    assert load(tmp).path == gen


@root_case("messages", "the CLI turns an internal error into one line and exit 3 (--debug: traceback)")
def _(tmp, capsys):
    make_generation(tmp, 1)
    from miles_lora_ckpt.core import verify

    original = verify.view_root
    verify.view_root = lambda *a, **k: 1 / 0
    try:
        capsys.readouterr()
        assert cli(["ls", str(tmp)]) == 3
        err = capsys.readouterr().err
        assert "INTERNAL ERROR ZeroDivisionError" in err and "Traceback" not in err
        assert cli(["ls", str(tmp), "--debug"]) == 3
        assert "Traceback" in capsys.readouterr().err
    finally:
        verify.view_root = original


def _foreign_lease(tmp: Path, *, host: str, pid: int, age_s: float, boot_id: str = "other-boot") -> None:
    lease.release(tmp)
    holder = {"host": host, "pid": pid, "run": "run-b", "token": "00ff00ff00ff00ff", "boot_id": boot_id}
    body = {"format": "miles-lora-ckpt-lease", "holder": holder, "acquired_unix_s": 0, "timeout_s": 60.0}
    (tmp / LEASE).write_text(json.dumps(body))
    then = time.time() - age_s
    os.utime(tmp / LEASE, (then, then))


@root_case("writers", "a lease naming this host with a pid no process can have: ls, gc and a save finish")
def _(tmp, capsys):
    gen = make_generation(tmp, 1)
    (tmp / ".staging-00000000000000aa").mkdir()  # so gc judges the lease too
    me = lease.me()
    for pid in (2**31, 0):
        _foreign_lease(tmp, host=me.host, pid=pid, age_s=0, boot_id=me.boot_id)
        code, out, _ = run_cli(capsys, "ls", str(tmp))
        assert code == 0 and gen.name in out
        assert f"stale: host {me.host} pid {pid}" in out and "is gone" in out, out
        code, out, _ = run_cli(capsys, "gc", str(tmp), "--keep", "1", "--dry-run", "--staging-min-age", "0")
        assert code == 0 and "would remove " + str(tmp / ".staging-00000000000000aa") in out, out
    assert make_generation(tmp, 2).exists()  # the stale lease is taken over


@root_case("writers", "#5 a live lease of another writer: the save is refused before anything is written")
def _(tmp, capsys):
    gen = make_generation(tmp, 1)
    _foreign_lease(tmp, host="other-host", pid=4242, age_s=5)
    before = sorted(os.listdir(tmp))
    with pytest.raises(CheckpointError) as info:
        make_generation(tmp, 2)
    text = str(info.value)
    assert "phase 'prepare'" in text and "has another writer" in text and "host other-host pid 4242 run run-b" in text
    assert sorted(os.listdir(tmp)) == before and load(tmp).path == gen


@root_case("writers", "a lease not renewed for its timeout is taken over")
def _(tmp, capsys):
    make_generation(tmp, 1)
    _foreign_lease(tmp, host="other-host", pid=4242, age_s=3600)
    assert make_generation(tmp, 2).exists()
    assert json.loads((tmp / LEASE).read_text())["holder"]["pid"] == os.getpid()


@root_case("writers", "the lease of a dead process on this host is taken over at once")
def _(tmp, capsys):
    make_generation(tmp, 1)
    gone = subprocess.Popen(["true"])
    gone.wait()
    _foreign_lease(tmp, host=socket.gethostname(), pid=gone.pid, age_s=1, boot_id=lease.me().boot_id)
    assert make_generation(tmp, 2).exists()


@root_case("writers", "retention never touches the staging directory of a live writer")
def _(tmp, capsys):
    make_generation(tmp, 1)
    _foreign_lease(tmp, host="other-host", pid=4242, age_s=1)
    staging = tmp / ".staging-00000000000000cc"
    staging.mkdir()
    os.utime(staging, (time.time() - 10**6, time.time() - 10**6))
    code, out, _ = run_cli(capsys, "gc", str(tmp), "--keep", "1", "--staging-min-age", "0")
    assert code == 0 and staging.exists() and "left alone" in out
    listing = ls_json(tmp, capsys)
    assert next(e for e in listing["entries"] if e["name"] == staging.name)["live_writer"] is True


@root_case("writers", "the lease holder's own retention removes abandoned staging directories")
def _(tmp, capsys):
    make_generation(tmp, 1)
    abandoned = tmp / ".staging-00000000000000dd"
    abandoned.mkdir()

    def write(writer):
        writer.write_json("x.json", {})

    save_generation(
        Consensus.single_process(), tmp, iteration=2, saver="test", topology=Topology(), write_files=write, keep=5
    )
    assert not abandoned.exists()


@root_case("writers", "a holder that lost its lease does not publish")
def _(tmp, capsys):
    make_generation(tmp, 1)

    def write(writer):
        _foreign_lease(tmp, host="other-host", pid=4242, age_s=1)  # taken over mid-save
        writer.write_json("x.json", {})

    with pytest.raises(CheckpointError, match="(?s)phase 'publish'.*lost its writer lease"):
        save_generation(
            Consensus.single_process(), tmp, iteration=2, saver="test", topology=Topology(), write_files=write
        )
    assert [p.name for p in tmp.glob("gen-*")] == [p.name for p in tmp.glob("gen-000000001-*")]


@root_case("exceptions", "a manifest the loader finds damaged is skipped; a bug or an incompatible one fails the load")
def _(tmp, capsys):
    older = make_generation(tmp, 1)
    newest = make_generation(tmp, 2)

    def files(manifest):
        if manifest.iteration == 2:
            raise GenerationDamaged("manifest metadata has no 'optimizer_children'")  # what a check finds
        return [ADAPTER]

    opened = open_generation(Consensus.single_process(), tmp, files)
    assert opened.path == older and any(newest.name in w and "optimizer_children" in w for w in opened.warnings)

    def buggy(manifest):
        return [ADAPTER] + manifest.metadata["optimizer_children"]  # a bug: KeyError, not damage

    with pytest.raises(CheckpointError, match=r"(?s)phase 'resolve'.*KeyError: 'optimizer_children'"):
        open_generation(Consensus.single_process(), tmp, buggy)  # never the older generation

    def incompatible(manifest):
        raise IncompatibleCheckpoint("exact restore needs the same model-parallel layout (tp: 1 -> 2)")

    with pytest.raises(CheckpointError, match=r"tp: 1 -> 2"):
        open_generation(Consensus.single_process(), tmp, incompatible)


@root_case("exceptions", "a forged sequence cannot wedge later saves silently")
def _(tmp, capsys):
    gen = make_generation(tmp, 1)
    edit_manifest(gen, lambda b: b.update(sequence=2**62))
    with pytest.raises(CheckpointError, match="claims sequence 4611686018427387904"):
        make_generation(tmp, 2)


def _v1_generation(root: Path) -> Path:
    """A format v1 generation as the previous release wrote it: no sequence, stamps or bindings."""
    gen = make_generation(root, 3)
    reseal_file(gen, STATE, json.dumps({"iteration": 3}).encode())

    def to_v1(body):
        body["format_version"] = 1
        body.pop("sequence")
        for record in body["files"].values():
            record.pop("binding", None)

    edit_manifest(gen, to_v1)
    for rel in (ADAPTER, OPTIM, OPTIM1):
        rewrite_header(gen, rel, lambda h: h.pop("__metadata__"))
    lease.release(root)
    (root / LEASE).unlink(missing_ok=True)
    tracker = json.loads((root / TRACKER).read_text())
    tracker.pop("sequence")
    (root / TRACKER).write_text(json.dumps(tracker))
    return gen


@root_case("compat", "a format v1 generation verifies and loads, and a v2 save after it comes first")
def _(tmp, capsys):
    v1 = _v1_generation(tmp)
    code, out, _ = run_cli(capsys, "verify", str(tmp))
    assert code == 0 and "(format v1: no sequence)" in out
    assert load(tmp).path == v1
    v2 = make_generation(tmp, 2)  # an older iteration, saved later: the newest commit
    assert json.loads((v2 / MANIFEST).read_text())["sequence"] == 1 and load(tmp).path == v2


@root_case("compat", "a format v1 generation is refused when a signing key is configured")
def _(tmp, capsys):
    _v1_generation(tmp)
    with settings.overridden(hmac_key=KEY):
        code, out, _ = run_cli(capsys, "verify", str(tmp))
    assert code == 1 and "format v1 generations are unsigned" in out and "save it again" in out


@root_case("signing", "a signed generation verifies with its key and says so")
def _(tmp, capsys):
    gen = make_generation(tmp, 1, key=KEY)
    with settings.overridden(hmac_key=KEY):
        code, out, _ = run_cli(capsys, "verify", str(tmp))
        assert load(tmp).path == gen
    assert code == 0 and "signed (verified)" in out
    code, out, _ = run_cli(capsys, "verify", str(tmp))  # without a key: accepted, not checked
    assert code == 0 and "not checked: no key" in out
    assert KEY not in (gen / MANIFEST).read_text()


@root_case("signing", "an unusable key file is a configuration error naming it (exit 2)")
def _(tmp, capsys):
    make_generation(tmp, 1)
    short = tmp.parent / "short.key"
    short.write_text("tiny")
    code, _, err = run_cli(capsys, "--hmac-key-file", str(short), "verify", str(tmp))
    assert code == 2 and "at least 16 are needed" in err
    code, _, err = run_cli(capsys, "verify", str(tmp), "--hmac-key-file", str(tmp.parent / "missing.key"))
    assert code == 2 and "does not exist" in err


@root_case("verify-is-load", "verify OK means the loader's content checks pass (every file read)")
def _(tmp, capsys):
    gen = make_generation(tmp, 1)
    reseal_file(gen, OPTIM1, tensor_file_with(float("nan")), finite=False)  # a file the loader does not ask for
    code, out, _ = run_cli(capsys, "verify", str(gen))
    assert code == 1 and f"ERROR {OPTIM1}: tensor 'lora_A' holds NaN or Inf" in out
    with pytest.raises(CheckpointError, match="holds NaN or Inf"):
        load(gen, files=(ADAPTER,))


@pytest.mark.parametrize("name", sorted(ROOT_CASES), ids=lambda name: name.replace(" ", "-"))
def test_root_case(name, tmp_path, capsys):
    root = tmp_path / "root"
    root.mkdir()
    ROOT_CASES[name][1](root, capsys)


def test_corpus_covers_every_class_with_at_least_60_cases():
    classes = [case[0] for case in CASES.values()] + [klass for klass, _ in ROOT_CASES.values()]
    assert len(classes) >= 60, len(classes)
    assert set(classes) == set(CLASSES), set(CLASSES) ^ set(classes)
    assert sum(1 for c in classes if c == "bytes") == 29


def test_root_falls_back_past_a_damaged_newest_generation(tmp_path, caplog, capsys):
    root = tmp_path / "root"
    older = make_generation(root, iteration=5)
    newest = make_generation(root, iteration=6)
    flip_byte(newest / ADAPTER, -2)
    opened = open_generation(Consensus.single_process(), root, lambda m: [ADAPTER])
    assert opened.path == older
    assert "skipping damaged generation" in caplog.text and newest.name in caplog.text
    assert cli(["verify", str(root)]) == 0
    assert newest.name in capsys.readouterr().err
    assert cli(["verify", str(root), "--all"]) == 1


def test_staging_directory_is_never_a_checkpoint(tmp_path, capsys):
    root = tmp_path / "root"
    make_generation(root)
    staging = root / ".staging-0123456789abcdef"
    staging.mkdir()
    (staging / "x.json").write_text("{}")
    assert cli(["verify", str(staging)]) == 1
    assert "uncommitted staging" in capsys.readouterr().out
    for gen in root.glob("gen-*"):
        shutil.rmtree(gen)
    (root / "latest_generation.json").unlink()
    assert cli(["verify", str(root)]) == 1
    with pytest.raises(CheckpointError, match="no committed generation"):
        open_generation(Consensus.single_process(), root, lambda m: [])


def test_an_intact_generation_loads_bit_exact(tmp_path):
    gen = make_generation(tmp_path / "root", iteration=7)
    opened = load(tmp_path / "root")
    assert opened.path == gen
    reference = torch.Generator().manual_seed(7)
    assert torch.equal(opened.tensors(ADAPTER)["lora_A"], torch.randn(4, 8, generator=reference))
    assert opened.json(STATE)["generation"] == gen.name[-16:]


# =========================================================================== role bindings by name

# The single-LoRA saver's file names, with the binding its loader requires of each (format v2+).
NAMED_FILES = {
    "training_state.json": {"role": "training-state"},
    "adapter/dense_tp000_pp000.safetensors": {"role": "dense-adapter", "coordinate": "tp000_pp000"},
    "adapter/expert_pp000_ep000_etp000.safetensors": {"role": "expert-adapter", "coordinate": "pp000_ep000_etp000"},
    "optimizer/child0_tp000_pp000_ep000_etp000_s000of001.safetensors": {
        "role": "optimizer",
        "coordinate": "tp000_pp000_ep000_etp000",
        "child": "0",
        "slice": "0/1",
    },
    "optimizer/child1_tp000_pp000_ep000_etp000_dp000_cp000.safetensors": {
        "role": "optimizer",
        "coordinate": "tp000_pp000_ep000_etp000_dp000_cp000",
        "child": "1",
    },
    "rng/rank00000.safetensors": {"role": "rng-state", "rank": "0"},
}


def make_named_generation(root: Path, saver: str, iteration: int = 7) -> Path:
    def write(writer):
        for rel, binding in NAMED_FILES.items():
            if rel.endswith(".json"):
                writer.write_json(rel, training_state(iteration, writer.generation), binding=binding)
            elif rel.startswith("rng/"):  # an RNG file holds 1-D uint8 tensors of known names only
                writer.write_tensors(rel, {"torch.cpu": torch.zeros(8, dtype=torch.uint8)}, binding=binding)
            else:
                writer.write_tensors(rel, {"w": torch.ones(4)}, binding=binding)

    return save_generation(
        Consensus.single_process(), root, iteration=iteration, saver=saver, topology=Topology(), write_files=write
    )


def _drop_binding(rel: str, *keys: str):
    def change(body):
        binding = body["files"][rel].setdefault("binding", {})
        for key in keys or list(binding):
            binding.pop(key, None)
        if not binding:
            body["files"][rel].pop("binding")

    return change


# (file, the manifest edit): the stamps still agree (they are compared on the binding's keys only)
UNBOUND_CASES = {
    "training state's role dropped": ("training_state.json", _drop_binding("training_state.json")),
    "training state's role renamed": (
        "training_state.json",
        lambda b: b["files"]["training_state.json"]["binding"].update(role="notes"),
    ),
    "dense adapter's binding dropped": (
        "adapter/dense_tp000_pp000.safetensors",
        _drop_binding("adapter/dense_tp000_pp000.safetensors"),
    ),
    "expert adapter's coordinate dropped": (
        "adapter/expert_pp000_ep000_etp000.safetensors",
        _drop_binding("adapter/expert_pp000_ep000_etp000.safetensors", "coordinate"),
    ),
    "optimizer slice's slice dropped": (
        "optimizer/child0_tp000_pp000_ep000_etp000_s000of001.safetensors",
        _drop_binding("optimizer/child0_tp000_pp000_ep000_etp000_s000of001.safetensors", "slice"),
    ),
    "RNG file's rank dropped": ("rng/rank00000.safetensors", _drop_binding("rng/rank00000.safetensors", "rank")),
    "optimizer file's binding dropped": (
        "optimizer/child1_tp000_pp000_ep000_etp000_dp000_cp000.safetensors",
        _drop_binding("optimizer/child1_tp000_pp000_ep000_etp000_dp000_cp000.safetensors"),
    ),
}


def test_named_files_with_their_bindings_verify_and_load(tmp_path, capsys):
    for saver in ("single-lora", "multi-lora-slot", "test"):
        gen = make_named_generation(tmp_path / saver, saver)
        assert cli(["verify", str(gen)]) == 0, capsys.readouterr()
        assert load(gen, files=tuple(NAMED_FILES)).json("training_state.json")["iteration"] == 7


@pytest.mark.parametrize("saver", ["single-lora", "multi-lora-slot"])
@pytest.mark.parametrize("case", sorted(UNBOUND_CASES), ids=lambda name: name.replace(" ", "-"))
def test_a_file_named_like_a_role_bearing_file_without_its_binding_is_refused(case, saver, tmp_path, capsys):
    rel, change = UNBOUND_CASES[case]
    gen = make_named_generation(tmp_path / "root", saver)
    edit_manifest(gen, change)
    capsys.readouterr()
    assert cli(["verify", str(gen)]) == 1
    out = capsys.readouterr().out
    why = f"expected {NAMED_FILES[rel]} (the binding a {saver} file of this name carries"
    assert f"ERROR {rel}: the manifest binds it to " in out and why in out, out
    with pytest.raises(CheckpointError) as info:
        load(gen, files=tuple(NAMED_FILES))
    assert f"{rel}: the manifest binds it to " in str(info.value) and why in str(info.value), str(info.value)


def test_the_name_rules_know_the_savers_that_write_the_single_lora_files():
    from miles_lora_ckpt.core import content_rules
    from miles_lora_ckpt.savers.multi_lora.naming import SLOT_SAVER
    from miles_lora_ckpt.savers.single_lora.common import SAVER

    assert set(content_rules.BOUND_SAVERS) == {SAVER, SLOT_SAVER}


def test_a_forged_tracker_sequence_never_stops_saves_nor_numbers_them(tmp_path, caplog, capsys):
    """The tracker is an unsigned hint: its `sequence` counts only when it names a generation of the
    root whose manifest agrees; a forged 2^62 (the last number there is) is a warning, not the end."""
    root = tmp_path / "root"
    first = make_generation(root, 1, key=KEY)
    tracker = json.loads((root / TRACKER).read_text())
    assert tracker["sequence"] == 1
    for forged in (
        dict(tracker, sequence=2**62),  # names the generation there, with another sequence
        dict(tracker, generation_dir="gen-000000009-0123456789abcdef", generation="0123456789abcdef", sequence=2**62),
    ):
        (root / TRACKER).write_text(json.dumps(forged))
        caplog.clear()
        with settings.overridden(hmac_key=KEY):
            gen = make_generation(root, 2, key=KEY)
        assert json.loads((gen / MANIFEST).read_text())["sequence"] == 2, "numbered after the generations only"
        assert f"the tracker claims sequence {2**62}" in caplog.text and "not counted" in caplog.text, caplog.text
        shutil.rmtree(gen)
    # a tracker that agrees with its generation counts as before (the same number as its manifest)
    (root / TRACKER).write_text(json.dumps(tracker))
    assert json.loads((make_generation(root, 2) / MANIFEST).read_text())["sequence"] == 2
    assert load(root).path != first
