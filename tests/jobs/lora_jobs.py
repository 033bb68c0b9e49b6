"""Worker functions for single-LoRA save/resume tests (real megatron DistributedOptimizer on CPU).

These runs depend on the CPU harness's three megatron fallback-path fixes (no TE/Apex here):
`step` not copied from dp-zero payloads, per-parameter `step` after load_state_dict, and step 0
for an empty DP shard; see miles_lora_ckpt/sim/cpu_intercepts.py.
"""

from __future__ import annotations

from pathlib import Path

from miles_lora_ckpt.core import faults
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint, save_lora_checkpoint
from miles_lora_ckpt.sim.model import SimConfig
from miles_lora_ckpt.sim.snapshot import compare_digests, snapshot, snapshot_digests
from miles_lora_ckpt.sim.train import build_run, teardown, train_step


class Args:
    """The few Miles args the saver reads."""

    lora_rank = 4
    lora_alpha = 4.0
    no_save_optim = False


def run_steps(run, start: int, stop: int) -> list[float]:
    return [train_step(run, step) for step in range(start, stop)]


def save(run, root, iteration: int, consensus: Consensus, args=None) -> str:
    return save_lora_checkpoint(
        run.model,
        args or Args(),
        root,
        optimizer=run.optimizer,
        opt_param_scheduler=run.scheduler,
        iteration=iteration,
        consensus=consensus,
    )


def load(run, path, consensus: Consensus, **kwargs):
    return load_lora_checkpoint(
        run.model, path, optimizer=run.optimizer, opt_param_scheduler=run.scheduler, consensus=consensus, **kwargs
    )


def reference(config: SimConfig, steps: int) -> tuple[list[float], dict]:
    run = build_run(config)
    losses = run_steps(run, 0, steps)
    digests = snapshot_digests(snapshot(run))
    teardown(run)
    return losses, digests


def save_then_resume(
    config: SimConfig, steps: int, save_at: int, root: Path, consensus: Consensus, load_optim: bool = True
) -> dict:
    run = build_run(config)
    first = run_steps(run, 0, save_at)
    save(run, root, save_at, consensus)
    run_steps(run, save_at, save_at + 1)  # the interrupted run goes on a little before it dies
    teardown(run)
    resumed = build_run(config)
    result = load(resumed, root, consensus, load_optim=load_optim)
    rest = run_steps(resumed, result.iteration, steps)
    digests = snapshot_digests(snapshot(resumed))
    teardown(resumed)
    return {"losses": first + rest, "digests": digests, "result": result.__dict__}


def resume_matrix(payload: dict, ctx) -> dict:
    """For each case: uninterrupted reference vs save at k, crash, resume; first mismatch per case.

    A case is `{"config": SimConfig dict, "save_at": k}`, plus `"load_optim": false` for a negative
    control (resume without optimizer state must NOT be bit-exact, or the comparison is blind).
    """
    consensus = Consensus.for_world(timeout_s=120)
    out = {}
    for index, case in enumerate(payload["cases"]):
        config = SimConfig.from_dict(case["config"])
        load_optim = case.get("load_optim", True)
        axes = (("tp", config.tp), ("pp", config.pp), ("ep", config.ep))
        layout = f"w{config.world_size}" + "".join(f"-{axis}{size}" for axis, size in axes if size > 1)
        name = f"{config.optimizer}/{config.dtype}/{config.adapters}/{layout}/save@{case['save_at']}"
        name += "" if load_optim else "/no-optim-control"
        ref_losses, ref_digests = reference(config, payload["steps"])
        root = ctx.scratch_dir / f"case{index}"
        got = save_then_resume(config, payload["steps"], case["save_at"], root, consensus, load_optim)
        out[name] = {
            "loss_mismatch": None if got["losses"] == ref_losses else [ref_losses, got["losses"]],
            "first_difference": compare_digests(ref_digests, got["digests"]),
            "names": sorted(ref_digests),
            "optimizer": config.optimizer,
            "result": got["result"],
        }
    return out


def train_and_save(payload: dict, ctx) -> dict:
    """Train `steps` steps, then save into `root` (`saves` times, default once), and into
    `no_optim_root` (if given) once more as `--no-save-optim` would."""
    consensus = Consensus.for_world(timeout_s=60)
    run = build_run(SimConfig.from_dict(payload["config"]))
    run_steps(run, 0, payload["steps"])
    paths = [save(run, payload["root"], payload["steps"], consensus) for _ in range(payload.get("saves", 1))]
    if payload.get("no_optim_root"):
        no_optim = Args()
        no_optim.no_save_optim = True
        save(run, payload["no_optim_root"], payload["steps"], consensus, no_optim)
    return {"paths": paths, "digests": snapshot_digests(snapshot(run))}


def try_loads(payload: dict, ctx) -> dict:
    """One run (trained `pre_steps`) tries to load each case path; report errors and bit-identity."""
    consensus = Consensus.for_world(timeout_s=60)
    run = build_run(SimConfig.from_dict(payload["config"]))
    run_steps(run, 0, payload.get("pre_steps", 1))
    outcomes = {}
    logged = _capture_warnings()
    for name, path in payload["cases"].items():
        logged.clear()
        if isinstance(path, list):
            path = path[ctx.rank]
        before = snapshot_digests(snapshot(run))
        phase, failing = payload.get("faults", {}).get(name, (None, None))
        if phase is not None and ctx.rank == failing:
            faults.arm(phase, failing, "raise")
        try:
            result = load(run, path, consensus, **payload.get("load_kwargs", {}))
            error = None
        except CheckpointError as exc:
            result, error = None, str(exc)
        after = snapshot_digests(snapshot(run))
        outcomes[name] = {
            "error": error,
            "changed": compare_digests(before, after),
            "result": result.__dict__ if result else None,
            "logged": list(logged),
        }
    return outcomes


