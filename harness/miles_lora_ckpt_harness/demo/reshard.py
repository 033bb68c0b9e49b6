"""The demo's resharding resume: save at one parallel layout, crash, resume at another.

`miles-lora-ckpt demo --tp 2 --resume-tp 1` (and `--resume-pp`, `--resume-ep`, `--resume-etp`,
`--resume-vpp`, `--resume-world-size`) runs three phases:

    reference  an uninterrupted run at the demo's layout; at every save step it records the global
               view of the trainable state (`sim.global_view`: every adapter weight, fp32 master and
               moment as its global tensor, every per-parameter step, the param groups), and the losses
    train      the demo's train phase at the demo's layout (the last save crashes)
    resume     fresh processes at the resume layout load the newest intact generation (resharded at
               the load), record the same global view and train on to --steps

The resumed global view must be bit-identical to the reference's at the loaded step: `RESULT:
bit-exact` (exit 0) or `RESULT: MISMATCH <first differing global tensor>` (exit 1); a refused load
ends `RESULT: ERROR <reason>` (exit 1). Then `LOSS: max relative difference <x> over <n> steps`: the
resumed run's losses against the reference's (rank 0's, step by step, as tests/test_reshard.py
measures them); they differ by reduction order (another TP) and by data (the harness's global
batch follows the DP size and the stage layout), never by the state loaded.

Both layouts get the same model: the fewest layers (at least 2) that every model chunk of both
divides, and, when either layout has expert parallelism, experts numbered globally (as megatron's
MoE layer numbers them) so that the model does not depend on the EP size.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

AXES = ("tp", "pp", "ep", "etp", "vpp", "world_size")


def add_arguments(demo) -> None:
    """The `--resume-*` flags of `miles-lora-ckpt demo`."""
    group = demo.add_argument_group(
        "resharding on resume (any of these: the resume runs at another layout; default: the demo's own)"
    )
    what = {
        "tp": "tensor-parallel size of the resume (1 or 2)",
        "pp": "pipeline stages of the resume",
        "ep": "expert-parallel size of the resume",
        "etp": "expert-tensor-parallel size of the resume: 1 or 2 (default: the demo's --etp, else the resume's "
        "TP); a resume on fewer ranks than the save's expert TP needs it (e.g. --resume-etp 1)",
        "vpp": "virtual-pipeline chunks per stage of the resume (needs --resume-pp >= 2)",
        "world_size": "worker processes of the resume (data parallel follows)",
    }
    for axis, text in what.items():
        flag = "--resume-" + axis.replace("_", "-")
        group.add_argument(flag, type=int, default=None, metavar="N", help=text)


def requested(args) -> bool:
    """Whether any `--resume-*` flag was given."""
    return any(getattr(args, f"resume_{axis}") is not None for axis in AXES)


def check_args(args) -> str | None:
    """A usage problem of the `--resume-*` flags with the demo's other flags, or None."""
    clashes = [
        flag
        for flag, on in (
            ("--slots", args.slots is not None),
            ("--chain-slots 2", args.chain_slots > 1),
            ("--export-peft", args.export_peft),
        )
        if on
    ]
    if clashes:
        return f"--resume-* resumes one adapter run at another layout: drop {', '.join(clashes)}"
    if args.via == "miles":  # launch 2 at another layout: via_miles_reshard.py
        from miles_lora_ckpt_harness.demo import via_miles_reshard

        return via_miles_reshard.usage_problem(args)
    return None


