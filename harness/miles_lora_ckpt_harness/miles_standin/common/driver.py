"""Stand-in of Miles' `train.py` driver and its Ray placement, for one training process per rank.

Miles' driver parses and validates the arguments once and ships a copy to every train actor; Ray
serialises them, so an actor's changes never reach the driver. It takes the start rollout from the
actors only when `args.start_rollout_id` is None (all actors must agree). Then it runs the rollout
loop with periodic saves. Here every rank runs the driver's deterministic part itself and holds
one actor; a deep copy stands for Ray's serialisation. `probe` is the harness's observer (after
init, before/after each save, after each rollout); Miles has no such thing.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from miles_lora_ckpt_harness.miles_standin.common import rollout
from miles_lora_ckpt_harness.miles_standin.common.args import command_line
from miles_lora_ckpt_harness.miles_standin.common.indep_dp import IndepDPInfo


class Probe:
    """Harness observation points; the default does nothing."""

    def after_init(self, actor, start_rollout_id: int) -> None: ...

    def after_rollout(self, actor, rollout_id: int, losses: list[float]) -> None: ...

    def before_save(self, actor, rollout_id: int) -> None: ...

    def after_save(self, actor, rollout_id: int) -> None: ...

    def prompts(self, rollout_id: int, indices: list[int]) -> None: ...


def run(argv: list[str], probe: Probe | None = None):
    """Parse, validate, init the actor, train every rollout from the start id; returns the actor."""
    from miles.backends.megatron_utils.actor import MegatronTrainRayActor
    from miles.utils.arguments import miles_validate_args, parse_args
    from miles.utils.misc import should_run_periodic_action

    probe = probe or Probe()
    with command_line(argv):
        args = parse_args()
    miles_validate_args(args)
    actor = MegatronTrainRayActor()
    # Miles' train group passes the one-cell value unless independent data-parallel cells are configured
    start = actor.init(copy.deepcopy(args), "actor", with_ref=args.use_kl_loss, indep_dp_info=IndepDPInfo())
    return drive(actor, args, start, probe, should_run_periodic_action)


def drive(actor, args, start: int, probe: Probe, should_run_periodic_action):
    """The driver after the actors' init: the start rollout from the actors when `args` has none
    (all must agree), then the rollout loop with saves at `should_run_periodic_action`'s cadence
    (the stand-in's or the real wheel's function). Returns the actor."""
    if args.start_rollout_id is None:  # placement_group.create_training_models
        starts = _gather_int(start)
        if len(set(starts)) != 1:
            raise AssertionError(f"train actors returned different start rollouts: {starts}")
        args.start_rollout_id = starts[0]
    probe.after_init(actor, args.start_rollout_id)
    # the rollout manager (rank 0, with --prompt-data): Miles' train.py loads its data source once
    rollout_manager = rollout.manager_for(args, dist.get_rank() if dist.is_initialized() else 0)
    if rollout_manager is not None:
        rollout_manager.load(args.start_rollout_id - 1)
    for rollout_id in range(args.start_rollout_id, args.num_rollout):
        if rollout_manager is not None:
            probe.prompts(rollout_id, rollout_manager.generate(rollout_id))
        losses = actor.train(rollout_id, None)  # no Ray object ref: the harness's data is seeded
        probe.after_rollout(actor, rollout_id, losses)
        if should_run_periodic_action(rollout_id, args.save_interval, None, args.num_rollout):
            probe.before_save(actor, rollout_id)
            actor.save_model(rollout_id)
            if rollout_manager is not None:
                rollout_manager.save(rollout_id)  # after the actor's save, as train.py
            probe.after_save(actor, rollout_id)
    return actor


def _gather_int(value: int) -> list[int]:
    if not dist.is_initialized():
        return [value]
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([value], dtype=torch.int64))
    return [int(t.item()) for t in gathered]
