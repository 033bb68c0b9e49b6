"""How the harness builds the optimizer megatron hands a LoRA run, for every kind `SimConfig` names.

    optimizer   distributed  layer_wise / slots  what megatron builds (children)
    adam        True         -                   DistributedOptimizer (DDP reduce-scatters)
    adam, lion  False        -                   Float16OptimizerWithFloat16Params (bf16) / FP32Optimizer (fp32)
    muon        False        -                   the same: one child for Muon (matrices), one for
                                                 `muon_scalar` (adam or lion: the 1-D adapter biases)
    muon        False        layer_wise          LayerWiseDistributedOptimizer over Float16 children (bf16)
    adam, lion  False        layer_wise, slots   Miles' multi-LoRA chain: per slot, only that slot's
                                                 adapters trainable, `get_megatron_optimizer` with the
                                                 distributed optimizer off; every slot's children under
                                                 one LayerWiseDistributedOptimizer (`miles_slot_child_indices`)

`distributed=None` means what megatron builds for the optimizer: a DistributedOptimizer for Adam,
non-distributed children for Muon and for megatron 0.19's own Lion (its emerging-optimizer path
never builds a DistributedOptimizer for them). With layer_wise or non-distributed children, DDP
all-reduces (Miles: `use_distributed_optimizer = "muon" not in optimizer`, and off for multi-LoRA).

Lion and Muon are megatron's own where it can build them (megatron-core 0.19 with
emerging-optimizers). megatron-core 0.16 has no Lion at all: there, and only there, the harness
swaps its own Lion into each child (sim/lion.py). What the running megatron cannot build raises
`NotBuildable` with the reason (the demo turns it into exit code 2, tests into a skip).
"""

from __future__ import annotations

from dataclasses import fields

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from miles_lora_ckpt_harness.sim.lion import swap_in_lion
from miles_lora_ckpt_harness.sim.model import SimConfig


class NotBuildable(RuntimeError):
    """The running megatron-core cannot build the optimizer a SimConfig asks for; the message says why."""


def megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def megatron_knows_lion() -> bool:
    """megatron-core 0.19+ has a Lion option (through emerging-optimizers); 0.16 has none."""
    return "lion_beta1" in {f.name for f in fields(OptimizerConfig)}


def _emerging_optimizers_missing() -> str | None:
    import megatron.core.optimizer as mopt

    if getattr(mopt, "HAVE_EMERGING_OPTIMIZERS", False):
        return None
    return (
        f"megatron-core {megatron_version()} builds Lion and Muon through emerging-optimizers, which is not "
        "installed (make test installs emerging-optimizers==0.3.0 into the 0.19.2 tier)"
    )


def why_not_buildable(config: SimConfig, *, harness_lion: bool = True) -> str | None:
    """Why the running megatron-core cannot build `config`'s optimizer, or None when it can.

    With `harness_lion=False` (the demo), a Lion megatron cannot build itself (0.16) is not built either.
    """
    if config.optimizer == "lion" and not megatron_knows_lion():
        if harness_lion:
            return None  # megatron 0.16: the harness's swapped-in Lion
        return (
            f"megatron-core {megatron_version()} has no Lion optimizer (0.19 builds its own, with emerging-optimizers)"
        )
    if config.optimizer in ("lion", "muon"):
        if not megatron_knows_lion():  # 0.16: Muon only through emerging-optimizers' old API
            return f"megatron-core {megatron_version()} cannot build Muon here (it needs emerging-optimizers)"
        missing = _emerging_optimizers_missing()
        if missing:
            return missing
        if config.distributed:
            return (
                f"megatron-core {megatron_version()} builds {config.optimizer} as non-distributed optimizers "
                "(Float16/FP32 children), never as a DistributedOptimizer: use distributed=False"
            )
    if config.optimizer == "muon" and config.slots > 1:
        return "Miles' multi-LoRA chains are Adam per slot; the harness builds Muon slots nowhere"
    if config.optimizer == "muon" and config.layer_wise and config.dtype == "fp32":
        return (
            f"megatron-core {megatron_version()} cannot step a layer-wise Muon in fp32: it chains the raw "
            "torch optimizers (AttributeError: 'TensorParallelMuon' object has no attribute 'prepare_grads')"
        )
    return None


