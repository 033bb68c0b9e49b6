"""Stand-in of miles/rollout/multi_lora/async_rollout.py: the multi-LoRA async producer's rollout function.

What Miles does (`generate_rollout_multi_lora`, its `AsyncMultiLoRAWorker` and `collect_batch`):

- one background producer per rollout manager keeps up to `concurrency` (`--rollout-batch-size`)
  prompt groups generating, drawing each with `data_source.get_samples(1)`;
- a group completes when its generation does, so groups finish in another order than drawn; a
  completed group goes to its adapter's buffer of completed groups;
- an aborted group is discarded (Miles' comment: re-queuing is not wired up, the per-adapter source
  is read-only), as is a group the dynamic filter rejects or one too stale: nothing is given back
  to the data source and nothing tells it;
- each call collects one train batch: completed groups popped round-robin over the adapters, never
  more of an adapter than its step still needs, until the batch holds `--global-batch-size`
  samples or nothing more completes; an adapter whose step is complete steps with this batch
  (`step_adapter_names` in the first sample's metadata).

The stand-in runs the producer without a thread, step by step: `Worker.advance` tops up the groups
in flight, then completes the one whose generation ends first. A group's generation time is seeded
from (`--seed`, adapter, prompt), so a run's completion order is deterministic. A group whose
prompt index is 4 modulo 5 is aborted and discarded (a stand-in for aborts and filter drops,
decided by the prompt so that two runs drop the same prompts). The batch's samples are the shipped
groups, sorted by slot as Miles sorts them.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass, field

from miles_lora_ckpt_harness.miles_standin.common import multi_lora as common

DROPPED_MODULO = 5  # a prompt index congruent to 4 modulo this is aborted (discarded, as Miles does)


@dataclass
class RolloutOutput:
    """Miles' `RolloutFnTrainOutput`: the shipped groups and the batch's metrics."""

    samples: list
    metrics: dict = field(default_factory=dict)


def aborted(group) -> bool:
    return int(group[0].label) % DROPPED_MODULO == DROPPED_MODULO - 1


class Worker:
    """The producer of one rollout manager (Miles' `AsyncMultiLoRAWorker`, without its thread)."""

    def __init__(self, args, data_source):
        self.args, self.data_source = args, data_source
        self.concurrency = int(args.rollout_batch_size)
        self.clock = 0.0
        self.in_flight: list[tuple[float, int, list]] = []  # (completion time, draw number, group)
        self.draws = 0
        self.buffers: dict[str, list] = {}  # completed groups per adapter, oldest first
        self.rotation: list[str] = []
        self.accumulated: dict[str, int] = {}  # groups shipped toward each adapter's current step
        self.exhausted = False

    def latency(self, group) -> float:
        sample = group[0]
        seed = f"{self.args.seed}/{sample.adapter.name}/{sample.label}"
        return random.Random(seed).uniform(1.0, 4.0)

    def advance(self) -> bool:
        """Top up the groups in flight, then complete the first to finish; False when none is left."""
        while len(self.in_flight) < self.concurrency and not self.exhausted:
            groups = self.data_source.get_samples(1)
            if not groups:
                self.exhausted = True
                break
            self.draws += 1
            self.in_flight.append((self.clock + self.latency(groups[0]), self.draws, groups[0]))
        if not self.in_flight:
            return False
        self.in_flight.sort(key=lambda item: item[:2])
        self.clock, _, group = self.in_flight.pop(0)
        if not aborted(group):
            self.buffers.setdefault(group[0].adapter.name, []).append(group)
        return True

    def collect(self, adapters: dict) -> tuple[list, list[str]]:
        """One train batch (see module doc): the shipped groups and the adapters that step."""
        target = int(self.args.global_batch_size)
        per_prompt = int(self.args.n_samples_per_prompt)
        self.rotation = [n for n in self.rotation if n in adapters] + sorted(set(adapters) - set(self.rotation))
        self.buffers = {n: b for n, b in self.buffers.items() if n in adapters}  # a retired adapter's tail
        batch: list = []
        while len(batch) * per_prompt < target:
            popped = self._pop(adapters)
            if popped is not None:
                batch.append(popped)
            elif not self.advance():
                break
        stepping = []
        for name, adapter in adapters.items():
            if self.accumulated.get(name, 0) == steps_groups(adapter, self.args):
                stepping.append(name)
                self.accumulated[name] = 0
        return batch, sorted(stepping)

    def _pop(self, adapters: dict):
        for _ in range(len(self.rotation)):
            name = self.rotation.pop(0)
            self.rotation.append(name)
            buffer = self.buffers.get(name, [])
            if buffer and self.accumulated.get(name, 0) < steps_groups(adapters[name], self.args):
                self.accumulated[name] = self.accumulated.get(name, 0) + 1
                return buffer.pop(0)
        return None


def steps_groups(adapter, args) -> int:
    """The prompt groups of one adapter step (`adapter_global_batch_size / n_samples_per_prompt`)."""
    return adapter.config.adapter_global_batch_size // args.n_samples_per_prompt


_WORKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # data source -> its worker


def generate_rollout_multi_lora(args, rollout_id, data_source, evaluation: bool = False) -> RolloutOutput:
    """Miles' multi-LoRA rollout function: one train batch from the data source's producer."""
    if evaluation:
        raise ValueError("Evaluation not supported in multi-LoRA async rollout")
    worker = _WORKERS.get(data_source)
    if worker is None:
        worker = _WORKERS[data_source] = Worker(args, data_source)
    snapshot = common.controller().snapshot()
    adapters = {**snapshot["active"], **snapshot["retiring"]}
    batch, stepping = worker.collect(adapters)
    batch.sort(key=lambda group: (group[0].adapter.slot, int(group[0].label)))
    if batch:
        batch[0][0].metadata["step_adapter_names"] = stepping
    return RolloutOutput(samples=batch)
