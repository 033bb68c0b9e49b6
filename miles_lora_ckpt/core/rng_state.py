"""One process's random number generator states, as two sealed files of its rank (no pickle).

A single-LoRA generation holds, for every rank ``r`` (zero-padded to five digits)::

    rng/rank00000.json          Python's and numpy's states, and the tensor file's names
    rng/rank00000.safetensors   uint8 tensors: torch's CPU and CUDA generators (`torch.cpu`,
                                `torch.cuda`) and megatron's RNG tracker states (`tracker.<name>`)

Both are bound to ``{"role": "rng-state", "rank": "<r>"}`` and checked strictly before use. States
are restored only after every rank agreed on the load, so a failed load leaves every generator
untouched. The tracker's states come from `megatron.rng_tracker`; this module imports no megatron.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import torch

from miles_lora_ckpt.core import bounded

__all__ = [
    "CPU",
    "MAX_RNG_FILE_BYTES",
    "ROLE_RNG",
    "RngState",
    "binding",
    "capture",
    "check",
    "check_size",
    "check_tensors",
    "decode",
    "encode",
    "json_file",
    "named_binding",
    "restore",
    "tensor_file",
]

ROLE_RNG = "rng-state"
RNG_FORMAT = 1
MAX_RNG_FILE_BYTES = 1 << 20  # a torch CPU state is 5 KiB; the JSON about 10 KiB
MAX_RNG_TENSORS = 64
MAX_RNG_TENSOR_BYTES = 64 * 1024
_PYTHON_WORDS = 625  # Mersenne Twister: 624 words and the index
_NUMPY_WORDS = 624
_U32 = 2**32 - 1
_FILE = re.compile(r"rng/rank([0-9]{5})\.(json|safetensors)\Z")
_TRACKER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}\Z")
CPU, CUDA, TRACKER = "torch.cpu", "torch.cuda", "tracker."


def json_file(rank: int) -> str:
    """The relpath of rank `rank`'s JSON file (`rng/rank00003.json`)."""
    return f"rng/rank{rank:05d}.json"


def tensor_file(rank: int) -> str:
    """The relpath of rank `rank`'s tensor file (`rng/rank00003.safetensors`)."""
    return f"rng/rank{rank:05d}.safetensors"


def binding(rank: int) -> dict[str, str]:
    """What both of rank `rank`'s RNG files are (stamped and recorded like every binding)."""
    return {"role": ROLE_RNG, "rank": str(rank)}


def named_binding(relpath: str) -> dict[str, str] | None:
    """The binding an RNG file named `relpath` carries, or None when the name is no RNG file's."""
    match = _FILE.fullmatch(relpath)
    return binding(int(match[1])) if match else None


@dataclass
class RngState:
    """Every generator state of one process.

    `tracker` is None where megatron's tracker was not initialised or not asked for; `cuda` is None
    where CUDA is not in use.
    """

    python: tuple
    numpy: tuple | None
    cpu: torch.Tensor
    cuda: torch.Tensor | None = None
    tracker: dict[str, torch.Tensor] | None = field(default=None)

    def kinds(self) -> list[str]:
        """What it holds, for a log line: `["python", "numpy", "torch", "tracker(2)"]`."""
        kinds = ["python", *(["numpy"] if self.numpy is not None else []), "torch"]
        kinds += ["cuda"] if self.cuda is not None else []
        kinds += [f"tracker({len(self.tracker)})"] if self.tracker is not None else []
        return kinds


def capture(tracker: dict[str, torch.Tensor] | None = None) -> RngState:
    """Copies of this process's generator states now, with megatron's tracker states `tracker`."""
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state().clone()
    tracker = None if tracker is None else {n: t.detach().to("cpu", torch.uint8).clone() for n, t in tracker.items()}
    return RngState(random.getstate(), _numpy_state(), torch.get_rng_state().clone(), cuda, tracker)


def restore(state: RngState) -> None:
    """Set this process's Python, numpy, torch and CUDA generators to `state`.

    The tracker is `megatron.rng_tracker.restore`'s. `decode` checked `state` first, so this cannot
    fail.
    """
    random.setstate(state.python)
    if state.numpy is not None:
        import numpy

        numpy.random.set_state(state.numpy)
    torch.set_rng_state(state.cpu)
    if state.cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state.cuda)


