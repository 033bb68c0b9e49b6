"""The wheel's own argument parsing, validation and `initialize.init`, as one harness job: `validation_job`.

Real here (miles-rl 0.0.2): `miles.utils.arguments.parse_args`, which builds Miles' parser on top of
the wheel's Megatron-LM parser and SGLang's server arguments and runs every validation they have.
Also real: `miles.backends.megatron_utils.initialize.init`, with megatron's parallel groups (gloo
here), Miles' `ParallelState`, the seeds, Megatron-LM's `NullTokenizer` and microbatch calculator.
It ends by calling the `--custom-megatron-init-path` hook through the wheel's `load_function`.

What is not the wheel's, and why:
- the modules `standins.ARGUMENT_STANDINS` lists (SGLang's server tree imports them; none is called
  while parsing), and `sglang_router`'s `RouterArgs`, which declares no `--router-*` flag;
- `init`'s `assert np.__version__.startswith("1.")` (Megatron-LM issue 1563) runs unchanged under
  `make tier-miles`, which puts numpy 1.26.4 first on PYTHONPATH. This project's torch 2.13,
  megatron-core 0.16.1 and transformers run with it. Under numpy 2 (pytest by hand), `init` sees,
  for that one name, a numpy whose `__version__` reads `1.x` (`numpy_1_for_init`). That is safe
  because the harness never builds a Megatron dataset. The job reports which numpy it ran.

`command` builds a realistic LoRA command for the harness's tiny Qwen2 base, whose model flags match
the `--hf-checkpoint` config, as `hf_validate_args` demands. The job parses each case of the payload
with the wheel, runs the wheel's `init` on what parsed, and reports what each step did. Between
cases it tears down megatron's groups and Megatron-LM's globals, as a fresh process would have none.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
import types
from pathlib import Path

# the harness's tiny Qwen2 base (sim.qwen2_model.Qwen2SimConfig) as an HF config and as Megatron flags
QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
}
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--swiglu",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base", "1000000",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--add-qkv-bias",
    "--position-embedding-type", "rope", "--seq-length", "64", "--max-position-embeddings", "64",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
]  # fmt: skip


def write_hf_config(folder: Path) -> Path:
    """The `--hf-checkpoint` folder `hf_validate_args` reads (config only: nothing loads weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN2_CONFIG))
    return folder


def command(hf: Path, save: Path, world: int, *more: str, plugin: bool = True) -> list[str]:
    """A LoRA launch as a user writes it for `train.py` (bridge mode, the plugin's init hook)."""
    hook = ["--custom-megatron-init-path", "miles_lora_ckpt.hooks.megatron_init"] if plugin else []
    return [
        *hook,
        "--hf-checkpoint", str(hf), "--megatron-to-hf-mode", "bridge", *MODEL_FLAGS,
        "--lora-rank", "4", "--lora-alpha", "4", "--target-modules", "all-linear",
        "--save", str(save), "--load", str(save), "--save-interval", "1",
        "--num-rollout", "4", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--global-batch-size", "8", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(world),
        "--optimizer", "adam", "--lr", "1e-2", "--bf16", "--use-distributed-optimizer",
        *more,
    ]  # fmt: skip


def import_arguments() -> types.ModuleType:
    """The wheel's `miles.utils.arguments`, imported with `standins.install_for_arguments()`."""
    import importlib

    from miles_lora_ckpt_harness.realmiles import standins

    standins.install_for_arguments()
    return importlib.import_module("miles.utils.arguments")


def parse(argv: list[str]):
    """The wheel's `parse_args()` on `train.py <argv>` (it reads sys.argv, as Miles' entry points do).
    An argparse refusal raises SystemExit, with argparse's message in the exception's `message`."""
    arguments = import_arguments()
    saved, sys.argv = sys.argv, ["train.py", *argv]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return arguments.parse_args()
    except SystemExit as exit_:
        exit_.message = stderr.getvalue().strip().splitlines()[-1:]
        raise
    finally:
        sys.argv = saved


class _Numpy1(types.ModuleType):
    """numpy, except `__version__` reads 1.x (see the module docstring)."""

    def __init__(self, numpy: types.ModuleType):
        super().__init__("numpy")
        self._numpy = numpy
        self.__version__ = f"1.harness (numpy {numpy.__version__})"

    def __getattr__(self, name: str):
        return getattr(self._numpy, name)


@contextlib.contextmanager
def numpy_1_for_init():
    """Scoped to one `init` call: the wheel's `initialize` module sees `_Numpy1` as `np`."""
    from miles.backends.megatron_utils import initialize

    real = initialize.np
    if real.__version__.startswith("1."):  # a numpy 1.x first on the path: the wheel's assertion runs as is
        yield
        return
    initialize.np = _Numpy1(real)
    try:
        yield
    finally:
        initialize.np = real


def init(args, rank: int) -> None:
    """The wheel's `initialize.init(args)` on this rank (the actor sets rank and local rank first)."""
    from miles.backends.megatron_utils import initialize

    args.rank, args.local_rank = rank, rank
    with numpy_1_for_init():
        initialize.init(args)


def teardown() -> None:
    """What a fresh process would not have: megatron's groups, the microbatch calculator, Megatron-LM's globals."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import unset_num_microbatches_calculator
    from megatron.training import global_vars

    from miles_lora_ckpt.integration import runtime

    parallel_state.destroy_model_parallel()
    unset_num_microbatches_calculator()
    global_vars.unset_global_variables()
    runtime.set_current(None)


def _case(argv: list[str], rank: int) -> dict:
    from miles_lora_ckpt_harness.miles_standin import launch as standin_launch

    record: dict = {"parsed": None, "exit": None, "refused": None, "error": None, "plugin": None}
    try:
        args = parse(argv)
    except SystemExit as exit_:
        record["exit"], record["refused"] = exit_.code, " ".join(getattr(exit_, "message", []))
        return record
    except Exception as error:  # noqa: BLE001 - the wheel's validation refused the command: report it
        record["error"] = f"validation: {type(error).__name__}: {error}"
        return record
    record["parsed"] = {
        name: getattr(args, name, None)
        for name in (
            "use_fault_tolerance",
            "non_persistent_ckpt_type",
            "target_modules",
            "start_rollout_id",
            "load",
            "use_distributed_optimizer",
            "world_size",
            "data_parallel_size",
            "custom_megatron_init_path",
        )
    }
    try:
        init(args, rank)
        record["initialized"] = True
        record["plugin"] = standin_launch._plugin_report()
    except Exception as error:  # noqa: BLE001 - the refusal under test: report it
        record["error"] = f"{type(error).__name__}: {error}"
        record["traceback"] = traceback.format_exc()[-3000:]
    finally:
        teardown()
    return record


def validation_job(payload: dict, ctx) -> dict:
    """Each case of `payload["cases"]` (name -> argv): the wheel's parse_args, then its init with the hook."""
    from miles_lora_ckpt_harness import bridge_double
    from miles_lora_ckpt_harness.realmiles import launch as realmiles_launch
    from miles_lora_ckpt_harness.realmiles import standins

    folder = standins.activate(payload["tier"])
    bridge_double.install(variant="nvidia")
    cases = {name: _case(list(argv), ctx.rank) for name, argv in payload["cases"].items()}
    return {
        "failed": None,  # each case reports its own refusal
        "cases": cases,
        "modules": realmiles_launch.wheel_modules(),
        "tier": str(folder),
        "standins": standins.installed(),
        "numpy": sys.modules["numpy"].__version__,  # 2.x: init saw _Numpy1; 1.x: its assertion ran as is
    }