def _capture_warnings() -> list[str]:
    """Every WARNING the package logs from now on in this process, as text."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("miles_lora_ckpt")
    logger.addHandler(Keep(logging.WARNING))
    return records


def gathered_world_state(run) -> dict:
    """Each DP root's world tensors of every child, as the saver would write them."""
    import torch

    from miles_lora_ckpt.megatron import optimizer_state as ostate

    out = {}
    for index, child in enumerate(ostate.optimizer_children(run.optimizer)):
        if ostate.is_stub(child):
            continue
        keys = ostate.resolve_state_keys(child)
        world = ostate.gather_to_dp_root(child, ostate.local_shards(child, keys))
        for name, tensor in (world or {}).items():
            out[f"child{index}.{name}"] = tensor
    del torch
    return out


def elastic_load(payload: dict, ctx) -> dict:
    """Load a checkpoint saved at another DP size and compare the regathered state bit for bit."""
    from miles_lora_ckpt.core import storage
    from miles_lora_ckpt.megatron.topology import current_coordinates
    from miles_lora_ckpt.savers.single_lora import optimizer_file

    consensus = Consensus.for_world(timeout_s=60)
    run = build_run(SimConfig.from_dict(payload["config"]))
    result = load(run, payload["root"], consensus)
    gathered = gathered_world_state(run)
    key = current_coordinates().model_parallel_key
    compared, differing = 0, []
    for name, tensor in gathered.items():
        index = int(name.split(".")[0].removeprefix("child"))
        saved, _ = storage.load_tensors(Path(result.path) / optimizer_file(index, key))
        compared += 1
        if not tensor.equal(saved[name.split(".", 1)[1]]):
            differing.append(name)
    loss = train_step(run, result.iteration)  # and training goes on at the new DP size
    return {
        "compared": compared,
        "differing": differing,
        "names": sorted(gathered),
        "loss": loss,
        "result": result.__dict__,
    }


def native_lion_round_trip(payload: dict, ctx) -> dict:
    """Build megatron's own Lion (get_megatron_optimizer(optimizer='lion')); skip if it cannot."""
    from miles_lora_ckpt.megatron.optimizer_state import optimizer_children, resolve_state_keys
    from miles_lora_ckpt.sim import train

    original = train._optimizer_config

    def lion_config(config):
        built = original(config)
        built.optimizer = "lion"
        return built

    train._optimizer_config = lion_config
    config = SimConfig.from_dict(payload["config"])
    try:
        build_run(config)
    except Exception as exc:  # noqa: BLE001 - reported as a skip reason
        return {"skip": f"megatron cannot build its own Lion here: {type(exc).__name__}: {exc}"}
    consensus = Consensus.for_world(timeout_s=60)
    ref_losses, ref_digests = reference(config, 4)
    got = save_then_resume(config, 4, 2, Path(payload["root"]), consensus)
    run = build_run(config)
    keys = [list(resolve_state_keys(c)) for c in optimizer_children(run.optimizer) if c.optimizer is not None]
    return {"first_difference": compare_digests(ref_digests, got["digests"]), "keys": keys[0]}


def legacy_warm_start(payload: dict, ctx) -> dict:
    """Write a stock-Miles adapter directory (torch.save per global rank), warm-start from it."""
    import torch

    from miles_lora_ckpt.megatron.adapter_shards import is_adapter_param_name

    config = SimConfig.from_dict(payload["config"])
    trained = build_run(config)
    run_steps(trained, 0, 2)
    legacy = Path(payload["dir"])
    legacy.mkdir(parents=True, exist_ok=True)
    # what stock Miles writes: {wrapped-chunk name: tensor} per global rank, and pickled training state
    adapter = {n: p.data.cpu() for n, p in trained.model[0].named_parameters() if is_adapter_param_name(n)}
    torch.save(adapter, legacy / f"adapter_megatron_rank{ctx.rank}.pt")
    torch.save({"iteration": 2, "optimizer": {"param_groups": []}}, legacy / f"training_state_rank{ctx.rank}.pt")
    teardown(trained)

    consensus = Consensus.for_world(timeout_s=60)
    fresh = build_run(config)
    result = load(fresh, legacy, consensus)
    loaded = {n: p for n, p in fresh.model[0].named_parameters() if is_adapter_param_name(n)}
    same_adapter = sorted(adapter) == sorted(loaded) and all(torch.equal(adapter[n], loaded[n]) for n in adapter)
    return {"result": result.__dict__, "same_adapter": same_adapter, "masters_match_adapter": _masters_match(fresh)}


def _masters_match(run) -> bool:
    """Every fp32 master shard equals float() of its (loaded) model parameter slice."""
    from miles_lora_ckpt.megatron import optimizer_state as ostate

    for child in ostate.optimizer_children(run.optimizer):
        if ostate.is_stub(child):
            continue
        for model_param in child.model_param_group_index_map:
            master, _ = ostate.main_and_state(child, model_param)
            span = child._get_model_param_range_map(model_param)["param"]
            if not master.detach().view(-1).equal(model_param.detach().view(-1)[span.start : span.end].float()):
                return False
    return True
