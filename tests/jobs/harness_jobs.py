"""Job functions for tests/test_harness.py; they run inside spawned gloo workers (see sim.launch).

``harness_job`` runs the payload's sections in order, so one spawned job serves several tests:

* ``determinism``: build each run spec twice, train, return per build losses and snapshot digests.
* ``fallback_bugs``: show that megatron's unpatched fallback path hits bugs 1 and 2.
* ``resume``: a dp-zero save/load round trip through megatron, then more steps; needs fixes 1, 2.
* ``compare_selfcheck``: ``compare_snapshots`` is bitwise and NaN-safe.
* ``padding``: a model whose DP shard is only padding on some rank; ``state_dict()`` needs fix 3.
* ``mixed``: dense and expert adapters, two real optimizer children, train.
* ``layouts``: context-parallel and virtual-pipeline runs: determinism plus what megatron built
  (model chunks and their DDPs, layer offsets, CP positions, the groups grads and state use).
"""

from __future__ import annotations

import copy
import math
import os
import signal
import time

import megatron.core
import torch

from miles_lora_ckpt.megatron.optimizer_children.distributed import main_and_state
from miles_lora_ckpt_harness.sim import cpu_intercepts
from miles_lora_ckpt_harness.sim.model import SimConfig
from miles_lora_ckpt_harness.sim.snapshot import compare_snapshots, snapshot, snapshot_digests
from miles_lora_ckpt_harness.sim.train import build_run, teardown, train_step


def harness_job(payload: dict, ctx) -> dict:
    """Run every section named in the payload; return their results keyed by section."""
    sections = {
        "determinism": _determinism,
        "fallback_bugs": _fallback_bugs,
        "resume": _resume,
        "compare_selfcheck": _compare_selfcheck,
        "padding": _padding,
        "mixed": _mixed,
        "layouts": _layouts,
        "rebuilds": _rebuilds,
    }
    out = {"megatron_version": megatron.core.__version__, "intercepts_active": cpu_intercepts.active()}
    for name, args in payload.items():
        out[name] = sections[name](args, ctx)
    teardown()
    return out


def _config(spec: dict, ctx) -> SimConfig:
    return SimConfig(world_size=ctx.world_size, **spec)


def _spec_key(spec: dict) -> str:
    return ",".join(f"{k}={spec[k]}" for k in sorted(spec))


# ------------------------------------------------------------------------------ determinism


def _determinism(args: dict, ctx) -> dict:
    return {
        _spec_key(spec): [_train_and_digest(_config(spec, ctx), args["steps"]) for _ in range(2)]
        for spec in args["specs"]
    }


def _train_and_digest(config: SimConfig, steps: int) -> dict:
    run = build_run(config)
    initial = snapshot_digests(snapshot(run))
    losses = [train_step(run, step) for step in range(steps)]
    return {
        "losses": losses,
        "initial": initial,
        "final": snapshot_digests(snapshot(run)),
        "optimizer": _optimizer_facts(run),
    }


def _optimizer_facts(run) -> dict:
    children = []
    for child in run.optimizer.chained_optimizers:
        stub = bool(child.is_stub_optimizer)
        groups = [] if stub else child.optimizer.param_groups
        children.append({"stub": stub, "expert": [bool(g["is_expert_parallel"]) for g in groups]})
    try:
        run.optimizer.state_dict()
        state_dict_error = None
    except Exception as exc:  # the stub defect: recorded, asserted by the test
        state_dict_error = f"{type(exc).__name__}: {exc}"
    return {
        "chained_type": type(run.optimizer).__name__,
        "chained_stub": bool(run.optimizer.is_stub_optimizer),
        "children": children,
        "state_dict_error": state_dict_error,
    }


# ------------------------------------------------------------------------------ fallback-path bugs


def _fallback_bugs(args: dict, ctx) -> dict:
    """Megatron's UNPATCHED methods (``__wrapped__``) next to the patched ones, on the same input."""
    config = _config(args["spec"], ctx)
    run = build_run(config)
    train_step(run, 0)
    child = run.optimizer.chained_optimizers[0]
    return {**_bug1(child), **_bug2(child, config)}


def _bug1(child) -> dict:
    """Setting a param's state from a dp-zero-like payload, which has no 'step'."""
    model_param = next(iter(child.model_param_group_index_map))
    master, state = main_and_state(child, model_param)
    payload = {"param": master.clone(), **{k: v.clone() for k, v in state.items() if k != "step"}}
    unpatched = type(child)._set_main_param_and_optimizer_states.__wrapped__
    return {
        "bug1_unpatched": _error_of(lambda: unpatched(child, model_param, payload)),
        "bug1_patched": _error_of(lambda: child._set_main_param_and_optimizer_states(model_param, payload)),
    }


