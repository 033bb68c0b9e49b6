"""The real-Miles tier's rollout-side runs: the wheel's data source classes under Miles' drivers.

Real here: the `miles-rl` wheel's `RolloutDataSource` and `RolloutDataSourceWithBuffer` (its
`Dataset` over a jsonl prompt file, its tokenizer from a local folder), its `load_function`,
`Sample` and `call_rollout_fn`, and the plugin's data source, staging and protocol. The wheel's
rollout manager and SGLang rollout cannot import here (`standins`), so the rest is scripted, each
piece in the order Miles' own code runs it:

- `Manager`: Miles' RolloutManager as far as the data source goes. It builds the data source, then
  the rollout function, and passes `generate(N)`, `save` and `load` on.
- The rollout function, `miles_standin.common.rollout.scripted_rollout`, makes the data-source calls
  of `sglang_rollout.generate_rollout`: over-sampled draws, aborted groups back to the buffer.
- `train_commit`: the train side's save of rollout N on one process, through the calls the
  plugin's save makes, without a model. The data source only reads the generation's data state.
- `run`: `train.py` (sync) or `train_async.py` (rollout N+1's draw before N is saved), with a kill
  at a named point, then a relaunch from the newest committed rollout + 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miles_lora_ckpt.core import atomic_files, data_state, json_files
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.layout import Topology
from miles_lora_ckpt.core.protocol import save_generation
from miles_lora_ckpt.integration import resume
from miles_lora_ckpt.integration.config import load_config
from miles_lora_ckpt.integration.data_state import HOOK, staged_for_save
from miles_lora_ckpt.savers.single_lora.common import SAVER
from miles_lora_ckpt.savers.single_lora.save import DATA_STATE_BINDING
from miles_lora_ckpt_harness.miles_standin.common.rollout import ROLLOUT_FN, build_tokenizer, write_prompts

STOCK_SOURCE = "miles.rollout.data_source.RolloutDataSourceWithBuffer"
PROMPTS, BATCH = 64, 12


class Killed(Exception):
    """The process dies here (the run stops; nothing in memory survives into the relaunch)."""


def make_args(workdir: Path, *, plugin: bool, partial: bool) -> argparse.Namespace:
    return argparse.Namespace(
        rollout_global_dataset=True,
        hf_checkpoint=str(workdir / "tokenizer"),
        chat_template_path=None,
        dump_details=None,
        prompt_data=str(workdir / "prompts.jsonl"),
        rollout_max_prompt_len=None,
        input_key="text",
        multimodal_keys=None,
        label_key="label",
        metadata_key="metadata",
        tool_key=None,
        apply_chat_template=False,
        apply_chat_template_kwargs=None,
        rollout_seed=42,
        rollout_shuffle=False,
        n_samples_per_prompt=2,
        buffer_filter_path=None,
        rollout_batch_size=BATCH,
        over_sampling_batch_size=BATCH + 4 if partial else BATCH,
        partial_rollout=partial,
        data_source_path=HOOK if plugin else STOCK_SOURCE,
        rollout_function_path=ROLLOUT_FN,
        save=str(workdir / "save"),
        load=None,
    )


class Manager:
    """The wheel's RolloutManager, as far as the data source goes (see module doc)."""

    def __init__(self, args):
        from miles.utils.misc import load_function

        self.args = args
        self.data_source = load_function(args.data_source_path)(args)
        self.generate_rollout = load_function(args.rollout_function_path)

    def generate(self, rollout_id: int) -> list[int]:
        from miles.rollout.base_types import call_rollout_fn

        output = call_rollout_fn(self.generate_rollout, self.args, rollout_id, self.data_source, evaluation=False)
        return [int(group[0].label) for group in output.samples]

    def save(self, rollout_id: int) -> None:
        self.data_source.save(rollout_id)

    def load(self, rollout_id: int) -> None:
        self.data_source.load(rollout_id)


def train_commit(args, rollout_id: int) -> None:
    """The train side's save of `rollout_id` (see module doc): generation + Megatron's tracker."""
    config = load_config()
    root = resume.save_root(config, args.save)
    doc = staged_for_save(config, args, root, rollout_id)

    def write(writer):
        writer.write_json("harness.json", {"iteration": rollout_id}, binding={"role": "harness"})
        if doc is not None:
            writer.write_json(data_state.DATA_STATE, doc, binding=DATA_STATE_BINDING)

    save_generation(
        Consensus.single_process(),
        root,
        iteration=rollout_id,
        saver=SAVER + "-harness",
        topology=Topology(world=1, tp=1),
        write_files=write,
    )
    resume.write_megatron_tracker(args.save, rollout_id)


def newest_commit(args) -> int:
    root = resume.save_root(load_config(), args.save)
    newest = resume.newest_committed(root)
    return -1 if newest is None else int(newest.name.split("-")[1])


