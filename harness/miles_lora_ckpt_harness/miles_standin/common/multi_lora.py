"""What both Miles multi-LoRA shapes share in the stand-in: adapters, the controller, schedulers, the loop.

Miles' multi-LoRA (v1 and v2) registers named adapters into slots of one model, trains
each at its own cadence, saves each under its own root and retires it when it leaves. Here:

- adapters come from a JSON file, `--multi-lora-config PATH` (a stand-in flag: Miles registers
  adapters from YAML or its API), a list of
  `{"name", "steps", "every": 1, "rank", "alpha", "adapter_global_batch_size": 4, "num_step": null,
  "retire_at": null, "return_when": {}, "return_slot": null}`: the adapter trains one step every
  `every` rounds until its step reaches `steps`; with `retire_at` it is retired when its step
  reaches `retire_at` and registered again (resuming from its retire save) once every adapter named
  in `return_when` has reached the step given there, into slot `return_slot` when given (Miles'
  registry hands out whichever slot is free: the adapter resumes into another slot index). Its save
  root is `{--save}/adapters/{name}` (Miles' default). Adapter i first takes slot i (a fixed
  choice keeps runs comparable).
- `Controller` stands for Miles' Ray controller and registry (adapter steps, `adapter_step(name)`).
- `install_slot_scheduler` / `drop_slot_scheduler` / `step_slot_schedulers`: Miles' per-slot
  schedulers, in `optimizer.miles_slot_schedulers`; the optimizer is Miles' per-slot chain built by
  the harness on the slot model (`sim.multi_lora_model`).
- `Producer`: the rollout side of the loop (rank 0, when every adapter has `data`, a prompt file):
  the data source `--data-source-path` names (Miles' `MultiLoRAAsyncDataSource`,
  `common/multi_lora_data_source.py`, or the plugin's) drawn one group at a time, in turn over the adapters, as Miles' async producer does;
  groups drawn for an adapter wait until it trains (`adapter_global_batch_size /
  --n-samples-per-prompt` groups a step), so an adapter's source runs ahead of its saves. The
  prompt indices each step trained on are kept in `lifecycle.prompts[name][step]`.
- `run(argv, probe, lifecycle)`: the loop of `train_multi_lora_async.py` (reconcile adapters, train,
  save what is due), with the shape's `lifecycle` (`register(adapters)`, `retire(adapters)`,
  `save_due()`; the shapes' own are in `common/multi_lora_lifecycles.py`); each launch first registers every adapter (resuming it), then retires the ones the
  schedule has parked, so a relaunch with the same command continues where the last one stopped.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from miles_lora_ckpt_harness.miles_standin.common.args import command_line

_RUNS: dict = {}  # id(model list) -> sim.train.SimRun


@dataclass
class AdapterConfig:
    name: str
    steps: int
    save: Path | None = None
    every: int = 1
    rank: int = 4
    alpha: float = 4.0
    adapter_global_batch_size: int = 4
    num_step: int | None = None
    retire_at: int | None = None
    return_when: dict = field(default_factory=dict)
    return_slot: int | None = None
    data: str | None = None  # the adapter's prompt file (Miles' adapter config `data`)


@dataclass
class AdapterRun:
    """One registered adapter: its config, its slot, Miles' controller step."""

    config: AdapterConfig
    slot: int
    step: int = 0

    @property
    def name(self) -> str:
        return self.config.name


class Controller:
    """Miles' controller/registry for the stand-in: every adapter's step, the same on every rank."""

    def __init__(self, adapters: list[AdapterRun]):
        self.adapters = {a.name: a for a in adapters}
        self.active: set[str] = set()  # the adapters in slots (`run` keeps it)

    def snapshot(self) -> dict:
        """Miles' controller snapshot: the active adapters by name (the stand-in retires at once)."""
        return {"active": {n: a for n, a in self.adapters.items() if n in self.active}, "retiring": {}}

    def adapter_step(self, name: str) -> int:
        return self.adapters[name].step

    def set_adapter_step(self, name: str, step: int) -> None:
        self.adapters[name].step = int(step)


_CONTROLLER: Controller | None = None


def controller() -> Controller:
    if _CONTROLLER is None:
        raise RuntimeError("no multi-LoRA controller in this process")
    return _CONTROLLER