def _bug2(child, config: SimConfig) -> dict:
    """Loading a state_dict into a fresh optimizer: is one 'step' tensor shared by every param?"""
    state_dict = child.state_dict()
    shared = {}
    for label in ("unpatched", "patched"):
        fresh = build_run(config).optimizer.chained_optimizers[0]
        load = type(fresh).load_state_dict.__wrapped__ if label == "unpatched" else type(fresh).load_state_dict
        load(fresh, copy.deepcopy(state_dict))
        steps = [s["step"] for s in fresh.optimizer.state.values()]
        shared[f"bug2_{label}_shares_step"] = len(steps) > 1 and all(s is steps[0] for s in steps)
    return shared


def _error_of(call) -> str | None:
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# ------------------------------------------------------------------------------ resume


def _resume(args: dict, ctx) -> dict:
    return {
        _spec_key(spec): _resume_one(_config(spec, ctx), args["steps_before"], args["steps_after"])
        for spec in args["specs"]
    }


def _resume_one(config: SimConfig, steps_before: int, steps_after: int) -> dict:
    """Train, save through megatron's dp-zero path, load into a fresh run, train both further."""
    source = build_run(config)
    for step in range(steps_before):
        train_step(source, step)
    saved = _save(source)
    resumed = build_run(config)
    _load(resumed, saved)
    after_load = compare_snapshots(snapshot(source), snapshot(resumed))
    losses = []
    for step in range(steps_before, steps_before + steps_after):
        losses.append((train_step(source, step), train_step(resumed, step)))
    state_keys = sorted({name.rsplit("/", 1)[-1] for name in snapshot(resumed) if "/state/" in name})
    return {
        "first_difference_after_load": after_load,
        "first_difference_after_steps": compare_snapshots(snapshot(source), snapshot(resumed)),
        "losses": losses,
        "state_keys": state_keys,
    }


def _save(run) -> dict:
    children = [c for c in run.optimizer.chained_optimizers if not c.is_stub_optimizer]
    return {
        "params": {n: p.detach().clone() for n, p in run.inner_model.named_parameters() if p.requires_grad},
        "children": [(copy.deepcopy(c.state_dict()), c.get_parameter_state_dp_zero()) for c in children],
        "scheduler": copy.deepcopy(run.scheduler.state_dict()),
    }


def _load(run, saved: dict) -> None:
    children = [c for c in run.optimizer.chained_optimizers if not c.is_stub_optimizer]
    with torch.no_grad():  # fp32 masters are views of the model params
        for name, param in run.inner_model.named_parameters():
            if name in saved["params"]:
                param.copy_(saved["params"][name])
        for child, (state_dict, dp_zero) in zip(children, saved["children"], strict=True):
            child.load_state_dict(state_dict)
            child.load_parameter_state_from_dp_zero(dp_zero)
    run.scheduler.load_state_dict(saved["scheduler"])


# ------------------------------------------------------------------------------ compare self-check


def _compare_selfcheck(args: dict, ctx) -> dict:
    nan = torch.tensor([float("nan"), 1.0])
    return {
        "nan_equals_itself": compare_snapshots({"x": nan}, {"x": nan.clone()}),
        "signed_zero": compare_snapshots({"x": torch.tensor([0.0])}, {"x": torch.tensor([-0.0])}),
        "dtype": compare_snapshots({"x": torch.zeros(2)}, {"x": torch.zeros(2, dtype=torch.int32)}),
        "shape": compare_snapshots({"x": torch.zeros(2, 2)}, {"x": torch.zeros(4)}),
        "missing": compare_snapshots({"x": torch.zeros(1), "y": torch.zeros(1)}, {"x": torch.zeros(1)}),
        "one_ulp": compare_snapshots(
            {"x": torch.tensor([1.0])}, {"x": torch.tensor([1.0]).nextafter(torch.tensor([2.0]))}
        ),
    }


# ------------------------------------------------------------------------------ padding and mixed


def _padding(args: dict, ctx) -> dict:
    """A tiny dense model at DP=3: some rank's shard is only padding (needs fix 3)."""
    run = build_run(_config(args["spec"], ctx))
    losses = [train_step(run, step) for step in range(args["steps"])]
    child = run.optimizer.chained_optimizers[0]
    return {
        "losses": losses,
        "local_params": len(child.model_param_group_index_map),
        "inner_state_len": len(child.optimizer.state),
        "bucket_numel": [n for per_dtype in child.per_bucket_numel for v in per_dtype.values() for n in v],
        "bucket_numel_unpadded": [
            n for per_dtype in child.per_bucket_numel_unpadded for v in per_dtype.values() for n in v
        ],
        "unpatched_state_dict_error": _error_of(lambda: type(child).state_dict.__wrapped__(child)),
        "state_dict_error": _error_of(run.optimizer.state_dict),
    }


