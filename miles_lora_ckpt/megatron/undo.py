"""A byte-exact record of everything a load may change, to roll back when a late phase fails.

Preflight catches what is wrong with a checkpoint before anything changes. What is left (a peer
dying mid-install, an injected fault) fails after some ranks already wrote. For LoRA that state is
small, so every rank records it and puts it back: adapter parameters, the scheduler, and each
restored child's inner-optimizer state, param groups and fp32 masters.

Memory: the record holds what the load may overwrite on this rank, never another rank's state.
- The adapter parameters are copied, since the load overwrites them. They are not copied where
  the load applies a verified buffer of their dtype and shape (`capture(..., incoming=...)`, then
  `write_params`). Each parameter and its buffer then swap contents a chunk at a time, so the
  buffer holds the old bytes. The load's read of the adapter becomes its undo record.
- An fp32 master is copied only when it cannot be remade. A master whose bits equal those of the
  parameter elements it is made from is recorded as "refresh from that parameter". `restore` puts
  the parameters back first, then copies them into the master; bf16 -> fp32 is exact. The pairs
  are megatron's own `reload_model_params` ones, compared chunk by chunk.
- A fresh optimizer's inner state is empty, so nothing is copied for it. A load into an optimizer
  that never stepped (every relaunch) thus keeps no copy of optimizer state at all.
- A load into an optimizer that has stepped copies its masters and moments. That is the price of
  a bit-exact rollback there. The state a load replaces instead of writing is kept as it is, for
  nothing writes it (`replaced`; see `ChildFamily.replaces` and `child.master_replaceable`).
- A master that can be remade is remade even where the load replaces it, so its old data goes
  back as soon as the install replaces it.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from miles_lora_ckpt.megatron.optimizer_children.child import MASTER_KEY, master_replaceable

__all__ = ["UndoRecord"]

_COMPARE_ELEMENTS = 1 << 16  # a master is compared with its parameter this many elements at a time
_PREFIX_ELEMENTS = 1 << 12  # ... after its first elements (a master that has stepped differs there)
_SWAP_ELEMENTS = 1 << 16  # a parameter and its incoming buffer swap this many elements at a time


@dataclass
class UndoRecord:
    """What a load may change on this rank, recorded by `capture` and put back by `restore`."""

    params: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live, copy)
    # id(live parameter) -> [live, the buffer `write_params` swaps into it, elements swapped so
    # far]: the swapped elements' old bytes are in the buffer (see the module docstring)
    swaps: dict[int, list] = field(default_factory=dict)
    # (inner optimizer, state, groups, masters: [(live master, its copy, the parameter elements it
    # is remade from, or its old data, kept: bool)])
    children: list[tuple] = field(default_factory=list)
    scheduler: tuple | None = None  # (scheduler, attributes)
    # the loader's RNG states before the load (`core.rng_state.RngState`), when it restores them
    rng_before: object = None

    @classmethod
    def capture(
        cls, adapter_params, children, scheduler, replaced: dict | None = None, incoming: dict | None = None
    ) -> UndoRecord:
        """Record what a load may change: `adapter_params`, `children` and `scheduler` (or None).

        `replaced` is `{id(child): state keys}` the load puts new tensors under without writing
        the old ones (`chain.replaced_keys`). Those are kept, not copied. With `MASTER_KEY` among
        them, so are the masters the load gives new data and this cannot remake.
        `incoming` is `{id(parameter): the tensor the load writes into it}` through `write_params`.
        A parameter that can swap with its tensor (`_swappable`) is not copied.
        Returns the record; raises nothing of its own.
        """
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
        """Write `saved[name]` into each parameter `params[name]`, in place.

        Where `capture` recorded a swap, the parameter's old bytes go to the saved tensor's place;
        elsewhere it is a copy.
        """
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
        """Bytes this record copied to be able to restore.

        Swapped buffers, kept masters and remade masters are not copies, so they do not count.
        """
        tensors = [saved for _, saved in self.params]
        for _, state, _, masters in self.children:
            tensors += [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            tensors += [saved for live, saved, kept in masters if not kept and not _shares(saved, live)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def restore(self) -> None:
        """Put back every recorded tensor, param group and scheduler attribute, in place."""
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
    """Whether a master's undo `saved` is no copy: the parameter elements it is remade from."""
    return saved._base is not None or saved.data_ptr() == live.data_ptr()


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def refresh_sources(child) -> dict[int, torch.Tensor]:
    """`{id(fp32 master): the parameter elements megatron's reload_model_params copies into it}`.

    For a DistributedOptimizer child these are its shard of each parameter
    (`param_range_map["param"]`). For Float16OptimizerWithFloat16Params they are whole parameters.
    Any other child gets an empty dict, and its masters are copied.
    """
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
    """`(what restores master, kept)`, in order of preference.

    - `source`, the parameter elements the master is made from, if copying it into `master` gives
      back its current bits (a fresh optimizer's masters).
    - With `swapped` (the load gives replaceable masters new data) and a master it replaces: the
      master's current data itself, kept, for nothing writes it.
    - Otherwise a copy of the master.
    """
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