def resume_config(args, config: dict) -> dict:
    """The resume's run config (the demo's `config` with the `--resume-*` axes), after giving both the
    same model (layer count, globally numbered experts). Raises ValueError naming a layout rule."""
    resume = dict(config)
    for axis in AXES:
        value = getattr(args, f"resume_{axis}")
        if value is not None:
            resume[axis] = value
    for c in (config, resume):  # an expert-TP equal to the TP size is megatron's default: dropped
        if c.get("etp") in (None, c["tp"]):
            c.pop("etp", None)
    chunks = math.lcm(config["pp"] * config["vpp"], resume["pp"] * resume["vpp"])
    layers = -(-2 // chunks) * chunks
    experts = math.lcm(config["ep"], resume["ep"]) if max(config["ep"], resume["ep"]) > 1 else 0
    for c in (config, resume):
        c.update(num_layers=layers, num_experts=experts)
    if resume == config:
        raise ValueError("the --resume-* flags give the demo's own layout: nothing to reshard")
    return resume


def run(args, config: dict, resume: dict, workdir: Path, train) -> int:
    """The phases `args.phase` selects; `train()` is the demo's own train phase at `config`."""
    from miles_lora_ckpt_harness.demo.report import describe_layout

    print(f"reshard: saved at {describe_layout(config)}, resumed at {describe_layout(resume)}")
    try:
        if args.phase in ("all", "reference"):
            _phase_reference(workdir, config, args)
        if args.phase in ("all", "train"):
            train()
        if args.phase in ("all", "resume"):
            return _phase_resume(workdir, config, resume, args)
    except _NotBuildable as exc:
        print(f"RESULT: not run ({exc})")
        return 2
    print("RESULT: reference written" if args.phase == "reference" else "RESULT: trained")
    return 0


class _NotBuildable(Exception):
    """A worker reported that the running megatron-core cannot build the optimizer."""


def _job(name: str, config: dict, payload: dict, args) -> tuple[list[dict], float]:
    from miles_lora_ckpt_harness.sim.launch import check_all, run_workers

    started = time.monotonic()
    target = f"miles_lora_ckpt_harness.demo.reshard:{name}"
    per_rank = check_all(run_workers(config["world_size"], target, payload, timeout_s=args.timeout))
    if "not_buildable" in per_rank[0]:
        raise _NotBuildable(per_rank[0]["not_buildable"])
    return per_rank, time.monotonic() - started


def _phase_reference(workdir: Path, config: dict, args) -> None:
    saves = list(range(args.save_every, args.steps, args.save_every))
    payload = {"config": config, "steps": args.steps, "saves": saves}
    per_rank, seconds = _job("reference_job", config, payload, args)
    reference = {"config": config, "steps": args.steps, "losses": per_rank[0]["losses"], "views": per_rank[0]["views"]}
    (workdir / "reference.json").write_text(json.dumps(reference, indent=1))
    print(
        f"reference: {args.steps} uninterrupted steps at the saved layout, global views at steps {saves} "
        f"in {seconds:.1f}s -> {workdir / 'reference.json'}"
    )


def _phase_resume(workdir: Path, config: dict, resume: dict, args) -> int:
    reference = json.loads((workdir / "reference.json").read_text())
    if reference["config"] != config or "views" not in reference:
        print("ERROR reference.json was made with another configuration; rerun --phase reference", file=sys.stderr)
        return 2
    payload = {"config": resume, "steps": reference["steps"], "root": str(workdir / "ckpt")}
    per_rank, seconds = _job("resume_job", resume, payload, args)
    mine = per_rank[0]
    if "refused" in mine:
        print(f"RESULT: ERROR {mine['refused']}")
        return 1
    if mine["iteration"] is None:
        print("RESULT: ERROR no committed generation to resume from: nothing was resharded")
        return 1
    print(f"resume: {mine['summary']} at the new layout ({seconds:.1f}s)")
    if mine["problems"]:
        print(f"RESULT: MISMATCH {mine['problems'][0]}")
        return 1
    expected = reference["views"][str(mine["iteration"])]
    differing = [k for k in sorted(set(expected) | set(mine["view"])) if expected.get(k) != mine["view"].get(k)]
    kinds = sorted({k.split(":", 1)[0] for k in expected})
    print(f"compared {len(expected)} global tensors and states ({', '.join(kinds)}) at step {mine['iteration']}")
    status = 0
    if differing:
        print(f"RESULT: MISMATCH {differing[0]}")
        status = 1
    else:
        print("RESULT: bit-exact")
    steps = range(mine["iteration"], reference["steps"])
    pairs = [(reference["losses"][s], mine["losses"][str(s)]) for s in steps]
    worst = max((abs(a - b) / max(abs(a), 1e-30) for a, b in pairs), default=0.0)
    print(
        "loss: rank 0's, resumed against the uninterrupted run's: another TP changes the reduction order; "
        "another DP size or stage layout also the data (the harness's global batch and stage-local losses follow them)"
    )
    print(f"LOSS: max relative difference {worst:.3g} over {len(pairs)} steps")
    return status


# =========================================================================== worker side


def _build(payload: dict):
    from miles_lora_ckpt_harness.sim.optimizers import NotBuildable, why_not_buildable
    from miles_lora_ckpt_harness.sim.train import build_run, config_from_dict

    config = config_from_dict(payload["config"])
    reason = why_not_buildable(config, harness_lion=False)
    try:
        if reason:
            raise NotBuildable(reason)
        return build_run(config), None
    except NotBuildable as exc:
        return None, {"not_buildable": str(exc)}


def reference_job(payload: dict, ctx) -> dict:
    """Train `steps` steps; after each step in `saves`, the global view's digests."""
    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt_harness.sim.global_view import global_view
    from miles_lora_ckpt_harness.sim.train import train_step

    run, unbuildable = _build(payload)
    if unbuildable:
        return unbuildable
    consensus = Consensus.for_world(timeout_s=120)
    losses, views = [], {}
    for step in range(payload["steps"]):
        losses.append(train_step(run, step))
        if step + 1 in payload["saves"]:
            view = global_view(run, consensus)
            if view["problems"]:
                raise RuntimeError(f"the reference's global view at step {step + 1}: {view['problems']}")
            views[str(step + 1)] = view["digests"]
    return {"losses": losses, "views": views}


def resume_job(payload: dict, ctx) -> dict:
    """Load the newest intact generation at this layout; the global view just after; train on."""
    from miles_lora_ckpt_harness.demo.report import load_newest
    from miles_lora_ckpt_harness.sim.global_view import global_view
    from miles_lora_ckpt_harness.sim.train import train_step

    run, unbuildable = _build(payload)
    if unbuildable:
        return unbuildable
    result, consensus, refused = load_newest(run, payload["root"], timeout_s=120)
    if refused is not None:  # the same refusal on every rank: reported as one line
        return {"refused": refused}
    if not result.loaded:
        return {"iteration": None}
    view = global_view(run, consensus)
    losses = {str(step): train_step(run, step) for step in range(result.iteration, payload["steps"])}
    what = ["adapter"] + (["fp32 masters + moments"] if result.optimizer_restored else [])
    what += ["scheduler"] if result.scheduler_restored else []
    summary = f"restored {', '.join(what)} from {Path(result.path).name} (iteration {result.iteration})"
    return {
        "iteration": result.iteration,
        "summary": summary,
        "view": view["digests"],
        "problems": view["problems"],
        "losses": losses,
    }
