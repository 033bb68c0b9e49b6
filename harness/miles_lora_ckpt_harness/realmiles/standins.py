"""Every stand-in the real-Miles tier uses, with its reason: the one list.

The real-Miles tier runs the `miles-rl` wheel (radixark Miles 0.0.2, pure Python), installed with
`--no-deps` into its own folder (`make tier-miles`, `.tier-miles/miles-rl-0.0.2`). The wheel ships
Miles (`miles`, `miles_plugins`), its own copy of Megatron-LM (`megatron/core` 0.16.0rc0 and
`megatron/training`) and of SGLang's Python tree (`sglang`). The tier folder is *appended* to
`sys.path` (`activate`): `megatron` is a namespace package, so `megatron.core` stays the real
megatron-core of the test tier (0.16.1 in .venv) and `megatron.training` is the wheel's real
Megatron-LM. Real pure-Python dependencies the wheel's modules need are installed into the same
folder by the Makefile (`six`, `pybase64`, `triton`: megatron-core's batch-invariant kernels import
it at module level).

What remains is GPU-only or cluster software, or a network client the checkpoint path never calls.
Each name below becomes a module whose every attribute is a placeholder: importing and naming it
works (`from ray.actor import ActorHandle`, `class X(ray.Something)`), *calling* or instantiating it
raises `StandInCalled` naming the stand-in and its reason. Nothing on the LoRA checkpoint path
calls them; a test that reached one would fail loudly.

`install()` puts them into `sys.modules`. Only the harness calls it: `activate`, from the real-Miles
harness job `realmiles/launch.py` and from the tests' signature subprocess. So the real names are
never stood in outside the harness; `tests/test_real_miles.py` checks that importing the plugin
leaves `import ray` failing. `installed()` says which are in place.

`ARGUMENT_STANDINS` lists what the wheel's argument parsing needs on top (SGLang's server-argument tree
imports them); only the validation job (`realmiles/wheel_args.py`) installs them
(`install_for_arguments`). The wheel's folder also gets the real `pillow` and `dill`, which SGLang's
model configs use at import time.

`SUBSTITUTIONS` lists the other harness pieces of a real-Miles run: names inside the wheel's modules
that the job replaces, and the parts of Miles it does not run (with the reason for each).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path

ENV = "MILES_LORA_CKPT_REAL_MILES"  # the tier folder (the Makefile sets it for the realmiles run)
WHEEL = "miles-rl==0.0.2"
SHAPE = "miles-rl-0.0.2"

# top-level name -> why it is stood in rather than installed
STANDINS: dict[str, str] = {
    "ray": "Ray (cluster runtime, 2.60, binary): Miles' actors and placement; the harness runs one process per rank",
    "torch_memory_saver": "GPU memory pausing for colocated SGLang (CUDA only)",
    "sglang_router": "SGLang's Rust router (binary wheel): rollout serving only",
    "requests": "HTTP client the wheel's SGLang copy and rollout code import at module level; never called",
    "aiohttp": "async HTTP client of the rollout code (binary wheel); never called",
    "httpx": "HTTP client of the rollout code; never called",
    "IPython": "notebook display helper imported by a debug utility; never called",
}

# top-level name -> why it is stood in: what the wheel's argument parsing imports (`miles.utils.arguments`
# imports SGLang's `server_args`, whose module tree imports these at module level; none is called while
# parsing or validating). Installed only by `install_for_arguments` (realmiles/wheel_args.py), after
# transformers has probed which optional packages exist, so transformers never takes one for the real one.
ARGUMENT_STANDINS: dict[str, str] = {
    "orjson": "fast JSON (binary wheel) of SGLang's utils; never called while parsing arguments",
    "starlette": "ASGI framework of SGLang's HTTP server; never called while parsing arguments",
    "torchvision": "image decoding in SGLang's utils (a binary wheel per torch build); never called here",
    "openai": "OpenAI client types SGLang's protocol models name as pydantic field types; never called",
    "partial_json_parser": "SGLang's function-call parser helper; never called while parsing arguments",
    "zmq": "ZeroMQ (binary wheel) of SGLang's scheduler IPC; never called while parsing arguments",
    "sentencepiece": "tokenizer (binary wheel) imported by SGLang's model configs; never called here",
    "nvidia_resiliency_ext": (
        "NVIDIA's resiliency extension (CUDA): Megatron-LM's validate_args imports its LocalCheckpointManager "
        "when --non-persistent-ckpt-type local is set; never called"
    ),
}
# top-level name -> why it is stood in: what the wheel's train actor module
# (`miles.backends.megatron_utils.actor`) imports on top of ARGUMENT_STANDINS (its weight-update and
# quantisation paths, which a checkpoint never runs). Installed only by `install_for_actor`.
ACTOR_STANDINS: dict[str, str] = {
    "compressed_tensors": "quantisation formats of the weight-update path to SGLang; never called by a save",
    "gguf": "GGUF weight format of SGLang's model loader; never called by a save",
    "mooncake": "Mooncake transfer engine (RDMA, binary) of the weight-update path; never called by a save",
}
_REASONS = {**STANDINS, **ARGUMENT_STANDINS, **ACTOR_STANDINS}


# what else a real-Miles run (realmiles/launch.py) does not take from the wheel, and why
SUBSTITUTIONS: dict[str, str] = {
    "miles.backends.megatron_utils.model.setup_model_and_optimizer": (
        "replaced by the harness's builder (sim.train.build_run: the harness model, megatron's optimizers, Miles' "
        "scheduler); Miles' builds a GPTModel through Megatron-LM's get_model on GPU"
    ),
    "miles.backends.megatron_utils.model.clear_memory": "gc only: Miles' calls torch.cuda.synchronize/empty_cache",
    "miles.backends.megatron_utils.model.train": (
        "not run: it runs a GPTModel's forward over rollout data; the harness's train step (sim.train.train_step, "
        "data a function of seed, step and DP rank) steps the same megatron optimizer and Miles' scheduler"
    ),
    "miles.backends.megatron_utils.initialize.init": (
        "run for real by the validation job (realmiles/wheel_args.py: megatron's groups over gloo, the seeds, "
        "Megatron-LM's NullTokenizer, the hook); its numpy-1.x assertion runs as is under make tier-miles (numpy "
        "1.26.4 first on PYTHONPATH), elsewhere it is answered by a numpy whose __version__ reads 1.x; the kill/relaunch launch (launch.py) does its steps instead (real set_args, "
        "megatron's groups, the wheel's create_megatron_parallel_state/set_parallel_state, the hook through the "
        "wheel's load_function), because its stand-in parser's args lack what init reads"
    ),
    "miles.utils.arguments (parse_args, miles_validate_args)": (
        "run for real by the validation job (realmiles/wheel_args.py) with ARGUMENT_STANDINS; the kill/relaunch "
        "launch parses with the stand-in parser (miles_standin/common/args.py), because the wheel's "
        "miles_validate_args forces start_rollout_id = 0 in bridge mode (fixed upstream by #2682), so its driver "
        "would replay from rollout 0"
    ),
    "miles.backends.megatron_utils.actor.MegatronTrainRayActor": (
        "its module is imported (with ACTOR_STANDINS) and its own save_model runs in the launches with "
        "wheel_actor (launch.py); its init and train need Ray and rollout data: RealWheelActor follows their "
        "call order (init hook, model setup and load, train)"
    ),
    "megatron.bridge": "the harness's Bridge double (bridge_double); its load_hf_weights writes nothing",
}


class StandInCalled(RuntimeError):
    """Code under test called into a stand-in: the real package is not installed here."""


def _placeholder(qualified: str, reason: str) -> type:
    def refuse(*_args, **_kwargs):
        raise StandInCalled(f"{qualified} is a real-Miles-tier stand-in ({reason}); it cannot be called here")

    class _Meta(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _placeholder(f"{qualified}.{name}", reason)

        def __call__(cls, *args, **kwargs):
            refuse()

        def __getitem__(cls, item):  # type annotations such as ActorHandle[Foo]
            return cls

    def pydantic_schema(cls, _source, _handler):
        # SGLang's OpenAI protocol models (pydantic) name openai's types as field types at import time
        from pydantic_core import core_schema

        return core_schema.any_schema()

    namespace = {
        "__module__": qualified.rsplit(".", 1)[0],
        "refuse": refuse,
        "__get_pydantic_core_schema__": classmethod(pydantic_schema),
    }
    return _Meta(qualified.rsplit(".", 1)[-1], (), namespace)


def _ray_remote(*args, **kwargs):
    """`@ray.remote` and `@ray.remote(num_cpus=...)` at import time: the object, undecorated (its
    `.remote(...)` does not exist, so a call through Ray fails)."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda obj: obj


