"""Warm start from a stock Miles native `torch_dist` adapter checkpoint: weights only.

Collective; reads as phases::

    prepare (every rank: the metadata, data only, its adapter blocks and their items) -> agree
    -> read (every rank its own slices, checked; a copy of what it holds now) -> agree
    -> install (adapter, masters refreshed from it) -> agree, undone on every rank if any failed

The metadata is read by the plugin's data-only reader (`core.dcp_metadata`). The adapter chunks
are read with `torch.load(weights_only=True)` (`core.native_dist.read_chunk`). The optimizer
items and the pickled common state are never read. So moments, step counters and scheduler are
not restored, and the warning says so.
"""

from __future__ import annotations

from pathlib import Path

from miles_lora_ckpt.core import faults
from miles_lora_ckpt.core.consensus import Consensus, attempt
from miles_lora_ckpt.core.dcp_metadata import read_metadata
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.megatron import adapter_shards as shards
from miles_lora_ckpt.megatron import native_adapter
from miles_lora_ckpt.megatron.optimizer_children import chain
from miles_lora_ckpt.megatron.undo import UndoRecord
from miles_lora_ckpt.savers.options import LoadSource
from miles_lora_ckpt.savers.single_lora.common import LoadResult

__all__ = ["warm_start_native"]


def warm_start_native(consensus: Consensus, model, path: Path, found: Path, optimizer, scheduler) -> LoadResult:
    """Collective. Load the adapter weights of the stock native checkpoint `found`, named by `path`.

    The weights are resharded to this run's layout, and the fp32 masters of `optimizer`'s children
    are refreshed from them. Nothing else is restored, `scheduler` included.
    Returns the `LoadResult`, with a warning naming what was not restored. Raises the same
    CheckpointError on every rank, after undoing any change.
    """
    children = [c.optimizer for c in chain.select(optimizer)] if optimizer else []

    # prepare: every rank reads the metadata (data only) and describes its adapter parameters
    prepared = attempt(_prepare, model, found)
    wanted = consensus.agree("native-prepare", prepared.map(lambda p: sorted(s.key for s in p[2].values())))
    metadata, blocks, sources = prepared.value

    # read: every rank its own slices, every check before anything changes; and what it holds now
    keys = {n for names in wanted for n in names}
    read = attempt(_read, model, found, metadata, blocks, sources, keys, children, scheduler)
    consensus.agree("native-read", read.map(lambda _: None))
    saved, undo = read.value

    # install, undone on every rank if it fails on any
    try:
        consensus.agree("native-install", attempt(_install, model, children, saved, consensus.rank))
    except CheckpointError:
        undo.restore()
        raise
    message = (
        f"{path} is a stock Miles native LoRA checkpoint ({found}): restored the adapter weights only; NOT "
        "restored: optimizer moments, step counters, scheduler state (its optimizer items and common state are "
        "not read); the fp32 master weights were refreshed from the adapter"
    )
    return LoadResult(
        True,
        None,
        LoadSource.NATIVE_DIST,
        str(path),
        adapter_restored=True,
        masters_refreshed=bool(children),
        warnings=[message],
    )


def _prepare(model, found: Path):
    metadata, blocks = read_metadata(found / ".metadata"), native_adapter.adapter_blocks(model)
    return metadata, blocks, native_adapter.sources(found, metadata, blocks)


def _read(model, found: Path, metadata, blocks, sources, wanted: set[str], children: list, scheduler):
    native_adapter.check_names(found, metadata, wanted)
    saved = native_adapter.read_adapter(model, found, metadata, blocks, sources)
    undo = UndoRecord.capture(shards.adapter_params(model).values(), children, scheduler)
    return saved, undo


def _install(model, children: list, saved: dict, rank: int) -> None:
    faults.point("after-preflight", rank)  # tests: a rank failing here, the others already installed
    shards.copy_into(shards.adapter_params(model), saved)
    for child in children:
        child.reload_model_params()  # masters from the loaded adapter, or step 1 would undo it