def _mixed(args: dict, ctx) -> dict:
    run = build_run(_config(args["spec"], ctx))
    initial = snapshot(run)
    losses = [train_step(run, step) for step in range(args["steps"])]
    final = snapshot(run)
    changed = sorted(n for n in initial if n.startswith("param/") and compare_snapshots({n: initial[n]}, {n: final[n]}))
    return {
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
        "optimizer": _optimizer_facts(run),
        "params": sorted(n for n in final if n.startswith("param/")),
        "changed_params": changed,
        "masters": sorted(n for n in final if "/master/" in n),
    }


# ------------------------------------------------------------------------------ CP and VPP layouts


def _layouts(args: dict, ctx) -> dict:
    out = {}
    for spec in args["specs"]:
        config = _config(spec, ctx)
        builds = [_train_and_digest(config, args["steps"]) for _ in range(2)]
        out[_spec_key(spec)] = {"builds": builds, "facts": _layout_facts(build_run(config))}
    return out


def _layout_facts(run) -> dict:
    """What megatron built for this layout, as plain JSON."""
    import hashlib

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from miles_lora_ckpt.megatron.optimizer_children.chain import select
    from miles_lora_ckpt_harness.sim.layout import cp_positions
    from miles_lora_ckpt_harness.sim.train import local_batch

    config = run.config
    children = [c.optimizer for c in select(run.optimizer)]
    inputs = [local_batch(config, 0, vp)[0] for vp in range(len(run.model))]
    return {
        "cp_size": mpu.get_context_parallel_world_size(),
        "cp_rank": mpu.get_context_parallel_rank(),
        "positions": cp_positions(config.seq_length, config.cp, mpu.get_context_parallel_rank()),
        "input_digests": [hashlib.sha256(x.numpy().tobytes()).hexdigest() for x in inputs],
        "dp_cp_ranks": dist.get_process_group_ranks(mpu.get_data_parallel_group(with_context_parallel=True)),
        "grad_reduce_ranks": [
            dist.get_process_group_ranks(chunk.buffers[0].data_parallel_group) for chunk in run.model if chunk.buffers
        ],
        "dense_child_dp_ranks": dist.get_process_group_ranks(children[0].data_parallel_group_gloo),
        "vpp_world": mpu.get_virtual_pipeline_model_parallel_world_size(),
        "chunks": len(run.model),
        "distinct_ddps": len({id(chunk) for chunk in run.model}),
        "chunk_buffers": [len(chunk.buffers) for chunk in run.model],
        "chunk_layers": [[layer.global_index for layer in m.layers] for m in run.inner_models],
        "chunk_vp_stage": [m.vp_stage for m in run.inner_models],
        "dense_child_buffers": len(children[0].buffers),
    }


# ------------------------------------------------------------------------------ launcher behaviour


_KEPT: list = []  # what a job keeps alive until its process ends, as a module global would


def launcher_job(payload: dict, ctx) -> dict:
    """Per-rank behaviour chosen by the payload: return, raise, SIGKILL itself, or hang."""
    action = payload["actions"][ctx.rank]
    if action == "raise":
        raise ValueError(f"boom from rank {ctx.rank}")
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        time.sleep(3600)
    if action == "leave-a-child":  # as megatron's dist_checkpointing does: a Manager kept in a global
        import multiprocessing

        _KEPT.append(multiprocessing.get_context("spawn").Manager())
        return {"child_pid": _KEPT[-1]._process.pid}
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "payload": payload,
        "scratch_is_dir": ctx.scratch_dir.is_dir(),
        "env_mark": os.environ.get("SIM_TEST_MARK"),
        "torch_threads": torch.get_num_threads(),
        "dist_world_size": torch.distributed.get_world_size(),
        "intercepts_active": cpu_intercepts.active(),
    }


def import_job(payload: dict, ctx) -> dict:
    """Import the payload's module by name (found on the rank's sys.path) and return its VALUE."""
    import importlib

    module = importlib.import_module(payload["module"])
    return {"module": payload["module"], "value": module.VALUE}


# ------------------------------------------------------------------------------ rebuilds


def _rebuilds(args: dict, ctx) -> dict:
    """Build, step and tear down `count` runs in this process; the threads, open descriptors and
    live process groups after each (issue 23 item 8: megatron's destroy_model_parallel alone kept
    every gloo group, ~50 threads and ~90 descriptors per W=4 build)."""
    import torch.distributed as dist

    pid = os.getpid()
    counts = []
    for _ in range(args["count"]):
        run = build_run(_config(args["spec"], ctx))
        train_step(run, 0)
        teardown(run)
        counts.append(
            {
                "threads": len(os.listdir(f"/proc/{pid}/task")),
                "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "groups": len(dist.distributed_c10d._world.pg_map),
            }
        )
    return counts
