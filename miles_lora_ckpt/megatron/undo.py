"""A byte-exact record of everything a load may change, to roll back when a late phase fails.

Preflight catches what is wrong with a checkpoint before anything changes; what is left (a peer
dying mid-install, an injected fault) fails after some ranks already wrote. For LoRA the state a
load touches is small, so every rank keeps a record of it and puts it back: adapter parameters,
each restored child's inner-optimizer state, param groups and fp32 masters, and the scheduler.

Memory: the record holds what the load may overwrite on this rank, never another rank's or the
world's state. The adapter parameters are copied (the load overwrites them with the saved
ones). An fp32 master is copied only when it cannot be remade: a master whose bits equal, right
now, those of the model-parameter elements it is made from (a fresh optimizer's masters, the
common resume at startup; megatron's own `reload_model_params` pairs, compared chunk by chunk,
never a full temporary) is recorded as "refresh from that parameter": `restore` puts the
parameters back first, then copies them into the master (bf16 -> fp32 is exact), which gives
back the very same bits. The inner state of a fresh optimizer is empty, so nothing is copied for
it. A load into an optimizer that has already stepped copies its masters and moments (the same
size as what it holds): the price of rolling back a late failure bit for bit there, except for
the state a load replaces instead of writing (`replaced`: a DistributedOptimizer's moments, and
its masters on the CPU that are not views of fp32 parameters, see `ChildFamily.replaces` and
`child.master_replaceable`): those old tensors are kept as they are, for nothing writes them.

A master that can be remade is remade, even where the load replaces it: its old data then goes
back as soon as the install replaces it. So a load into an optimizer that never stepped (every
relaunch) keeps no copy of optimizer state at all: no state to copy, every master remade.

The adapter parameters are not copied either where the load applies a verified buffer of their
own dtype and shape (`capture(..., incoming=...)`, then `write_params`): each parameter and its
buffer swap contents, a chunk at a time, so that buffer holds the old bytes and `restore` copies
them back. The load's read of the adapter becomes its undo record: one adapter's bytes, not two.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from miles_lora_ckpt.megatron.optimizer_children.child import MASTER_KEY, master_replaceable

_COMPARE_ELEMENTS = 1 << 16  # a master is compared with its parameter this many elements at a time
_PREFIX_ELEMENTS = 1 << 12  # ... after its first elements (a master that has stepped differs there)
_SWAP_ELEMENTS = 1 << 16  # a parameter and its incoming buffer swap contents this many elements at a time


@dataclass
class UndoRecord:
    params: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live, copy)
    # id(live parameter) -> [live, the buffer `write_params` swaps into it, elements swapped so far]:
    # the swapped elements' old bytes are in the buffer (see the module docstring)
    swaps: dict[int, list] = field(default_factory=dict)
    # (inner optimizer, state, groups, masters: [(live master, its copy, the parameter elements it
    # is remade from, or its old data, kept: bool)])
    children: list[tuple] = field(default_factory=list)
    scheduler: tuple | None = None  # (scheduler, attributes)
    rng_before: object = None  # the loader's RNG states before the load (`core.rng_state.RngState`), if restored

    @classmethod
    def capture(
        cls, adapter_params, children, scheduler, replaced: dict | None = None, incoming: dict | None = None
    ) -> UndoRecord:
        """Record what a load may change. `replaced`: `{id(child): state keys}` the load puts new
        tensors under without writing the old ones (`chain.replaced_keys`): those are kept, not
        copied; `MASTER_KEY` among them: so are the masters it gives new data
        (`child.master_replaceable`) and cannot remake. `incoming`: `{id(parameter): the tensor
        the load writes into it}`, through `write_params`: a parameter whose tensor can swap with
        it (`_swappable`) is not copied."""
        record = cls()
        for p in adapter_params:
            buffer = (incoming or {}).get(id(p))
            if buffer is not None and _swappable(p, buffer):
                record.swaps[id(p)] = [p, buffer, 0]
            else:
                record.params.append((p, p.detach().clone()))
        for child in children:
            inner = child.optimizer
            kept = set((replaced or {}).get(id(child), ()))
            state = {p: {k: v if k in kept else _copy(v) for k, v in s.items()} for p, s in inner.state.items()}
            groups = (
                inner.param_groups,
                [dict(g, **copy.deepcopy({k: v for k, v in g.items() if k != "params"})) for g in inner.param_groups],
            )
            sources = refresh_sources(child)
            swapped = MASTER_KEY in kept
            masters = [
                (m, *_undo_of_master(m, sources.get(id(m)), swapped)) for g in inner.param_groups for m in g["params"]
            ]
            record.children.append((inner, state, groups, masters))
        if scheduler is not None:
            attributes = {k: copy.deepcopy(v) for k, v in vars(scheduler).items() if k != "optimizer"}
            record.scheduler = (scheduler, attributes)
        return record

    def write_params(self, params: dict, saved: dict) -> None:
        """Write `saved[name]` into each parameter `params[name]`: a swap where `capture` recorded
        one (the parameter's old bytes go to the saved tensor's place), else a copy."""
        with torch.no_grad():
            for name, param in params.items():
                swap = self.swaps.get(id(param))
                if swap is None or swap[1] is not saved[name]:
                    param.data.copy_(saved[name])
                    continue
                live, buffer = param.detach().view(-1), swap[1].view(-1)
                for start in range(0, live.numel(), _SWAP_ELEMENTS):
                    mine, theirs = live[start : start + _SWAP_ELEMENTS], buffer[start : start + _SWAP_ELEMENTS]
                    old = mine.clone()
                    mine.copy_(theirs)
                    theirs.copy_(old)
                    swap[2] = start + mine.numel()  # these elements' old bytes are in the buffer now

    def copied_bytes(self) -> int:
        """Bytes this record copied to be able to restore (the swapped buffers, the kept and the
        remade masters are not copies)."""
        tensors = [saved for _, saved in self.params]
        for _, state, _, masters in self.children:
            tensors += [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            tensors += [saved for live, saved, kept in masters if not kept and not _shares(saved, live)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.params:  # first: masters may be remade from these
                live.copy_(saved)
            for live, buffer, done in self.swaps.values():
                live.detach().view(-1)[:done].copy_(buffer.view(-1)[:done])
            for inner, state, (group_list, group_values), masters in self.children:
                inner.state = defaultdict(dict, {p: dict(s) for p, s in state.items()})
                for group, values in zip(group_list, group_values, strict=True):
                    group.clear()
                    group.update(values)
                inner.param_groups = group_list
                for live, saved, kept in masters:  # a copy, the parameter elements (restored above),
                    if kept:  # or its old data, which the load replaced without writing it
                        live.data = saved
                    elif saved.data_ptr() != live.data_ptr():
                        live.copy_(saved.reshape(live.shape))
        if self.scheduler is not None:
            scheduler, attributes = self.scheduler
            vars(scheduler).update(attributes)


def _swappable(param: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `param` and the tensor a load writes into it can swap contents: same dtype, shape and
    device, both contiguous, no storage in common."""
    return (
        isinstance(buffer, torch.Tensor)
        and buffer.dtype == param.dtype
        and buffer.shape == param.shape
        and buffer.device == param.device
        and buffer.is_contiguous()
        and param.is_contiguous()
        and not buffer.requires_grad
        and buffer.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
    )


