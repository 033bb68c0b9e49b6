"""This rank's place in megatron's parallel layout.

Files are keyed by model-parallel coordinates (TP, PP, EP, expert TP), never by DP or CP rank.
DP and CP ranks hold replicas of the adapter. The DistributedOptimizer shards over the
data-and-context group, and that group's root names the optimizer file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from miles_lora_ckpt.core.layout import Topology

__all__ = ["Coordinates", "current_coordinates", "current_topology"]


@dataclass(frozen=True)
class Coordinates:
    """Ranks of this process along each parallel axis (global rank included)."""

    rank: int
    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    cp: int

    @property
    def dense_key(self) -> str:
        """Who holds the same dense adapter shard: same TP and PP rank."""
        return f"tp{self.tp:03d}_pp{self.pp:03d}"

    @property
    def expert_key(self) -> str:
        """Who holds the same expert adapter shard: same PP, EP and expert-TP rank."""
        return f"pp{self.pp:03d}_ep{self.ep:03d}_etp{self.etp:03d}"

    @property
    def model_parallel_key(self) -> str:
        """Who holds the same model-parallel slice (every DP and CP replica of it)."""
        return f"tp{self.tp:03d}_pp{self.pp:03d}_ep{self.ep:03d}_etp{self.etp:03d}"

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def current_coordinates() -> Coordinates:
    """This rank's `Coordinates`, read from megatron's parallel state.

    `dp` is the data-parallel rank without CP; `cp` is the context-parallel rank. Megatron's
    parallel state must be initialised: megatron raises otherwise.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    return Coordinates(
        rank=dist.get_rank() if dist.is_initialized() else 0,
        tp=mpu.get_tensor_model_parallel_rank(),
        pp=mpu.get_pipeline_model_parallel_rank(),
        ep=mpu.get_expert_model_parallel_rank(),
        etp=mpu.get_expert_tensor_parallel_rank(),
        dp=mpu.get_data_parallel_rank(),
        cp=mpu.get_context_parallel_rank(),
    )


def current_topology(num_model_chunks: int = 1) -> Topology:
    """The run's whole layout as a `Topology`, read from megatron's parallel state.

    `num_model_chunks` is the length of Miles' model list; it becomes `vpp`.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    return Topology(
        world=dist.get_world_size() if dist.is_initialized() else 1,
        tp=mpu.get_tensor_model_parallel_world_size(),
        pp=mpu.get_pipeline_model_parallel_world_size(),
        ep=mpu.get_expert_model_parallel_world_size(),
        etp=mpu.get_expert_tensor_parallel_world_size(),
        dp=mpu.get_data_parallel_world_size(),
        cp=mpu.get_context_parallel_world_size(),
        vpp=max(1, num_model_chunks),
    )
