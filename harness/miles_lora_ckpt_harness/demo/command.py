"""`miles-lora-ckpt demo`: interrupt a real megatron LoRA run mid-save, resume it, prove bit-exactness.

Runs on CPU: each phase is a job of N real processes joined by gloo, each building the tiny LoRA
model of `miles_lora_ckpt_harness.sim` with the optimizer megatron-core's own get_megatron_optimizer
builds: a DistributedOptimizer for Adam; Float16 (bf16) or FP32 children for Lion and Muon (Muon
with a trainable bias on every lora_B, which its --muon-scalar optimizer steps); a
LayerWiseDistributedOptimizer with --layer-wise, or one slot per layer group with --chain-slots 2
(Miles' multi-LoRA chain, saved as one generation). --slots N is the multi-LoRA demo: per-slot
roots, cadences, a retired and re-registered slot (`miles_lora_ckpt_harness.demo.slots`). Lion and Muon need megatron-core 0.19 with emerging-optimizers (the 0.19.2 tier
of `make test`: `make demo-tier2 ARGS="--optimizer muon"`); where the running megatron cannot
build the optimizer, the demo says why and exits 2.

    reference  an uninterrupted run of --steps steps -> DIR/reference.json (losses, tensor digests)
    train      a fresh run saving every --save-every steps into DIR/ckpt; with --crash-at, rank
               --crash-rank SIGKILLs itself at that protocol phase of the last save
    resume     fresh processes resume from DIR/ckpt (newest intact generation; none: from step 0),
               train to --steps and compare every tensor with DIR/reference.json
    all        reference, train with a crash in the middle of a save, resume (the default)

Parallel layout: --tp, --pp, --ep, --etp, --cp and --vpp compose with --world-size as in megatron
(world = tp * cp * dp * pp; the optimizer shards over dp * cp). --etp is megatron's expert tensor
parallel size (its default: --tp; 1 or 2), and the expert linears split over megatron's expert-TP
group (another value than --tp: at TP 1 the group spans DP or CP replicas; at TP 2 each TP rank runs
the whole experts on its part of the tokens). --vpp needs --pp >= 2 and gives
every rank --vpp model chunks; the model gets the fewest layers (at least 2) that give each of the
pp * vpp chunks the same number. Examples:

    miles-lora-ckpt demo --cp 2 --world-size 4           context parallel 2, data parallel 2
    miles-lora-ckpt demo --vpp 2 --pp 2 --world-size 2   two pipeline stages, two chunks each
    miles-lora-ckpt demo --tp 2 --ep 2 --world-size 4    tensor and expert parallel
    miles-lora-ckpt demo --etp 2 --world-size 2          experts split over expert-TP 2, dense TP 1

With --resume-tp/--resume-pp/--resume-ep/--resume-etp/--resume-vpp/--resume-world-size the resume
runs at another layout: the checkpoint is resharded at the load, every global tensor (adapter, fp32
masters, every moment, steps) is compared with the uninterrupted run's at that step, and a last line
`LOSS: max relative difference <x> over <n> steps` follows the RESULT line (see
`miles_lora_ckpt_harness.demo.reshard`), e.g.

    miles-lora-ckpt demo --tp 2 --resume-tp 1
    miles-lora-ckpt demo --pp 2 --vpp 2 --resume-pp 1 --resume-vpp 1
    miles-lora-ckpt demo --etp 2 --resume-etp 1

With --via miles the same three phases run a Miles launch command with the plugin's init hook
through the Miles stand-in (see `miles_lora_ckpt_harness.demo.via_miles`); with --resume-* flags too,
launch 2 runs at that layout and ends the same way, RESULT then LOSS
(`miles_lora_ckpt_harness.demo.via_miles_reshard`), e.g.

    miles-lora-ckpt demo --via miles --tp 2 --resume-tp 1 --resume-world-size 1
    miles-lora-ckpt demo --via miles --ep 2 --resume-ep 1
    miles-lora-ckpt demo --via miles --etp 2 --resume-etp 1
    miles-lora-ckpt demo --via miles --pp 2 --vpp 2 --resume-pp 1 --resume-vpp 1

The last line is `RESULT: bit-exact` (exit 0), `RESULT: MISMATCH <first differing tensor>` (exit 1), or
`RESULT: ERROR <reason>` (exit 1) when the resume refuses to load the checkpoint; a usage error (an
invalid layout included) prints `ERROR ...` and exits 2, and an optimizer the running megatron-core
cannot build ends `RESULT: not run (<reason>)` with exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from miles_lora_ckpt.core.faults import SAVE_PHASES
from miles_lora_ckpt_harness.demo import reshard, slots, via_miles
from miles_lora_ckpt_harness.demo.report import describe_layout, load_newest, report_train
from miles_lora_ckpt_harness.sim.layout import check_layout, layers_for

OPTIMIZERS = ("adam", "lion", "muon")


class _NotBuildable(Exception):
    """A worker reported that the running megatron-core cannot build the optimizer."""


BRIDGE_MODEL = "bridge-qwen2"  # --export-peft where the real Megatron-Bridge is installed (make demo-bridge)


def add_parser(subparsers) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="crash a real megatron LoRA run mid-save on CPU, resume it, check it is bit-exact",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--workdir", default="demo-work", help="where reference.json and ckpt/ go (default ./demo-work)")
    demo.add_argument(
        "--world-size", type=int, default=2, help="worker processes; data parallel = world / (tp*cp*pp) (default 2)"
    )
    layout = demo.add_argument_group("parallel layout (megatron's, composed with --world-size)")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel size: 1 or 2 (default 1)")
    layout.add_argument("--pp", type=int, default=1, help="pipeline stages, each on a local loss (default 1)")
    layout.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size: each EP rank its own experts (default 1)"
    )
    layout.add_argument(
        "--etp",
        type=int,
        default=None,
        metavar="N",
        help="expert-tensor-parallel size: 1 or 2 (default: --tp, megatron's default), also another value than --tp "
        "(not with --slots, --export-peft or the real wheel's --miles-shape)",
    )
    layout.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel size: each CP rank trains on its part of the sequence (default 1)",
    )
    layout.add_argument(
        "--vpp",
        type=int,
        default=1,
        help="virtual-pipeline chunks per stage, each with its own DDP; needs --pp >= 2 (default 1)",
    )
    demo.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="model parameter dtype (default bf16)")
    demo.add_argument(
        "--adapters",
        choices=("dense", "expert-only", "mixed"),
        default="mixed",
        help="which linears carry LoRA; expert-only gives megatron a stub dense optimizer (default mixed)",
    )
    demo.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adam",
        help="the optimizer megatron builds: adam (two moments), lion (one), muon (a momentum buffer for "
        "matrices, --muon-scalar for the biases); lion and muon need megatron-core 0.19 (default adam)",
    )
    demo.add_argument(
        "--muon-scalar",
        choices=("adam", "lion"),
        default="adam",
        help="megatron's muon_scalar_optimizer: what Muon gives non-matrix parameters (default adam)",
    )
    demo.add_argument(
        "--distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="DistributedOptimizer children (DDP reduce-scatters) or, with --no-distributed-optimizer, "
        "Float16/FP32 children (DDP all-reduces); default: what megatron builds for the optimizer",
    )
    demo.add_argument(
        "--layer-wise",
        action="store_true",
        help="a LayerWiseDistributedOptimizer: whole parameters sharded over the ranks (megatron's for Muon, "
        "Miles' multi-LoRA construction for Adam and Lion)",
    )
    demo.add_argument(
        "--slots",
        type=int,
        default=None,
        metavar="N",
        help="multi-LoRA: N adapter slots (1-4), each with its own slot root and cadence; one is retired and "
        "registered again mid-run; the resume restores every slot from its own root and compares each "
        "(see `miles_lora_ckpt_harness.demo.slots`; with --via miles: through the Miles stand-in)",
    )
    demo.add_argument(
        "--chain-slots",
        type=int,
        default=1,
        choices=(1, 2),
        help="single-LoRA demo with per-slot children under one LayerWise chain, as Miles' multi-LoRA "
        "builds them, saved together as one generation (default 1)",
    )
    demo.add_argument(
        "--lora-dropout",
        type=float,
        default=0.0,
        metavar="P",
        help="LoRA dropout on every adapter's input, drawn from torch's RNG and megatron's tensor-parallel RNG "
        "tracker: the resume is bit-exact only because every rank's RNG states are saved and restored "
        "(with --via miles: Miles' --lora-dropout; not with --slots or --export-peft) (default 0)",
    )
    demo.add_argument("--steps", type=int, default=8, help="training steps of the whole run (default 8)")
    demo.add_argument("--save-every", type=int, default=2, help="save after every K steps, before --steps (default 2)")
    demo.add_argument(
        "--phase", choices=("all", "reference", "train", "resume"), default="all", help="what to run (default all)"
    )
    demo.add_argument(
        "--crash-at",
        choices=SAVE_PHASES,
        default=None,
        help="protocol phase at which --crash-rank SIGKILLs itself during the last save "
        "(default with --phase all: mid-write)",
    )
    demo.add_argument("--crash-rank", type=int, default=None, help="rank that crashes (default: the last rank)")
    demo.add_argument(
        "--async-save",
        action="store_true",
        help="asynchronous saves (savers.single_lora.async_save; with --via miles: save.async = true): training "
        "goes on while each save is written; the crash hits the last save's background write, so the resume "
        "starts from the save before it (not with --slots or --export-peft: exit 2)",
    )
    demo.add_argument("--timeout", type=float, default=600.0, help="seconds before a phase's workers are killed")
    via_miles.add_arguments(demo)
    reshard.add_arguments(demo)
    demo.add_argument(
        "--export-peft",
        action="store_true",
        help="run the Qwen2-shaped model (TP=2 on an even world) with every save holding peft/, publish the "
        "resumed adapter into DIR/peft/ (an export root: DIR/peft/latest), write the HF base to DIR/hf-base/ "
        "and load both with the real PEFT. With --via miles: the launch gets export.peft = true (config file) and "
        "--save-hf DIR/miles/hf-out/{rollout_id}, and the relaunch's newest generation's peft/ and its last "
        "--save-hf adapter (<dir>/adapter/latest) are loaded with the real PEFT onto DIR/hf-base; "
        "--adapters dense or mixed; not with --without-plugin (exit 2: stock Miles' export is not imitated). "
        "With --via miles --slots N: every slot save exports the slot at the top of its generation (stock v1 "
        "names, --hf-checkpoint DIR/miles-slots/hf-base, export.peft = true) and each adapter's newest "
        "checkpoint (v1 step_N, v2 current) is loaded as is with the real PEFT",
    )
    demo.set_defaults(handler=run_demo)


# =========================================================================== parent side


def run_demo(args) -> int:
    if args.save_every < 1 or args.steps <= args.save_every:
        print("ERROR --steps must exceed --save-every (>= 1) so that at least one save happens", file=sys.stderr)
        return 2
    if not 0.0 <= args.lora_dropout < 1.0 or (args.lora_dropout and (args.slots is not None or args.export_peft)):
        print("ERROR --lora-dropout takes P in [0, 1), on the tiny model: drop --slots/--export-peft", file=sys.stderr)
        return 2
    if args.async_save and (args.slots is not None or args.export_peft):
        print(
            "ERROR --async-save covers single-LoRA saves without a PEFT export: drop --slots/--export-peft",
            file=sys.stderr,
        )
        return 2
    wheel = args.via == "miles" and args.miles_shape == via_miles.WHEEL_SHAPE
    if args.etp is not None and (args.slots is not None or args.export_peft or wheel):
        print(
            "ERROR --etp runs the harness demo's model (with --via miles: the stand-in shapes' model): "
            f"drop --slots/--export-peft/--miles-shape {via_miles.WHEEL_SHAPE}",
            file=sys.stderr,
        )
        return 2
    resharding = reshard.requested(args)
    if resharding and (problem := reshard.check_args(args)):
        print(f"ERROR {problem}", file=sys.stderr)
        return 2
    if args.via == "miles":
        return via_miles.run(args)
    if args.without_plugin:
        print("ERROR --without-plugin needs --via miles", file=sys.stderr)
        return 2
    if args.slots is not None:
        problem = slots.check_args(args)
        if problem:
            print(f"ERROR {problem}", file=sys.stderr)
            return 2
    elif args.chain_slots > 1 and (args.pp > 1 or args.vpp > 1):
        print(
            "ERROR --chain-slots 2 needs --pp 1 (the demo model has two layers, dealt to the slots)",
            file=sys.stderr,
        )
        return 2
    if args.export_peft and args.chain_slots > 1:
        print("ERROR --export-peft trains one adapter: drop --chain-slots", file=sys.stderr)
        return 2
    if (args.layer_wise or args.chain_slots > 1) and args.distributed_optimizer:
        print(
            "ERROR --layer-wise and --chain-slots shard whole parameters: drop --distributed-optimizer", file=sys.stderr
        )
        return 2
    # the workers turn this into a SimConfig (the parent never imports megatron)
    config = {
        "world_size": args.world_size,
        "tp": args.tp,
        "pp": args.pp,
        "ep": args.ep,
        "cp": args.cp,
        "vpp": args.vpp,
        "num_layers": layers_for(args.pp, args.vpp) if args.slots is None else max(2, args.slots),
        "dtype": args.dtype,
        "adapters": args.adapters,
        "optimizer": args.optimizer,
        "muon_scalar": args.muon_scalar,
        "distributed": args.distributed_optimizer,
        "layer_wise": args.layer_wise or args.slots == 1,
        "slots": args.chain_slots if args.slots is None else args.slots,
        "adapter_bias": args.optimizer == "muon",  # something for Muon's scalar optimizer to step
    }
    if args.slots is not None:
        config["distributed"] = False
    if args.etp is not None:
        config["etp"] = args.etp  # absent: megatron's default (the TP size)
    if args.lora_dropout:
        config["lora_dropout"] = args.lora_dropout  # absent: no dropout (the configs before it)
    try:
        check_layout(**_layout_of(config))
    except ValueError as exc:
        print(f"ERROR invalid layout: {exc}", file=sys.stderr)
        return 2
    if resharding:
        try:
            resume = reshard.resume_config(args, config)
            check_layout(**_layout_of(resume))
        except ValueError as exc:
            print(f"ERROR invalid resume layout: {exc}", file=sys.stderr)
            return 2
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    crash_at = args.crash_at or ("mid-write" if args.phase == "all" else None)
    crash_rank = args.world_size - 1 if args.crash_rank is None else args.crash_rank
    if not 0 <= crash_rank < args.world_size:
        print(f"ERROR --crash-rank must be in [0, {args.world_size})", file=sys.stderr)
        return 2
    optimizer = args.optimizer + (f" (scalar: {args.muon_scalar})" if args.optimizer == "muon" else "")
    optimizer += " layer-wise" if args.layer_wise else ""
    optimizer += f" {args.chain_slots} chained slots" if args.chain_slots > 1 else ""
    optimizer += f", multi-LoRA {args.slots} slot(s)" if args.slots is not None else ""
    print(
        f"demo: {args.world_size} ranks ({describe_layout(config)}), {args.dtype}, {args.adapters} adapters, "
        f"{optimizer}, {args.steps} steps, save every {args.save_every}, workdir {workdir}"
    )
    if args.export_peft:
        _peft_setup(workdir, config)
    if args.slots is not None:
        return slots.run(args, config, workdir)
    if resharding:
        return reshard.run(
            args, config, resume, workdir, lambda: _phase_train(workdir, config, args, crash_at, crash_rank)
        )
    status = 0
    try:
        if args.phase in ("all", "reference"):
            _phase_reference(workdir, config, args)
        if args.phase in ("all", "train"):
            _phase_train(workdir, config, args, crash_at, crash_rank)
        if args.phase in ("all", "resume"):
            status = _phase_resume(workdir, config, args)
        elif args.phase == "reference":
            print("RESULT: reference written")
        else:
            print("RESULT: trained")
        if args.export_peft and args.phase in ("all", "resume") and status == 0:
            status = _peft_report(workdir)
    except _NotBuildable as exc:
        print(f"ERROR cannot run this demo here: {exc}", file=sys.stderr)
        print(
            "megatron-core 0.19.2 with emerging-optimizers builds its own Lion and Muon: after `make test`, "
            'run `make demo-tier2 ARGS="<these flags>"`'
        )
        print(f"RESULT: not run ({exc})")
        return 2
    return status


def _layout_of(config: dict) -> dict:
    """The `check_layout` arguments of a demo config."""
    layout = {k: config[k] for k in ("world_size", "tp", "pp", "ep", "cp", "vpp", "num_layers")}
    return {**layout, "etp": config.get("etp")}


def _peft_setup(workdir: Path, config: dict) -> None:
    """--export-peft: the Qwen2-shaped model (its adapters map onto a real HF Qwen2), and its HF base.
    Where the real Megatron-Bridge is installed (`make demo-bridge`), the model is built by it from
    that HF base (`sim.bridge_model`: Bridge's provider and LoRA, fp32) and exported through it."""
    from miles_lora_ckpt_harness.sim.bridge_shims import available
    from miles_lora_ckpt_harness.sim.hf_base import build_tiny_qwen2

    if available():
        from miles_lora_ckpt_harness.sim.bridge_model import BridgeRunConfig, build_hf_base
        from miles_lora_ckpt_harness.sim.cpu_intercepts import install_typing_override

        install_typing_override()  # the Bridge tier's transformers 5.12.1 stack imports 3.12's typing.override
        hf_base = workdir / "hf-base"
        tp = 2 if config["world_size"] % 2 == 0 else 1
        config.update(model=BRIDGE_MODEL, tp=tp, pp=1, vpp=1, dtype="fp32", hf_base=str(hf_base))
        if not (hf_base / "config.json").is_file():
            build_hf_base(hf_base, BridgeRunConfig(family="qwen2"))
        print(
            f"demo: --export-peft: a tiny Qwen2 built by the real Megatron-Bridge from {hf_base} (Bridge's LoRA), "
            f"tp={config['tp']}, fp32, PEFT exports via the real Megatron-Bridge"
        )
        return

    config.update(model="qwen2", adapters="all", tp=2 if config["world_size"] % 2 == 0 else 1)
    config.pop("adapter_bias")  # the Qwen2-shaped model's adapters are PEFT's: no lora_B bias
    hf_base = workdir / "hf-base"
    if not (hf_base / "config.json").is_file():
        build_tiny_qwen2(hf_base, _qwen2_hf_kwargs())
    print(
        f"demo: --export-peft: Qwen2-shaped model, tp={config['tp']}, HF base {hf_base}, PEFT exports via the Bridge double"
    )


def _qwen2_hf_kwargs() -> dict:
    from miles_lora_ckpt_harness.sim.qwen2_model import Qwen2SimConfig

    return Qwen2SimConfig().hf_config_kwargs()  # the model's shapes do not depend on its topology


def _peft_report(workdir: Path) -> int:
    """Load DIR/peft/latest onto DIR/hf-base with the real PEFT; every checkpoint's peft/ verifies too."""
    from miles_lora_ckpt.tools.peft_tools import load_report
    from miles_lora_ckpt.tools.root_commands import verify_report

    report = load_report(workdir / "peft" / "latest", workdir / "hf-base")
    print(
        f"peft: {workdir / 'peft'} (latest -> {(workdir / 'peft' / 'latest').resolve().name}), HF base {workdir / 'hf-base'}"
    )
    verified = verify_report(str(workdir / "ckpt")) == 0 and verify_report(str(workdir / "peft")) == 0
    print(report.headline())
    return 0 if report.ok and verified else 1


def _job(name: str, config: dict, payload: dict, args) -> tuple[list, float]:
    from miles_lora_ckpt_harness.sim.launch import run_workers

    started = time.monotonic()
    results = run_workers(
        config["world_size"], f"miles_lora_ckpt_harness.demo.command:{name}", payload, timeout_s=args.timeout
    )
    for result in results:
        if result.ok and "not_buildable" in result.result:
            raise _NotBuildable(result.result["not_buildable"])
    return results, time.monotonic() - started


def _phase_reference(workdir: Path, config: dict, args) -> None:
    from miles_lora_ckpt_harness.sim.launch import check_all

    results, seconds = _job("reference_job", config, {"config": config, "steps": args.steps}, args)
    per_rank = check_all(results)
    reference = {
        "config": config,
        "steps": args.steps,
        "losses": per_rank[0]["losses"],
        "digests": {str(r): res["digests"] for r, res in enumerate(per_rank)},
    }
    (workdir / "reference.json").write_text(json.dumps(reference, indent=1))
    print(f"optimizer: {per_rank[0]['optimizer']}")
    print(f"reference: {args.steps} uninterrupted steps in {seconds:.1f}s -> {workdir / 'reference.json'}")


def _phase_train(workdir: Path, config: dict, args, crash_at: str | None, crash_rank: int) -> None:
    import shutil

    ckpt = workdir / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    payload = {
        "config": config,
        "steps": args.steps,
        "save_every": args.save_every,
        "root": str(ckpt),
        "crash_at": crash_at,
        "crash_rank": crash_rank,
        "async_save": args.async_save,
    }
    results, seconds = _job("train_job", config, payload, args)
    saves = [it for it in range(args.save_every, args.steps, args.save_every)]
    print(f"train: saves planned after steps {saves} into {ckpt} ({seconds:.1f}s)")
    report_train(results, crash_at)


def _phase_resume(workdir: Path, config: dict, args) -> int:
    from miles_lora_ckpt_harness.sim.launch import check_all

    reference = json.loads((workdir / "reference.json").read_text())
    if reference["config"] != config:
        print("ERROR reference.json was made with another configuration; rerun --phase reference", file=sys.stderr)
        return 2
    payload = {"config": config, "steps": reference["steps"], "root": str(workdir / "ckpt")}
    results, seconds = _job("resume_job", config, payload, args)
    per_rank = check_all(results)
    if "refused" in per_rank[0]:
        print(f"RESULT: ERROR {per_rank[0]['refused']}")
        return 1
    restored = per_rank[0]["restored"]
    print(f"resume: {restored['summary']} ({seconds:.1f}s)")
    start = restored["iteration"] or 0
    print(f"{'step':>4}  {'reference loss':>16}  {'resumed loss':>16}  same")
    for step, ref_loss in enumerate(reference["losses"]):
        got = per_rank[0]["losses"].get(str(step))
        same = "" if got is None else ("yes" if got == ref_loss else "NO")
        shown = "(restored)" if got is None else f"{got:.10f}"
        print(f"{step:>4}  {ref_loss:>16.10f}  {shown:>16}  {same}")
    mismatch = _first_mismatch(reference, per_rank, start)
    compared = sum(len(d) for d in reference["digests"].values())
    if mismatch is None:
        print(
            f"compared {compared} tensors on {len(per_rank)} ranks (adapter, fp32 masters, every moment, "
            "steps, scheduler) and every resumed loss"
        )
        print("RESULT: bit-exact")
        return 0
    print(f"RESULT: MISMATCH {mismatch}")
    return 1


def _first_mismatch(reference: dict, per_rank: list[dict], start: int) -> str | None:
    for step in range(start, reference["steps"]):
        if per_rank[0]["losses"].get(str(step)) != reference["losses"][step]:
            return f"loss@step{step}"
    for rank, result in enumerate(per_rank):
        expected = reference["digests"][str(rank)]
        for name in sorted(set(expected) | set(result["digests"])):
            if expected.get(name) != result["digests"].get(name):
                return f"rank{rank}:{name}"
    return None


# =========================================================================== worker side


def _build(payload: dict):
    """The run, or `{"not_buildable": reason}` where megatron itself cannot build the optimizer.
    `model: bridge-qwen2` (--export-peft in the Bridge tier): the run is built by the real
    Megatron-Bridge from DIR/hf-base (`sim.bridge_model`)."""
    from miles_lora_ckpt_harness.sim.optimizers import NotBuildable, why_not_buildable
    from miles_lora_ckpt_harness.sim.train import build_run, config_from_dict

    if payload["config"].get("model") == BRIDGE_MODEL:
        from miles_lora_ckpt_harness.sim import bridge_model

        conf = payload["config"]
        bridge_config = bridge_model.BridgeRunConfig(
            family="qwen2", world_size=conf["world_size"], tp=conf["tp"], pp=conf["pp"]
        )
        return bridge_model.build_bridge_run(bridge_config, conf["hf_base"]), None
    config = config_from_dict(payload["config"])
    reason = why_not_buildable(config, harness_lion=False)  # the demo shows megatron's own optimizers
    try:
        if reason:
            raise NotBuildable(reason)
        return build_run(config), None
    except NotBuildable as exc:
        return None, {"not_buildable": str(exc)}


def _describe_optimizer(run) -> str:
    from importlib.metadata import version

    from miles_lora_ckpt.megatron.optimizer_children import leaf_children

    names = []
    for child in leaf_children(run.optimizer):
        if not child.is_stub:
            inner = type(child.optimizer.optimizer)
            where = " under LayerWiseDistributedOptimizer" if child.layer_wise else ""
            names.append(f"{child.class_name}({inner.__module__}.{inner.__name__}){where}")
    return f"megatron-core {version('megatron-core')} built " + ", ".join(names)


def _train_step(run, step: int) -> float:
    """One training step of the harness's run, or of the real-Bridge run (`sim.bridge_model`)."""
    from miles_lora_ckpt_harness.sim.train import train_step

    if type(run).__name__ == "BridgeRun":
        from miles_lora_ckpt_harness.sim.bridge_model import bridge_train_step

        return bridge_train_step(run, step)
    return train_step(run, step)


def reference_job(payload: dict, ctx) -> dict:
    from miles_lora_ckpt_harness.sim.snapshot import snapshot, snapshot_digests

    run, unbuildable = _build(payload)
    if unbuildable:
        return unbuildable
    losses = [_train_step(run, step) for step in range(payload["steps"])]
    return {"losses": losses, "digests": snapshot_digests(snapshot(run)), "optimizer": _describe_optimizer(run)}


def train_job(payload: dict, ctx) -> dict:
    """Train, saving every `save_every` steps (with `--crash-at`, the last save SIGKILLs one rank)."""
    from miles_lora_ckpt.core import faults

    run, unbuildable = _build(payload)
    if unbuildable:
        return unbuildable
    save, summary = _async_saves(run, payload) if payload.get("async_save") else _sync_saves(run, payload)
    saves = list(range(payload["save_every"], payload["steps"], payload["save_every"]))
    for step in range(payload["steps"]):
        _train_step(run, step)
        iteration = step + 1
        if iteration not in saves:
            continue
        if iteration == saves[-1] and payload["crash_at"] and ctx.rank == payload["crash_rank"]:
            faults.arm(payload["crash_at"], ctx.rank, "kill")
        save(iteration)
    return {"summary": summary()}


def _sync_saves(run, payload: dict):
    """`save(iteration)` commits a generation before it returns; `summary()` names them."""
    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.savers.single_lora import save_lora_checkpoint

    consensus = Consensus.for_world(timeout_s=60)
    written = []

    def save(iteration: int) -> None:
        path = save_lora_checkpoint(
            run.model,
            _DemoArgs(run.config),
            payload["root"],
            optimizer=run.optimizer,
            opt_param_scheduler=run.scheduler,
            iteration=iteration,
            consensus=consensus,
            peft=_peft_export(run, payload),
        )
        written.append(Path(path).name)

    return save, lambda: f"saved {', '.join(written)}"


def _async_saves(run, payload: dict):
    """`--async-save`: `save(iteration)` returns once the state is copied and training goes on while
    it is written; each save waits for the previous one, and `summary()` for the last one."""
    from miles_lora_ckpt.savers.single_lora.async_save import AsyncSaver

    saver = AsyncSaver(timeout_s=60)
    pending = []

    def save(iteration: int) -> None:
        pending.append(
            saver.save(
                run.model,
                _DemoArgs(run.config),
                payload["root"],
                optimizer=run.optimizer,
                opt_param_scheduler=run.scheduler,
                iteration=iteration,
            )
        )

    def summary() -> str:
        written = [Path(p.wait()).name for p in pending]
        blocked = max(p.blocked_s for p in pending)
        return f"saved {', '.join(written)} asynchronously (blocked {blocked:.3f}s at most per save)"

    return save, summary


def resume_job(payload: dict, ctx) -> dict:
    from miles_lora_ckpt_harness.sim.snapshot import snapshot, snapshot_digests

    run, unbuildable = _build(payload)
    if unbuildable:
        return unbuildable
    result, consensus, refused = load_newest(run, payload["root"], timeout_s=60)
    if refused is not None:  # the same refusal on every rank: reported as one line
        return {"refused": refused}
    start = result.iteration or 0
    losses = {str(step): _train_step(run, step) for step in range(start, payload["steps"])}
    if result.loaded:
        what = ["adapter"] + (["fp32 masters + moments"] if result.optimizer_restored else [])
        what += ["scheduler"] if result.scheduler_restored else []
        summary = f"restored {', '.join(what)} from {Path(result.path).name} (iteration {result.iteration})"
    else:
        summary = "no committed generation: starting from step 0"
    restored = {"iteration": result.iteration, "summary": summary}
    digests = snapshot_digests(snapshot(run))
    _publish_peft(run, payload, consensus)
    return {"losses": losses, "digests": digests, "restored": restored}


class _DemoArgs:
    """The few Miles args the saver reads."""

    def __init__(self, config=None):
        self.lora_rank = getattr(config, "lora_rank", 4)
        self.lora_alpha = getattr(config, "lora_alpha", 4.0)


def _peft_export(run, payload: dict):
    """--export-peft: every save exports peft/. The Qwen2-shaped harness model exports through the
    Bridge double; the real-Bridge run (`make demo-bridge`) through its own real AutoBridge."""
    from miles_lora_ckpt.savers.peft_export import BridgeSource, LoraSpec, PeftExport
    from miles_lora_ckpt_harness import bridge_double

    config = run.config
    hf_base = Path(payload["root"]).parent / "hf-base"
    if type(run).__name__ == "BridgeRun":
        lora = LoraSpec(r=config.lora_rank, alpha=config.lora_alpha, base_model_name_or_path=str(hf_base))
        return PeftExport(source=BridgeSource(run.bridge), lora=lora)
    if getattr(config, "model", None) != "qwen2":
        return None
    bridge_double.install()
    lora = LoraSpec(r=config.lora_rank, alpha=config.lora_alpha, base_model_name_or_path=str(hf_base))
    return PeftExport(source=BridgeSource(hf_checkpoint=str(hf_base)), lora=lora)


def _publish_peft(run, payload: dict, consensus) -> None:
    """--export-peft: the resumed run publishes its adapter into the export root DIR/peft."""
    from miles_lora_ckpt.savers.peft_export import export_peft

    spec = _peft_export(run, payload)
    if spec is not None:
        root = Path(payload["root"]).parent / "peft"
        export_peft(
            run.model, root, source=spec.source, lora=spec.lora, iteration=payload["steps"], consensus=consensus
        )
