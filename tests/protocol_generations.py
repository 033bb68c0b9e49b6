"""A small generation of per-rank files saved and loaded through core.protocol, without megatron
(used by the rank jobs in test_protocol_multirank and test_bug_not_damage)."""

from __future__ import annotations

from pathlib import Path

import torch

from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.layout import Topology
from miles_lora_ckpt.core.protocol import open_generation, save_generation


def rank_file(rank: int) -> str:
    return f"shards/rank{rank:03d}.safetensors"


def rank_tensors(rank: int, iteration: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * iteration + rank)
    return {"w": torch.randn(64, 8, generator=gen), "m": torch.randn(33, generator=gen).bfloat16()}


def save_ranks(consensus: Consensus, root: Path, iteration: int):
    def write(writer):
        writer.write_tensors(rank_file(consensus.rank), rank_tensors(consensus.rank, iteration))
        writer.write_tensors(f"shards/second{consensus.rank:03d}.safetensors", {"x": torch.ones(3) * iteration})
        if consensus.rank == 0:
            writer.write_json("meta/common.json", {"iteration": iteration})

    topo = Topology(world=consensus.world_size, dp=consensus.world_size)
    return save_generation(consensus, root, iteration=iteration, saver="test", topology=topo, write_files=write, keep=3)


def load_ranks(consensus: Consensus, root: Path) -> tuple[int, bool]:
    opened = open_generation(consensus, root, lambda m: [rank_file(consensus.rank)])
    got = opened.tensors(rank_file(consensus.rank))
    want = rank_tensors(consensus.rank, opened.manifest.iteration)
    same = all(torch.equal(got[k], want[k]) for k in want)
    return opened.manifest.iteration, same