def encode(state: RngState, rank: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """The content of rank `rank`'s two files: `(JSON value, {name: uint8 tensor})`."""
    version, words, gauss = state.python
    tensors = {CPU: state.cpu}
    if state.cuda is not None:
        tensors[CUDA] = state.cuda
    for name, value in sorted((state.tracker or {}).items()):
        tensors[TRACKER + name] = value
    numpy_state = None
    if state.numpy is not None:
        kind, key, pos, has_gauss, cached = state.numpy
        numpy_state = {
            "bit_generator": str(kind),
            "key": [int(k) for k in key],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    value = {
        "format": RNG_FORMAT,
        "rank": rank,
        "python": {"version": version, "state": list(words), "gauss_next": gauss},
        "numpy": numpy_state,
        "tensors": sorted(tensors),
        "tracker": None if state.tracker is None else sorted(state.tracker),
    }
    return value, {n: t.contiguous() for n, t in tensors.items()}


def decode(value, tensors: dict[str, torch.Tensor], rank: int) -> RngState:
    """The `RngState` of rank `rank`'s two files, the JSON `value` and `tensors`.

    The JSON is checked again, the tensors against it, and the torch and CUDA states against this
    process's sizes, so their restore cannot fail. Raises ValueError. The tracker's states are
    checked by `megatron.rng_tracker.check_restorable`.
    """
    check(value, rank)
    check_tensors({n: (str(t.dtype), list(t.shape)) for n, t in tensors.items()})
    if sorted(tensors) != value["tensors"]:
        raise ValueError(f"the RNG tensor file holds {sorted(tensors)[:8]}, its JSON lists {value['tensors'][:8]}")
    tracker_names = value["tracker"]
    if tracker_names is not None and sorted(TRACKER + n for n in tracker_names) != sorted(
        n for n in tensors if n.startswith(TRACKER)
    ):
        raise ValueError("the RNG JSON's tracker names are not the tracker tensors the file holds")
    if CPU not in tensors:
        raise ValueError(f"the RNG tensor file has no {CPU!r}")
    _check_size(CPU, tensors[CPU], torch.get_rng_state())
    if CUDA in tensors and torch.cuda.is_available():
        _check_size(CUDA, tensors[CUDA], torch.cuda.get_rng_state())
    python = value["python"]
    numpy_state = value["numpy"]
    if numpy_state is not None:
        import numpy

        numpy_state = (
            numpy_state["bit_generator"],
            numpy.array(numpy_state["key"], dtype=numpy.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    tracker = None
    if tracker_names is not None:
        tracker = {n: tensors[TRACKER + n].clone() for n in tracker_names}
    return RngState(
        (python["version"], tuple(python["state"]), python["gauss_next"]),
        numpy_state,
        tensors[CPU].clone(),
        tensors[CUDA].clone() if CUDA in tensors else None,
        tracker,
    )


def check(value, rank: int | None = None) -> None:
    """Check every rule of an RNG JSON file, for the loader and `verify` alike.

    `rank` is the one its binding names. Raises ValueError naming the field.
    """
    bounded.mapping(value, "rng")
    expected = {"format", "rank", "python", "numpy", "tensors", "tracker"}
    if set(value) != expected:
        raise ValueError(f"rng: keys {sorted(value)}, expected {sorted(expected)}")
    if value["format"] != RNG_FORMAT:
        raise ValueError(f"rng.format is {value['format']!r:.40}, this version reads {RNG_FORMAT}")
    bounded.integer(value["rank"], "rng.rank", low=0, high=2**31)
    if rank is not None and value["rank"] != rank:
        raise ValueError(f"rng.rank is {value['rank']}, but the file is rank {rank}'s")
    python = value["python"]
    bounded.mapping(python, "rng.python")
    if set(python) != {"version", "state", "gauss_next"} or python["version"] != 3:
        raise ValueError("rng.python must be {version: 3, state: [625 ints], gauss_next: null or a number}")
    _words(python["state"], "rng.python.state", _PYTHON_WORDS, last_high=_NUMPY_WORDS)
    _optional_float(python["gauss_next"], "rng.python.gauss_next")
    numpy_state = value["numpy"]
    if numpy_state is not None:
        bounded.mapping(numpy_state, "rng.numpy")
        keys = {"bit_generator", "key", "pos", "has_gauss", "cached_gaussian"}
        if set(numpy_state) != keys or numpy_state["bit_generator"] != "MT19937":
            raise ValueError(f"rng.numpy must hold {sorted(keys)} of an MT19937 state")
        _words(numpy_state["key"], "rng.numpy.key", _NUMPY_WORDS)
        bounded.integer(numpy_state["pos"], "rng.numpy.pos", low=0, high=_NUMPY_WORDS)
        bounded.integer(numpy_state["has_gauss"], "rng.numpy.has_gauss", low=0, high=1)
        _optional_float(numpy_state["cached_gaussian"], "rng.numpy.cached_gaussian", required=True)
    names = value["tensors"]
    if not isinstance(names, list) or not 1 <= len(names) <= MAX_RNG_TENSORS or names != sorted(set(names)):
        raise ValueError(f"rng.tensors must list 1 to {MAX_RNG_TENSORS} distinct tensor names, sorted")
    for name in names:
        _tensor_name(name)
    tracker = value["tracker"]
    if tracker is not None:
        if not isinstance(tracker, list) or len(tracker) > MAX_RNG_TENSORS:
            raise ValueError(f"rng.tracker must be null or a list of at most {MAX_RNG_TENSORS} names")
        for name in tracker:
            if not isinstance(name, str) or not _TRACKER_NAME.fullmatch(name):
                raise ValueError(f"rng.tracker: {name!r:.60} is not a tracker name")


def check_tensors(entries: dict[str, tuple[str, list]]) -> None:
    """Check every rule of an RNG tensor file, given `{name: (dtype, shape)}`; ValueError if broken.

    The dtypes are a header's tags or torch's names. The file holds at most `MAX_RNG_TENSORS` 1-D
    uint8 tensors of at most `MAX_RNG_TENSOR_BYTES` each.
    """
    if not 1 <= len(entries) <= MAX_RNG_TENSORS:
        raise ValueError(f"an RNG tensor file holds 1 to {MAX_RNG_TENSORS} tensors, this one {len(entries)}")
    for name, (dtype, shape) in entries.items():
        _tensor_name(name)
        if dtype not in ("U8", "torch.uint8"):
            raise ValueError(f"RNG tensor {name!r} is {dtype}, not uint8")
        if shape is not None and (len(shape) != 1 or not 1 <= shape[0] <= MAX_RNG_TENSOR_BYTES):
            raise ValueError(f"RNG tensor {name!r} has shape {shape}: 1-D, 1 to {MAX_RNG_TENSOR_BYTES} bytes")


def check_size(relpath: str, size: int) -> None:
    """Refuse (ValueError) an RNG file whose manifest size is above `MAX_RNG_FILE_BYTES`."""
    if size > MAX_RNG_FILE_BYTES:
        raise ValueError(f"{relpath}: an RNG file of {size} bytes, more than the {MAX_RNG_FILE_BYTES} allowed")


def _check_size(name: str, saved: torch.Tensor, live: torch.Tensor) -> None:
    if saved.numel() != live.numel():
        raise ValueError(f"RNG tensor {name!r} has {saved.numel()} bytes, the generator state here {live.numel()}")


def _tensor_name(name) -> None:
    if not isinstance(name, str) or not (
        name in (CPU, CUDA) or (name.startswith(TRACKER) and _TRACKER_NAME.fullmatch(name[len(TRACKER) :]))
    ):
        raise ValueError(f"RNG tensor name {name!r:.60} is none of {CPU!r}, {CUDA!r}, '{TRACKER}<name>'")


def _words(words, where: str, count: int, last_high: int | None = None) -> None:
    if not isinstance(words, list) or len(words) != count:
        raise ValueError(f"{where} must be a list of {count} integers")
    for index, word in enumerate(words):
        high = last_high if last_high is not None and index == count - 1 else _U32
        bounded.integer(word, f"{where}[{index}]", low=0, high=high)


def _optional_float(value, where: str, *, required: bool = False) -> None:
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where} must be a number{'' if required else ' or null'}")


def _numpy_state() -> tuple | None:
    try:
        import numpy
    except ImportError:  # numpy is optional: its state is saved where it is installed
        return None
    state = numpy.random.get_state()
    return state if state[0] == "MT19937" else None