class _RouterArgs:
    """`sglang_router.launch_router.RouterArgs` for the wheel's parser: Miles calls
    `RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)` while building its
    parser; here it declares none of the router's `--router-*` flags (rollout serving only), so a
    command with one is refused as an unknown flag."""

    @staticmethod
    def add_cli_args(parser, use_router_prefix: bool = False, exclude_host_port: bool = False):
        return parser


# attributes a stand-in must really provide because Miles uses them at import time or while parsing
_IMPORT_TIME = {"ray.remote": _ray_remote, "sglang_router.launch_router.RouterArgs": _RouterArgs}


class _StandInModule(types.ModuleType):
    def __init__(self, name: str, reason: str):
        super().__init__(name, f"real-Miles tier stand-in: {reason}")
        self.__path__ = []  # a package: submodules resolve through the finder below
        self.__miles_lora_ckpt_standin__ = reason
        self.__spec__ = importlib.machinery.ModuleSpec(name, _FINDER, is_package=True)
        for qualified, value in _IMPORT_TIME.items():
            if qualified.rsplit(".", 1)[0] == name:
                setattr(self, qualified.rsplit(".", 1)[1], value)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}", self.__miles_lora_ckpt_standin__)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `ray.util.state` and friends below an installed stand-in."""

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".", 1)[0]
        if top in _installed and top in _REASONS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name, _REASONS[spec.name.split(".", 1)[0]])

    def exec_module(self, module):
        return None