def read_adapters(args) -> list[AdapterRun]:
    """`--multi-lora-config` as AdapterRuns, adapter i in slot i."""
    if not args.multi_lora_config:
        raise ValueError("the Miles stand-in's multi-LoRA needs --multi-lora-config (the adapters)")
    entries = json.loads(Path(args.multi_lora_config).read_text())["adapters"]
    if len(entries) > args.multi_lora_n_adapters:
        raise ValueError(f"{len(entries)} adapters for --multi-lora-n-adapters {args.multi_lora_n_adapters}")
    runs = []
    for slot, entry in enumerate(entries):
        entry = dict(entry)
        entry.setdefault("rank", args.lora_rank)
        entry.setdefault("alpha", args.lora_alpha)
        save = entry.pop("save", None) or (Path(args.save) / "adapters" / entry["name"] if args.save else None)
        runs.append(AdapterRun(AdapterConfig(save=Path(save) if save else None, **entry), slot))
    return runs


# --------------------------------------------------------------------------- model, optimizer, schedulers


def sim_config(args):
    from miles_lora_ckpt_harness.sim.multi_lora_model import MultiLoraSimConfig

    return MultiLoraSimConfig(
        world_size=dist.get_world_size(),
        tp=args.tensor_model_parallel_size,
        dtype="bf16" if args.bf16 else "fp32",
        slots=args.multi_lora_n_adapters,
        seed=args.seed,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_iters=args.lr_warmup_iters,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
    )


def setup_model_and_optimizer(args):
    """The slot model and Miles' per-slot chain (`build_multi_lora_optimizer`)."""
    from miles_lora_ckpt_harness.sim.train import build_run

    run = build_run(sim_config(args))
    run.optimizer.miles_slot_schedulers = {}
    run.optimizer.miles_sim_config = run.config  # what the per-slot schedulers read (lr, warmup)
    _RUNS[id(run.model)] = run
    return run.model, run.optimizer


def run_of(model):
    return _RUNS[id(model)]


def install_slot_scheduler(args, optimizer, adapter: AdapterRun, resume_step: int):
    """The slot's scheduler, repositioned to `resume_step * adapter_global_batch_size`."""
    from miles_lora_ckpt_harness.sim.multi_lora_model import slot_scheduler

    samples = adapter.config.adapter_global_batch_size
    scheduler = slot_scheduler(
        optimizer.miles_sim_config, optimizer, adapter.slot, samples_per_step=samples, num_step=adapter.config.num_step
    )
    if resume_step:
        scheduler.step(increment=resume_step * samples)
    optimizer.miles_slot_schedulers[adapter.slot] = scheduler
    return scheduler


def drop_slot_scheduler(optimizer, slot: int) -> None:
    optimizer.miles_slot_schedulers.pop(slot, None)


