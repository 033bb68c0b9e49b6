"""A byte-exact record of everything a load may change, to roll back when a late phase fails.

Preflight catches what is wrong with a checkpoint before anything changes; what is left (a peer
dying mid-scatter, an injected fault) fails after some ranks already wrote. For LoRA the state a
load touches is small, so every rank keeps a copy of it and puts it back: adapter parameters, each
restored child's inner-optimizer state, param groups and fp32 masters, and the scheduler.

Memory: the record is a copy of what the load may overwrite on this rank, never of another rank's
or the world's state. For a fresh optimizer (a resume at startup, the common case) the inner state
is empty, so the record holds only the adapter and this rank's fp32 master shards (1/(1+keys) of
what the load installs: a quarter for Adam) and the param groups; a load into an optimizer that
has already stepped copies its masters and moments too (the same size as what it holds). That is
the price of rolling back a late failure bit for bit; the load's own reads stay within this rank's
shard (see `optimizer_children.distributed`).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class UndoRecord:
    params: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live, copy)
    children: list[tuple] = field(default_factory=list)  # (inner optimizer, state, groups, masters)
    scheduler: tuple | None = None  # (scheduler, attributes)

    @classmethod
    def capture(cls, adapter_params, children, scheduler) -> UndoRecord:
        record = cls()
        record.params = [(p, p.detach().clone()) for p in adapter_params]
        for child in children:
            inner = child.optimizer
            state = {p: {k: _copy(v) for k, v in s.items()} for p, s in inner.state.items()}
            groups = (
                inner.param_groups,
                [dict(g, **copy.deepcopy({k: v for k, v in g.items() if k != "params"})) for g in inner.param_groups],
            )
            masters = [(m, m.detach().clone()) for g in inner.param_groups for m in g["params"]]
            record.children.append((inner, state, groups, masters))
        if scheduler is not None:
            attributes = {k: copy.deepcopy(v) for k, v in vars(scheduler).items() if k != "optimizer"}
            record.scheduler = (scheduler, attributes)
        return record

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.params:
                live.copy_(saved)
            for inner, state, (group_list, group_values), masters in self.children:
                inner.state = defaultdict(dict, {p: dict(s) for p, s in state.items()})
                for group, values in zip(group_list, group_values, strict=True):
                    group.clear()
                    group.update(values)
                inner.param_groups = group_list
                for live, saved in masters:
                    live.copy_(saved)
        if self.scheduler is not None:
            scheduler, attributes = self.scheduler
            vars(scheduler).update(attributes)


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
