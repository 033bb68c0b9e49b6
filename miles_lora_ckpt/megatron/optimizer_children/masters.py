"""The unkeyed cross-check between a generation's adapter and its fp32 masters.

megatron copies every fp32 master into its model parameter after each optimizer step (a
round-to-nearest cast to bf16/fp16; for fp32 parameters the master *is* the parameter, or a view
of it), and the saver writes the parameters and the masters of the same step. So in a generation
that one training state wrote, every adapter tensor is, element for element, the cast of its
master. Two kinds of forgery pass every other check without a signing key (digests, stamps,
bindings, shapes and the manifest all agree), and fail this one:

- one generation's adapter file next to another generation's optimizer files (or the reverse);
- two optimizer children's files swapped together with their stamps (each child then holds
  another child's masters: another shape, or the same shape and other values).

Each family's preflight hands the masters it is about to restore to `check_master` (the
DistributedOptimizer's shard: the matching elements of the flattened parameter), before anything
changes. Where no master is restored (a save before the first step, `--no-save-optim`,
`load_optim=False`, a child that never stepped) there is nothing to compare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from miles_lora_ckpt.core.global_layout import strided_view

__all__ = [
    "AdapterSource",
    "check_master",
    "check_master_elements",
    "check_master_rows",
]


@dataclass(frozen=True)
class AdapterSource:
    """The saved adapter tensor a model parameter is restored from, and the file holding it."""

    name: str  # the chunk-qualified parameter name (`chunk0.decoder.layers.0...lora_A.weight`)
    tensor: torch.Tensor
    file: str


# model parameter -> the adapter tensor this load restores into it (None: not restored here)
AdapterLookup = Callable[[torch.Tensor], "AdapterSource | None"]


def check_master(source: AdapterSource, master: torch.Tensor, where: str, first: int = 0) -> None:
    """Raise ValueError unless `master` cast to the adapter's dtype equals the saved adapter.

    `master` holds elements `[first, first + numel)` of the flattened parameter (the whole
    parameter for whole-parameter children, a DistributedOptimizer's shard otherwise); `where`
    names the optimizer file (and child) the master comes from.
    """
    saved = source.tensor.reshape(-1)
    stop = first + master.numel()
    if first < 0 or stop > saved.numel():
        raise ValueError(
            f"{source.name}: {where} holds master elements [{first}, {stop}), the adapter in {source.file} has "
            f"{saved.numel()}: the optimizer state is not this adapter's"
        )
    _require_cast(source, saved[first:stop], master, where, lambda at: first + at)


def check_master_elements(source: AdapterSource, master: torch.Tensor, where: str, positions: torch.Tensor) -> None:
    """`check_master` for master elements at `positions` (int64) of the flattened parameter, in
    one comparison: a resharding load's pieces of one parameter (one per row of a row-parallel
    split at another TP) checked together, not one by one."""
    saved = source.tensor.reshape(-1)
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= saved.numel()):
        raise ValueError(
            f"{source.name}: {where} holds master elements up to {int(positions.max())}, the adapter in "
            f"{source.file} has {saved.numel()}: the optimizer state is not this adapter's"
        )
    saved = saved.index_select(0, positions.to(saved.device))
    _require_cast(source, saved, master, where, lambda at: int(positions[at]))


def check_master_rows(source: AdapterSource, master: torch.Tensor, where: str, first: int, step: int) -> None:
    """`check_master` for an `[n, width]` master whose row `i` holds elements `[first + i * step, ...
    + width)` of the flattened parameter, in one comparison: a resharding load's strided group of
    rows (the half rows of a row-parallel split at another TP), checked together."""
    saved = source.tensor.reshape(-1)
    n, width = master.shape
    end = first + (n - 1) * step + width
    if first < 0 or step < width or end > saved.numel():
        raise ValueError(
            f"{source.name}: {where} holds master elements up to {end}, the adapter in {source.file} has "
            f"{saved.numel()}: the optimizer state is not this adapter's"
        )
    rows = strided_view(saved, saved.numel(), first, step, width, n).reshape(-1)
    _require_cast(source, rows, master, where, lambda at: first + (at // width) * step + at % width)


def _require_cast(source: AdapterSource, saved: torch.Tensor, master: torch.Tensor, where: str, element) -> None:
    """Raise ValueError unless `master` (flattened) cast to `saved`'s dtype equals `saved` (the adapter
    elements it pairs with); `element(i)` is the parameter's element index of position i, for the message."""
    cast = master.detach().reshape(-1).to(device=saved.device, dtype=saved.dtype)
    if torch.equal(cast, saved):
        return
    at = int((cast != saved).nonzero()[0].item())
    dtype = str(saved.dtype).removeprefix("torch.")
    raise ValueError(
        f"{source.name}: the adapter in {source.file} is not the {dtype} cast of its fp32 master in {where} "
        f"(element {element(at)}: adapter {saved[at].item()!r}, master {master.reshape(-1)[at].item()!r}, as "
        f"{dtype} {cast[at].item()!r}): the adapter and the optimizer state come from different training "
        "states (files of another generation, or optimizer files swapped)"
    )