def slot_adam_step(optimizer, slot: int) -> int:
    """Collective: the largest Adam `step` of slot `slot`'s children over every rank (0 if none)."""
    from miles_lora_ckpt_harness.sim.multi_lora_model import slot_children

    best = 0
    for child in slot_children(optimizer, slot):
        for state in child.optimizer.state.values():
            step = state.get("step")
            if step is not None:
                best = max(best, int(step.item() if torch.is_tensor(step) else step))
    value = torch.tensor([best], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


# --------------------------------------------------------------------------- the loop


class Probe:
    """Harness observation points; the default does nothing."""

    def after_register(self, lifecycle, adapters) -> None: ...

    def before_join(self, lifecycle, adapters, active) -> None:
        """Before adapters come back in the middle of a launch (`active`: the adapters in slots)."""

    def after_join(self, lifecycle, adapters, active) -> None:
        """After adapters came back (registered again, resumed) in the middle of a launch."""

    def after_step(self, lifecycle, adapter: AdapterRun) -> None: ...

    def before_save(self, lifecycle, adapter: AdapterRun, reason: str) -> None: ...

    def after_round(self, lifecycle, round_id: int) -> None: ...


def parked(adapter: AdapterRun, steps: dict[str, int]) -> bool:
    """Whether the schedule keeps `adapter` retired now."""
    config = adapter.config
    if config.retire_at is None or steps[adapter.name] < config.retire_at:
        return False
    return any(steps[other] < need for other, need in config.return_when.items())


def wants_training(adapter: AdapterRun, round_id: int) -> bool:
    return adapter.step < adapter.config.steps and round_id % adapter.config.every == 0


def run(argv: list[str], lifecycle_factory, probe: Probe | None = None):
    """`train_multi_lora_async.py` for the stand-in: returns the lifecycle (model, optimizer, adapters)."""
    global _CONTROLLER
    from miles.backends.megatron_utils.initialize import init
    from miles.utils.arguments import miles_validate_args, parse_args

    probe = probe or Probe()
    with command_line(argv):
        args = parse_args()
    miles_validate_args(args)
    args = copy.deepcopy(args)  # what the train actor gets (Ray)
    init(args)  # parallel state, then the --custom-megatron-init-path hook
    model, optimizer = setup_model_and_optimizer(args)
    adapters = read_adapters(args)
    _CONTROLLER = Controller(adapters)
    lifecycle = lifecycle_factory(args, model, optimizer)
    lifecycle.register(adapters)  # every adapter resumes (or starts fresh) first
    probe.after_register(lifecycle, adapters)
    active = list(adapters)
    _CONTROLLER.active = {a.name for a in active}
    producer = Producer.for_run(args, adapters)
    round_id = 0
    while True:
        steps = {a.name: a.step for a in adapters}
        leaving = [a for a in active if parked(a, steps)]
        joining = [a for a in adapters if a not in active and not parked(a, steps)]
        if leaving:
            for adapter in leaving:
                probe.before_save(lifecycle, adapter, "retire")
            lifecycle.retire(leaving)
            active = [a for a in active if a not in leaving]
            _CONTROLLER.active = {a.name for a in active}
        if joining:
            for adapter in joining:  # Miles' registry: a free slot, here the configured one
                if adapter.config.return_slot is not None:
                    adapter.slot = adapter.config.return_slot
            probe.before_join(lifecycle, joining, active)
            lifecycle.register(joining)
            probe.after_join(lifecycle, joining, active)
            active = [a for a in adapters if a in active or a in joining]
            _CONTROLLER.active = {a.name for a in active}
        training = [a for a in active if wants_training(a, round_id)]
        if not training and all(a.step >= a.config.steps for a in adapters):
            break
        for adapter in training:
            if producer is not None:
                batch = producer.batch(adapter, {a.name for a in active})
                lifecycle.prompts.setdefault(adapter.name, {})[adapter.step + 1] = batch
            lifecycle.train_step(adapter)
            probe.after_step(lifecycle, adapter)
        lifecycle.save_due(training, probe)
        if producer is not None:
            producer.source.save(round_id)  # Miles' rollout manager, after the saves
        probe.after_round(lifecycle, round_id)
        round_id += 1
    return lifecycle


class Producer:
    """The rollout side of the multi-LoRA loop (see module doc); rank 0 only."""

    def __init__(self, args):
        from miles_lora_ckpt_harness.miles_standin.common.rollout import _load

        self.args = copy.deepcopy(args)  # the rollout manager's own copy (Ray)
        self.source = _load(self.args.data_source_path)(self.args)
        self.source.load(None)  # Miles' manager: load once at start
        self.pending: dict[str, list] = {}  # drawn, not trained yet

    @classmethod
    def for_run(cls, args, adapters: list[AdapterRun]):
        if dist.get_rank() != 0 or not adapters or not all(a.config.data for a in adapters):
            return None
        return cls(args)

    def batch(self, adapter: AdapterRun, active: set[str]) -> list[int]:
        """The prompt indices of `adapter`'s next step: drawn in turn until it has its groups."""
        need = adapter.config.adapter_global_batch_size // self.args.n_samples_per_prompt
        self.pending = {n: groups for n, groups in self.pending.items() if n in active}  # in flight: dropped
        while len(self.pending.get(adapter.name, [])) < need:
            groups = self.source.get_samples(1)
            if not groups:
                raise RuntimeError("the multi-LoRA data source yielded nothing")
            self.pending.setdefault(groups[0][0].adapter.name, []).append(groups[0])
        taken = self.pending[adapter.name][:need]
        del self.pending[adapter.name][:need]
        return [int(group[0].label) for group in taken]


class Lifecycle:
    """What both shapes do the same way: one training step of one adapter."""

    def __init__(self, args, model, optimizer):
        self.args, self.model, self.optimizer = args, model, optimizer
        self.prompts: dict[str, dict[int, list[int]]] = {}  # adapter -> step -> prompt indices (rank 0)

    def train_step(self, adapter: AdapterRun) -> float:
        from miles_lora_ckpt_harness.sim.multi_lora_model import train_slot_step

        scheduler = self.optimizer.miles_slot_schedulers[adapter.slot]
        samples = adapter.config.adapter_global_batch_size
        loss = train_slot_step(run_of(self.model), adapter.slot, adapter.name, adapter.step, scheduler, samples)
        adapter.step += 1  # commit_trained_batch: the controller's count advances
        return loss

    def due(self, trained: list[AdapterRun]) -> list[AdapterRun]:
        """Adapters whose step is a multiple of --save-interval (Miles' cadence)."""
        interval = self.args.save_interval
        if not interval:
            return []
        return [a for a in trained if a.step > 0 and a.step % interval == 0 and a.config.save is not None]
