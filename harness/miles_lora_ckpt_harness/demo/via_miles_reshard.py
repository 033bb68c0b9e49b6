"""`miles-lora-ckpt demo --via miles --tp 2 --resume-tp 1 --resume-world-size 1`: resharding through Miles.

The `--via miles` demo (`demo.via_miles`) with its launch 2 at another layout. Launch 2 is the
user's launch command with other Megatron parallel sizes or another number of ranks, and the
plugin's init hook reshards the newest committed generation at the load. Phases:

    reference  the training uninterrupted at the saved layout, no checkpoints; after each rollout
               the global view of the trainable state (`sim.global_view`: every adapter weight,
               fp32 master and moment as its global tensor, per-parameter steps, param groups)
    train      launch 1 at the saved layout, a rank SIGKILLed while saving (as `demo --via miles`)
    resume     launch 2 at the resume layout: Miles' init loads through the plugin (resharded);
               its global view right after init must equal the reference's at the rollout loaded

The output ends with `ROLLOUT: resumed at <id>`, `RESULT: bit-exact` (exit 0), `RESULT: MISMATCH
<first differing global tensor>` or `RESULT: ERROR <reason>` (exit 1). Then comes `LOSS: max
relative difference <x> over <n> steps`: rank 0's losses after the load against the reference's.
Another TP changes the reduction order, another DP size the data each rank trains on.

Every `--resume-*` axis goes through Miles (TP, PP, EP, expert TP, VPP, world size), and both
launches train the same model. When either has expert parallelism, both pass Megatron-LM's
`--num-experts`, the least common multiple of the two EP sizes; the stand-in then numbers its
experts globally, as megatron's MoE layer does. When the pipeline layouts differ, both pass
Megatron-LM's `--num-layers`: the fewest layers, at least 2, that every model chunk of both divides.
Stock Miles (`--without-plugin`) has no resharding load, and the real wheel's launch (`--miles-shape
miles-rl-0.0.2`) has no global-view probe: both are usage errors (exit 2).
"""

from __future__ import annotations

import copy
import json
import math
import sys

from miles_lora_ckpt_harness.sim.layout import check_layout, layers_for

# what launch 2 may change through Miles: {--resume-* axis: the Scenario attribute}
AXES = {"tp": "tp", "pp": "pp", "ep": "ep", "etp": "etp", "vpp": "vpp", "world_size": "world"}


def requested(args) -> bool:
    """Whether any `--resume-*` flag was given."""
    return any(getattr(args, f"resume_{axis}", None) is not None for axis in AXES)


def usage_problem(args) -> str | None:
    """Why these `--resume-*` flags cannot run through Miles, or None."""
    from miles_lora_ckpt_harness.demo.via_miles_launch import WHEEL_SHAPE

    if args.without_plugin:
        return "--resume-* --without-plugin: stock Miles has no resharding load (it loads at the saved layout only)"
    if args.miles_shape == WHEEL_SHAPE:
        return f"--resume-* with --miles-shape {WHEEL_SHAPE}: the resharding demo runs on the Miles stand-in shapes"
    return None