_FINDER = _Finder()
_installed: set[str] = set()


def tier_folder() -> Path | None:
    """The real-Miles tier folder named by MILES_LORA_CKPT_REAL_MILES, if it holds the wheel."""
    folder = os.environ.get(ENV)
    if not folder:
        return None
    path = Path(folder).resolve()
    return path if (path / "miles" / "__init__.py").is_file() else None


def activate(folder: str | Path | None = None) -> Path:
    """Append the tier folder to sys.path (after site-packages) and install the stand-ins."""
    path = Path(folder).resolve() if folder is not None else tier_folder()
    if path is None or not (path / "miles" / "__init__.py").is_file():
        raise RuntimeError(f"no real Miles wheel: set {ENV} to the tier folder (make tier-miles installs {WHEEL})")
    if str(path) not in sys.path:
        sys.path.append(str(path))
    install()
    return path


def install(names: dict[str, str] | None = None) -> None:
    """Put every stand-in of STANDINS (or of `names`) into sys.modules, unless the real package is
    already imported."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    for name, reason in (STANDINS if names is None else names).items():
        if name in sys.modules and name not in _installed:
            continue  # the real package is already imported: keep it
        _installed.add(name)
        sys.modules.setdefault(name, _StandInModule(name, reason))


def installed() -> dict[str, str]:
    """The stand-ins in sys.modules now: name -> reason."""
    return {
        name: module.__miles_lora_ckpt_standin__
        for name, module in sys.modules.items()
        if isinstance(module, _StandInModule)
    }


def is_standin(module: types.ModuleType) -> bool:
    return isinstance(module, _StandInModule)


def install_for_arguments() -> None:
    """What the wheel's `miles.utils.arguments` needs on top of `install()`: ARGUMENT_STANDINS.

    transformers decides once (cached) whether optional packages such as torchvision exist, by
    `importlib.util.find_spec`, which a stand-in would answer: its availability probes run first
    (importing its auto-processing module), with the real environment."""
    import transformers.models.auto.processing_auto  # noqa: F401 - runs transformers' probes now

    install(ARGUMENT_STANDINS)


def install_for_actor() -> None:
    """What the wheel's train actor module needs: `install_for_arguments()`, then ACTOR_STANDINS."""
    install_for_arguments()
    install(ACTOR_STANDINS)