def uses_distributed_optimizer(config: SimConfig) -> bool:
    """The resolved `distributed`: what DDP and the optimizer are built with."""
    if config.distributed is not None:
        return config.distributed
    if config.uses_layer_wise or config.optimizer == "muon":
        return False
    return config.optimizer == "adam" or not megatron_knows_lion()  # 0.16's Lion swap keeps Adam's layout


def ddp_config(config: SimConfig) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=uses_distributed_optimizer(config),
    )


def build_optimizer(config: SimConfig, model_chunks: list, inner_models: list):
    """megatron's optimizer for the run, as `get_megatron_optimizer` (or Miles' multi-LoRA) builds it.

    One call covers every model chunk (`inner_models`: each chunk below DDP and Float16Module).
    """
    reason = why_not_buildable(config)
    if reason:
        raise NotBuildable(reason)
    swap = config.optimizer == "lion" and not megatron_knows_lion()
    optimizer_config = _optimizer_config(config, "adam" if swap else config.optimizer)
    if config.uses_layer_wise and config.optimizer != "muon":
        optimizer = _multi_lora_chain(config, optimizer_config, model_chunks, inner_models)
    else:
        if config.layer_wise:  # megatron 0.19's own layer-wise Muon
            optimizer_config.use_layer_wise_distributed_optimizer = True
        optimizer = get_megatron_optimizer(optimizer_config, model_chunks)
    if swap:
        swap_in_lion(optimizer)  # megatron 0.16 has no Lion; see sim/lion.py
    return optimizer


def _optimizer_config(config: SimConfig, name: str) -> OptimizerConfig:
    built = OptimizerConfig(
        optimizer=name,
        lr=config.lr,
        min_lr=config.min_lr,
        weight_decay=config.weight_decay,
        bf16=config.dtype == "bf16",
        params_dtype=config.torch_dtype,
        use_distributed_optimizer=uses_distributed_optimizer(config),
        clip_grad=config.clip_grad,
    )
    if name == "muon":
        built.muon_scalar_optimizer = config.muon_scalar
    return built


def _multi_lora_chain(config: SimConfig, optimizer_config: OptimizerConfig, model_chunks: list, inner_models: list):
    """Miles' multi-LoRA optimizer, written from its description: one slot at a time."""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    # slots need pp=1, hence one chunk whose layer numbers are global
    trainable = {
        (chunk, name): p
        for chunk, module in enumerate(inner_models)
        for name, p in module.named_parameters()
        if p.requires_grad
    }
    # a slot per layer (SimConfig), or the slot index in the adapter's name (sim.multi_lora_model)
    by_name = getattr(config, "slot_of_param", None)
    slot_of = {key: by_name(key[1]) if by_name else config.slot_of(int(key[1].split(".")[1])) for key in trainable}
    bf16 = optimizer_config.bf16
    optimizer_config.bf16 = False  # masters are made by LayerWise, after it has sharded the params
    children, init_fns, slot_children = [], [], {}
    try:
        for slot in range(config.slots):
            for key, param in trainable.items():
                param.requires_grad_(slot_of[key] == slot)
            chained = get_megatron_optimizer(optimizer_config, model_chunks)
            kept = [c for c in chained.chained_optimizers if c.optimizer is not None and c.get_parameters()]
            if not kept:
                raise ValueError(f"slot {slot} has no trainable adapter parameters")
            for child in kept:
                for group in child.optimizer.param_groups:
                    group["miles_multi_lora_slot"] = slot
            slot_children[slot] = list(range(len(children), len(children) + len(kept)))
            children += kept
            init_fns += [c.init_state_fn for c in kept]
    finally:
        optimizer_config.bf16 = bf16
        for param in trainable.values():
            param.requires_grad_(True)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    if "model_chunks" in LayerWiseDistributedOptimizer.__init__.__code__.co_varnames:  # 0.19: raw optimizers
        bases = [c.optimizer for c in children] if bf16 else children
        optimizer = LayerWiseDistributedOptimizer(
            bases, optimizer_config, groups, init_state_fn_list=init_fns, model_chunks=model_chunks
        )
    else:  # 0.16 takes the FP32Optimizer children and unwraps them itself
        optimizer = LayerWiseDistributedOptimizer(children, optimizer_config, groups, init_state_fn_list=init_fns)
    for child in optimizer.chained_optimizers:
        child.grad_stats_parallel_group = None
    optimizer.miles_slot_child_indices = slot_children
    return optimizer