def run(args, *, num_rollout: int, driver: str, kill: tuple[str, int] | None, trained: dict) -> None:
    """One launch: `load(start - 1)`, then the driver's loop until `num_rollout` or the kill."""
    start = newest_commit(args) + 1
    if start > 0:
        args.load = args.save
    manager = Manager(args)
    manager.load(start - 1)

    def at(point: str, rollout: int) -> None:
        if kill == (point, rollout):
            raise Killed(f"{point} {rollout}")

    if driver == "sync":
        for rollout in range(start, num_rollout):
            with _torn_writes(kill == ("in-data-save", rollout)):  # the plugin stages here
                trained[rollout] = manager.generate(rollout)
            train_commit(args, rollout)
            at("after-train-commit", rollout)
            with _torn_writes(kill == ("in-data-save", rollout)):
                manager.save(rollout)
            at("after-data-save", rollout)
        return
    pending = manager.generate(start)
    for rollout in range(start, num_rollout):
        current = pending
        if rollout + 1 < num_rollout:
            pending = manager.generate(rollout + 1)  # runs on the manager while rollout trains
        trained[rollout] = current
        train_commit(args, rollout)
        at("after-train-commit", rollout)
        with _torn_writes(kill == ("in-data-save", rollout)):
            manager.save(rollout)
        at("after-data-save", rollout)


class _torn_writes:
    """Inside: the data side's file writes stop half way and the process dies (stock Miles'
    `torch.save` of its state file; the plugin's staging, which `save` no longer does)."""

    def __init__(self, active: bool):
        self.active = active

    def __enter__(self):
        if not self.active:
            return self
        import torch

        self.saved = (torch.save, atomic_files.write_file_atomic)

        def torn_torch_save(obj, path, *a, **k):
            import io

            buffer = io.BytesIO()
            self.saved[0](obj, buffer)
            Path(path).write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            raise Killed(f"inside torch.save({path})")

        def torn_atomic(path, chunks, **k):
            data = b"".join(bytes(c) for c in chunks)
            Path(path).with_name(f".{Path(path).name}.tmp-dead").write_bytes(data[: len(data) // 2])
            raise Killed(f"inside the write of {path}")

        torch.save, atomic_files.write_file_atomic = torn_torch_save, torn_atomic
        return self

    def __exit__(self, *exc):
        if self.active:
            import torch

            torch.save, atomic_files.write_file_atomic = self.saved
        return False


def scenario(workdir: Path, *, plugin: bool, driver: str, partial: bool, kill, num_rollout: int = 8) -> dict:
    """A killed run and its relaunch: the prompt indices each rollout trained, the kill, the relaunch error."""
    workdir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(workdir / "tokenizer", PROMPTS)
    write_prompts(workdir / "prompts.jsonl", PROMPTS)
    trained: dict[int, list[int]] = {}
    result = {"killed": None, "relaunch_error": None}
    try:
        run(
            make_args(workdir, plugin=plugin, partial=partial),
            num_rollout=num_rollout,
            driver=driver,
            kill=kill,
            trained=trained,
        )
    except Killed as exc:
        result["killed"] = str(exc)
    if kill is not None:
        try:
            run(
                make_args(workdir, plugin=plugin, partial=partial),
                num_rollout=num_rollout,
                driver=driver,
                kill=None,
                trained=trained,
            )
        except Exception as exc:  # noqa: BLE001 - the negative control's relaunch may die: report it
            result["relaunch_error"] = f"{type(exc).__name__}: {exc}"
    result["trained"] = {str(k): v for k, v in sorted(trained.items())}
    return result


def legacy(workdir: Path) -> dict:
    """Generations saved without a data state, next to Miles' own `global_dataset_state_dict_3.pt`,
    relaunched with the plugin's data source.

    That file replaced by a pickled object is refused, naming it. Miles' genuine file is read with
    `torch.load(weights_only=True)`, and the run goes on from its cursor."""
    import torch

    workdir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(workdir / "tokenizer", PROMPTS)
    write_prompts(workdir / "prompts.jsonl", PROMPTS)
    trained: dict[int, list[int]] = {}
    run(make_args(workdir, plugin=False, partial=False), num_rollout=4, driver="sync", kill=None, trained=trained)
    stock = workdir / "save" / "rollout" / "global_dataset_state_dict_3.pt"
    genuine = stock.read_bytes()
    torch.save({"sample_offset": argparse.Namespace(evil=True)}, stock)  # only an unpickler builds it
    try:
        run(make_args(workdir, plugin=True, partial=False), num_rollout=6, driver="sync", kill=None, trained={})
        refused = None
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        refused = f"{type(exc).__name__}: {exc}"
    stock.write_bytes(genuine)
    run(make_args(workdir, plugin=True, partial=False), num_rollout=6, driver="sync", kill=None, trained=trained)
    return {"trained": {str(k): v for k, v in sorted(trained.items())}, "refused": refused, "stock_file": str(stock)}


SCENARIOS = {
    "commit-then-kill": {"driver": "sync", "partial": False, "kill": ("after-train-commit", 3)},
    "kill-in-data-save": {"driver": "sync", "partial": False, "kill": ("in-data-save", 3)},
    "async": {"driver": "async", "partial": False, "kill": ("after-data-save", 3)},
    "buffer": {"driver": "sync", "partial": True, "kill": ("after-data-save", 3)},
}


def main(workdir: str, out: str) -> None:
    """Every scenario with and without the plugin, and their uninterrupted references, as JSON."""
    from miles_lora_ckpt_harness.realmiles import standins

    standins.activate()
    results = {}
    for name, spec in SCENARIOS.items():
        for plugin in (True, False):
            tag = f"{name}-{'plugin' if plugin else 'stock'}"
            results[tag] = scenario(Path(workdir) / tag, plugin=plugin, **spec)
            reference = dict(spec, kill=None)
            results[f"{tag}-reference"] = scenario(Path(workdir) / f"{tag}-reference", plugin=plugin, **reference)
    results["legacy"] = legacy(Path(workdir) / "legacy")
    json_files.write_json(Path(out), results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