def _shares(saved: torch.Tensor, live: torch.Tensor) -> bool:
    """Whether a master's undo `saved` is no copy: a model parameter's elements it is remade from."""
    return saved._base is not None or saved.data_ptr() == live.data_ptr()


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def refresh_sources(child) -> dict[int, torch.Tensor]:
    """`{id(fp32 master): the model-parameter elements megatron's reload_model_params copies into
    it}` for a megatron optimizer child: the DistributedOptimizer's shard of each parameter
    (`param_range_map["param"]`), Float16OptimizerWithFloat16Params' whole parameters; empty for
    any other (its masters are then copied)."""
    sources: dict[int, torch.Tensor] = {}
    if hasattr(child, "gbuf_ranges") and hasattr(child, "model_param_group_index_map"):
        from miles_lora_ckpt.megatron.optimizer_children import distributed

        for layout in distributed.bucket_layouts(child):
            for model_param, ranges in distributed._param_maps(child, layout).items():
                main, _ = distributed.main_and_state(child, model_param)
                span = ranges["param"]
                sources[id(main)] = model_param.detach().view(-1)[span.start : span.end]
        return sources
    for model_group, main_group in zip(
        getattr(child, "float16_groups", []), getattr(child, "fp32_from_float16_groups", []), strict=True
    ):
        for model_param, main in zip(model_group, main_group, strict=True):
            sources[id(main)] = model_param.detach().view(-1)
    return sources


def _undo_of_master(master: torch.Tensor, source: torch.Tensor | None, swapped: bool) -> tuple[torch.Tensor, bool]:
    """`(what restores master, kept)`: `source` (the parameter elements the master is made from) if
    copying it into `master` gives back `master`'s current bits exactly, compared a chunk at a time
    (no full temporary: a fresh optimizer's masters); else, with `swapped` (the load gives
    replaceable masters new data, `child.master_replaceable`) and a master it replaces, the
    master's current data itself (kept: nothing writes it); otherwise a copy of the master."""
    if remade_exactly(master, source):  # first: a remade master's old data goes back once replaced
        return source, False
    if swapped and source is not None and master_replaceable(master, source):
        return master.detach(), True
    return master.detach().clone(), False


def remade_exactly(master: torch.Tensor, source: torch.Tensor | None) -> bool:
    """Whether `master.copy_(source)` would leave every bit of the fp32 `master` as it is now."""
    if source is None or master.dtype != torch.float32 or source.numel() != master.numel():
        return False
    if not source.dtype.is_floating_point or source.element_size() > 4 or not master.is_contiguous():
        return False
    flat = master.detach().view(-1)
    if flat.data_ptr() == source.data_ptr() and source.dtype == torch.float32:
        return True  # the master is the parameter itself (fp32 model params): restored with it
    # a master that has stepped differs from its bf16 parameter almost everywhere: a short prefix
    # settles it without a pass over the whole master (the full comparison follows otherwise)
    head = min(_PREFIX_ELEMENTS, flat.numel())
    if not torch.equal(flat[:head].view(torch.int32), source[:head].to(torch.float32).view(torch.int32)):
        return False
    for start in range(0, flat.numel(), _COMPARE_ELEMENTS):
        mine = flat[start : start + _COMPARE_ELEMENTS]
        remade = source[start : start + _COMPARE_ELEMENTS].to(torch.float32)
        if not torch.equal(mine.view(torch.int32), remade.view(torch.int32)):
            return False
    return True