def resume_scenario(scenario):
    """Launch 2's scenario: `scenario` with the `--resume-*` layout; with expert parallelism on either
    side both get `--num-experts` (the same globally numbered experts), with another pipeline layout
    both get `--num-layers` (the same layers). Raises ValueError naming a layout rule, or when
    nothing changes."""
    args = scenario.args
    resume = copy.copy(scenario)
    for axis, attribute in AXES.items():
        value = getattr(args, f"resume_{axis}")
        if value is not None:
            setattr(resume, attribute, value)
    resume.crash_rank = 0
    for s in (scenario, resume):  # an expert-TP equal to the TP size is megatron's default: dropped
        if s.etp == s.tp:
            s.etp = None
    if all(getattr(resume, a) == getattr(scenario, a) for a in AXES.values()):
        raise ValueError("the --resume-* flags give the demo's own layout: nothing to reshard")
    if max(scenario.ep, resume.ep) > 1:
        scenario.num_experts = resume.num_experts = math.lcm(scenario.ep, resume.ep)
    if (scenario.pp, scenario.vpp) != (resume.pp, resume.vpp):
        chunks = math.lcm(scenario.pp * scenario.vpp, resume.pp * resume.vpp)
        scenario.num_layers = resume.num_layers = -(-2 // chunks) * chunks
    layers = resume.num_layers or layers_for(resume.pp, resume.vpp)
    check_layout(resume.world, resume.tp, resume.pp, resume.ep, args.cp, resume.vpp, layers, etp=resume.etp)
    return resume


def run_phases(scenario, resume, launcher) -> int:
    """The phases `--phase` selects: reference and launch 1 at `scenario`'s layout, launch 2 at `resume`'s."""
    from miles_lora_ckpt_harness.demo.via_miles_launch import first_launch

    args = scenario.args
    print(
        f"demo via Miles ({args.miles_shape} stand-in) with miles-lora-ckpt, resharding: saved at "
        f"{_layout(scenario)} on {scenario.world} ranks, resumed at {_layout(resume)} on {resume.world} ranks; "
        f"{args.dtype}, {args.adapters} adapters, {args.optimizer}, {args.steps} rollouts, "
        f"--save-interval {args.save_every}"
    )
    print("launch command, launch 1 (every rank):")
    print("  " + scenario.shell(scenario.command()))
    print("launch command, launch 2 (every rank): the same at the resume layout")
    print("  " + resume.shell(resume.command()))
    if args.phase in ("all", "reference"):
        _reference(scenario, launcher)
    if args.phase in ("all", "train"):
        first_launch(scenario, launcher)
    if args.phase in ("all", "resume"):
        return _relaunch(scenario, resume, launcher)
    print("RESULT: reference written" if args.phase == "reference" else "RESULT: trained")
    return 0


def _layout(scenario) -> str:
    """`tp=2`, then `pp=2`, `vpp=2`, `ep=2` and `etp=1` only where they are not megatron's defaults
    (1, and the TP size for `etp`)."""
    others = "".join(f" {a}={getattr(scenario, a)}" for a in ("pp", "vpp", "ep") if getattr(scenario, a) != 1)
    etp = f" etp={scenario.etp}" if scenario.etp not in (None, scenario.tp) else ""
    return f"tp={scenario.tp}{others}{etp}"


def _reference_file(scenario):
    return scenario.dir / "reference-reshard.json"


def _reference(scenario, launcher) -> None:
    from miles_lora_ckpt_harness.demo.via_miles_launch import launch

    argv = scenario.training_flags()
    results, seconds = launch(scenario, launcher, argv, env={}, extra={"views": True})
    failed = [r for r in results if not r.ok or r.result["failed"]]
    if failed:
        raise SystemExit("reference run failed:\n" + "\n".join(r.error or r.result["failed"] for r in failed))
    report = results[0].result
    problems = [p for view in report["views"].values() for p in view["problems"]]
    if problems:
        raise SystemExit(f"the reference's global view: {problems[0]}")
    reference = {
        "training": argv,
        "world_size": scenario.world,
        "losses": report["losses"],
        "views": {rollout: view["digests"] for rollout, view in report["views"].items()},
    }
    _reference_file(scenario).write_text(json.dumps(reference, indent=1))
    print(
        f"reference: {scenario.args.steps} rollouts uninterrupted at the saved layout, a global view after each "
        f"({seconds:.1f}s)"
    )


def _relaunch(scenario, resume, launcher) -> int:
    from miles_lora_ckpt_harness.demo.via_miles_launch import last_line, launch, newest_rollout

    path = _reference_file(scenario)
    reference = json.loads(path.read_text()) if path.exists() else None
    if (
        reference is None
        or reference["training"] != scenario.training_flags()
        or reference["world_size"] != scenario.world
    ):
        print(
            "ERROR reference-reshard.json is missing or was made with other flags; rerun --phase reference",
            file=sys.stderr,
        )
        return 2
    newest = newest_rollout(scenario)
    if newest is None:
        print("RESULT: ERROR no committed generation to resume from: nothing was resharded")
        return 1
    results, seconds = launch(resume, launcher, resume.command(), extra={"views": True})
    print(f"launch 2: the same command at {_layout(resume)} on {resume.world} ranks ({seconds:.1f}s)")
    failed = [r for r in results if not r.ok or r.result["failed"]]
    if failed:
        first = failed[0]
        print(f"RESULT: ERROR launch 2 failed on rank {first.rank}: {last_line(first.error or first.result['failed'])}")
        return 1
    report = results[0].result
    start = report["start_rollout_id"]
    print(f"ROLLOUT: resumed at {start}")
    view = report["view_after_init"]
    expected = reference["views"][str(newest)]
    kinds = sorted({k.split(":", 1)[0] for k in expected})
    print(f"compared {len(expected)} global tensors and states ({', '.join(kinds)}) at rollout {newest}")
    mismatch = None
    if start != newest + 1:
        mismatch = f"rollout counter resumed at {start}, the newest checkpoint is rollout {newest}"
    elif view["problems"]:
        mismatch = view["problems"][0]
    else:
        mismatch = next(
            (k for k in sorted(set(expected) | set(view["digests"])) if expected.get(k) != view["digests"].get(k)), None
        )
    print("RESULT: bit-exact" if mismatch is None else f"RESULT: MISMATCH {mismatch}")
    steps = sorted(report["losses"], key=int)
    pairs = [(reference["losses"][s], report["losses"][s]) for s in steps if s in reference["losses"]]
    worst = max((abs(a - b) / max(abs(a), 1e-30) for a, b in pairs), default=0.0)
    print(
        "loss: rank 0's, resumed against the uninterrupted run's: another TP changes the reduction order, "
        "another number of ranks the data each trains on, another pipeline layout rank 0's (stage-local) loss"
    )
    print(f"LOSS: max relative difference {worst:.3g} over {len(pairs)} steps")
    return 0 if mismatch is None else 1
