"""`miles-lora-ckpt demo --via miles`: a Miles launch command with the plugin, SIGKILLed, relaunched unchanged.

The Miles stand-in (`miles_standin`, one module tree per supported Miles shape) runs its train
loop (Miles' train.py: argument validation, train actor init with the custom init hook, model and
optimizer setup, checkpoint load, rollouts, periodic saves) on the real megatron-core optimizers.
Every launch is N fresh processes forked from a pre-warmed launcher that has imported torch and
megatron only, so Miles and the plugin start from nothing each time.

    reference  the same training, uninterrupted, without checkpoints -> DIR/miles/reference.json
    train      launch 1: rank --crash-rank SIGKILLs itself at --crash-at while saving the last
               rollout before the end; the other ranks stop (every rank raises the same error)
    resume     launch 2: the identical command; it must resume at the rollout after the newest
               committed generation and end bit for bit where the reference ended
    all        all three (default)

With --steps N rollouts of 2 optimizer steps each and --save-every K (Miles' --save-interval).
--without-plugin runs the same scenario on stock Miles: no init hook; the relaunch adds
--lora-adapter-path <newest iter_*/adapter>, the edit a stock user must make by hand.

--export-peft: --hf-checkpoint is a tiny HF Qwen2 (DIR/hf-base, built from a config, no hub). The
stand-in then trains the Qwen2-shaped harness model, at TP=2 where the world allows it unless --tp
is given, with the harness's Bridge double in every rank. --adapters dense adapts q/k/v/o, mixed
all linears. The config sets `export.peft = true`, so every committed generation holds peft/. The
command adds `--save-hf DIR/miles/hf-out/{rollout_id}`, whose adapter/latest is an HF PEFT adapter.
After the relaunch, the real PEFT loads the newest generation's peft/ and the last --save-hf
adapter onto DIR/hf-base (`PEFT: loadable (0 missing, 0 unexpected)`, `--save-hf PEFT: loadable
(...)`). A PEFT adapter that does not load ends `RESULT: MISMATCH`. --export-peft --without-plugin
is a usage error (exit 2): the stand-in does not imitate stock Miles' export, a pickled
adapter_model.bin that PEFT cannot load.

--miles-shape miles-rl-0.0.2: the real Miles wheel's modules instead of a stand-in tree (its
`lora_utils`, `checkpoint`, `model`; `realmiles/launch.py`), from the real-Miles tier folder that
`make test` installs (`MILES_LORA_CKPT_REAL_MILES`, set by `make demo-miles`); exit 2 without it.
Stock 0.0.2 has no fault points: with --without-plugin the stock launch is killed after rollout
(crash rollout + 1) trained, before its save, so the stock save of the crash rollout is complete.

Every launch's rollout manager (rank 0, `miles_standin/common/rollout.py`) runs a data source in
Miles' order over DIR/miles/prompts.jsonl. It over-samples with partial rollouts, so aborted groups
go back to the buffer. With the plugin, `--data-source-path
miles_lora_ckpt.hooks.CheckpointedDataSource` wraps the stand-in shapes' `PromptSource`, or the
wheel's `RolloutDataSourceWithBuffer` with --miles-shape miles-rl-0.0.2. After the relaunch the
demo prints the prompt indices each rollout drew, reference and resumed, and a `PROMPTS:` line. A
rollout that drew other prompts is a MISMATCH.

The output ends with `ROLLOUT: resumed at <id>` and `RESULT: bit-exact` (exit 0) or
`RESULT: MISMATCH <what>` (exit 1). With --slots N the Miles multi-LoRA demo runs instead
(`miles_lora_ckpt_harness.demo.via_miles_slots`).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from miles_lora_ckpt_harness.demo import via_miles_reshard
from miles_lora_ckpt_harness.demo.via_miles_config import (
    CONFIG_TEXT,
    DATA_SOURCE_HOOK,
    DATA_STATE_CONFIG_TEXT,
    INIT_HOOK,
    PEFT_CONFIG_TEXT,
    STOCK_PHASES,
)
from miles_lora_ckpt_harness.demo.via_miles_launch import (
    WHEEL_SHAPE,
    first_launch,
    last_line,
    launch,
    newest_rollout,
    newest_stock_adapter,
)
from miles_lora_ckpt_harness.miles_standin.common.rollout import (
    PROMPT_SOURCE,
    ROLLOUT_FN,
    build_tokenizer,
    write_prompts,
)
from miles_lora_ckpt_harness.sim.layout import check_layout, layers_for

TARGETS = {
    "dense": "linear_qkv,linear_proj",
    "expert-only": "linear_fc1,linear_fc2",
    "mixed": "linear_qkv,linear_proj,linear_fc1,linear_fc2",
}
QWEN2_TARGETS = {"dense": "q_proj,k_proj,v_proj,o_proj", "mixed": "all-linear"}  # Miles' HF spellings
MILES_DATA_SOURCE = "miles.rollout.data_source.RolloutDataSourceWithBuffer"  # Miles' default --data-source-path
DEMO_PROMPTS, DEMO_OVER_SAMPLING = 18, 6  # 4 groups a rollout (--rollout-batch-size), 2 aborted into the buffer


def add_arguments(demo) -> None:
    """The `--via miles` flags of `miles-lora-ckpt demo`."""
    from miles_lora_ckpt_harness.miles_standin import DEFAULT_SHAPE, SHAPES

    demo.add_argument(
        "--via",
        choices=("harness", "miles"),
        default="harness",
        help="harness: the checkpoint API on the CPU harness (default); miles: a Miles launch command with the "
        "plugin's init hook, through the Miles stand-in (--steps counts rollouts)",
    )
    demo.add_argument(
        "--miles-shape",
        choices=(*SHAPES, WHEEL_SHAPE),
        default=DEFAULT_SHAPE,
        help=f"with --via miles: which Miles version the stand-in imitates (default {DEFAULT_SHAPE}), or "
        f"{WHEEL_SHAPE}: the real miles-rl wheel's modules (after `make test`; `make demo-miles`); with --slots: "
        "lora-utils-2026-08 is multi-LoRA v1 (multi_lora_utils), lora-package-2026-09 v2 (lora/checkpoint.py)",
    )
    demo.add_argument(
        "--without-plugin",
        action="store_true",
        help="with --via miles: the same scenario on stock Miles (no init hook): the negative control "
        "(not with --export-peft: exit 2)",
    )


# =========================================================================== the scenario


class Scenario:
    """Paths, the launch command and the crash of one `--via miles` demo."""

    def __init__(self, args):
        self.args = args
        self.world = args.world_size
        self.dir = Path(args.workdir).resolve() / "miles"
        self.peft = bool(getattr(args, "export_peft", False))
        # --export-peft: the tiny HF Qwen2 of the harness demo's --export-peft, at DIR/hf-base
        self.hf = self.dir.parent / "hf-base" if self.peft else self.dir / "hf-base"
        self.hf_out = self.dir / "hf-out"
        # --export-peft exercises Bridge's TP gather: TP=2 unless --tp is given or the world has no room for it
        room = args.world_size % (2 * args.pp * args.cp) == 0
        self.tp = 2 if self.peft and args.tp == 1 and room else args.tp
        self.ep, self.pp, self.vpp = args.ep, args.pp, args.vpp
        self.num_layers = None  # Megatron-LM's --num-layers: set when a resharding demo changes PP or VPP
        # Megatron-LM's --expert-tensor-parallel-size (None: the TP size) and --num-experts (None: the
        # stand-in's one expert per EP rank; a resharding demo across EP numbers them globally)
        self.etp = getattr(args, "etp", None)
        self.num_experts = None
        self.save = self.dir / "run"
        self.config = self.dir / "miles-lora-ckpt.toml"
        self.plugin = not args.without_plugin
        self.saves = [r for r in range(args.steps) if (r + 1) % args.save_every == 0 or r == args.steps - 1]
        self.crash_rollout = max(r for r in self.saves if r < args.steps - 1)
        self.crash_rank = self.world - 1 if args.crash_rank is None else args.crash_rank
        self.wheel = args.miles_shape == WHEEL_SHAPE
        self.prompts = self.dir / "prompts.jsonl"
        # the data source the rollout manager runs without the plugin (and the plugin's wraps): Miles'
        # own class on the wheel, the stand-in shapes' PromptSource elsewhere (common/rollout.py)
        self.data_source = MILES_DATA_SOURCE if self.wheel else PROMPT_SOURCE

    def training_flags(self) -> list[str]:
        """Everything that defines the training itself (shared by the reference)."""
        return [
            "--megatron-to-hf-mode",
            "bridge",
            "--hf-checkpoint",
            str(self.hf),
            "--num-rollout",
            str(self.args.steps),
            "--lora-rank",
            "4",
            "--lora-alpha",
            "4",
            *(["--lora-dropout", str(self.args.lora_dropout)] if getattr(self.args, "lora_dropout", 0.0) else []),
            "--target-modules",
            QWEN2_TARGETS[self.args.adapters] if self.peft else TARGETS[self.args.adapters],
            "--optimizer",
            self.args.optimizer,
            *(["--bf16"] if self.args.dtype == "bf16" else []),
            *self.layout_flags(),
        ]

    def layout_flags(self) -> list[str]:
        """The demo's --tp/--pp/--ep/--cp/--vpp as Megatron's parallel-size flags (only those not 1),
        --etp as `--expert-tensor-parallel-size` (only where it is not the TP size), and the expert
        and layer counts as `--num-experts` and `--num-layers` (only where one is set)."""
        sizes = {
            "--tensor-model-parallel-size": self.tp,
            "--pipeline-model-parallel-size": self.pp,
            "--expert-model-parallel-size": self.ep,
            "--context-parallel-size": self.args.cp,
            "--virtual-pipeline-model-parallel-size": self.vpp,
        }
        flags = [part for flag, size in sizes.items() if size != 1 for part in (flag, str(size))]
        if self.etp not in (None, self.tp):
            flags += ["--expert-tensor-parallel-size", str(self.etp)]
        if self.num_experts:
            flags += ["--num-experts", str(self.num_experts)]
        if self.num_layers:
            flags += ["--num-layers", str(self.num_layers)]
        return flags

    def rollout_flags(self, plugin: bool) -> list[str]:
        """The rollout manager's flags: the prompt file, over-sampling with partial rollouts (aborted groups
        go back to the buffer), the rollout function, and the data source (the plugin's, or the one it wraps)."""
        return [
            "--prompt-data",
            str(self.prompts),
            "--input-key",
            "text",
            "--label-key",
            "label",
            "--over-sampling-batch-size",
            str(DEMO_OVER_SAMPLING),
            "--partial-rollout",
            "--rollout-function-path",
            ROLLOUT_FN,
            "--data-source-path",
            DATA_SOURCE_HOOK if plugin else self.data_source,
        ]

    def command(self) -> list[str]:
        """The user's launch command (its flags), identical for every launch."""
        hook = ["--custom-megatron-init-path", INIT_HOOK] if self.plugin else []
        checkpoints = ["--load", str(self.save), "--save", str(self.save), "--save-interval", str(self.args.save_every)]
        if self.peft:
            checkpoints += ["--save-hf", str(self.hf_out / "{rollout_id}")]
        return hook + self.rollout_flags(self.plugin) + self.training_flags() + checkpoints

    def env(self) -> dict[str, str]:
        if not self.plugin:
            return {}
        # --async-save: the config key save.async through its environment variable
        return {"MILES_LORA_CKPT_CONFIG": str(self.config)} | (
            {"MILES_LORA_CKPT_ASYNC_SAVE": "1"} if getattr(self.args, "async_save", False) else {}
        )

    def shell(self, argv: list[str]) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env().items())
        return (env + " " if env else "") + "python train.py " + " ".join(shlex.quote(a) for a in argv)


def run(args, launcher=None) -> int:
    """The `--via miles` demo; returns the exit code."""
    if getattr(args, "slots", None) is not None and args.miles_shape == WHEEL_SHAPE:
        print(
            f"ERROR --slots with --miles-shape {WHEEL_SHAPE}: the miles-rl 0.0.2 wheel has no multi-LoRA",
            file=sys.stderr,
        )
        return 2
    if getattr(args, "slots", None) is not None:  # multi-LoRA: via_miles_slots.py
        from miles_lora_ckpt_harness.demo import via_miles_slots

        return via_miles_slots.run(args, launcher)
    harness_only = _harness_only_flags(args)
    if harness_only:
        print(
            f"ERROR {', '.join(harness_only)}: the Miles stand-in builds what Miles builds for adam and lion "
            "(megatron's default children); run these optimizer layouts without --via miles",
            file=sys.stderr,
        )
        return 2
    if not args.without_plugin and args.crash_at is None and args.phase in ("all", "train"):
        args.crash_at = "mid-write"
    if args.without_plugin and args.phase in ("all", "train"):
        args.crash_at = args.crash_at or "mid-write"
        if args.crash_at not in STOCK_PHASES:
            print(f"ERROR stock Miles' save has only {', '.join(STOCK_PHASES)} to crash at", file=sys.stderr)
            return 2
    problem = _peft_usage_problem(args) or _wheel_problem(args)
    if problem:
        print(f"ERROR {problem}", file=sys.stderr)
        return 2
    scenario = Scenario(args)
    try:
        layers = 2 if scenario.peft else layers_for(args.pp, args.vpp)  # the Qwen2-shaped model has 2 layers
        check_layout(args.world_size, scenario.tp, args.pp, args.ep, args.cp, args.vpp, layers, etp=scenario.etp)
    except ValueError as exc:
        print(f"ERROR invalid layout: {exc}", file=sys.stderr)
        return 2
    if not 0 <= scenario.crash_rank < scenario.world:
        print(f"ERROR --crash-rank must be in [0, {scenario.world})", file=sys.stderr)
        return 2
    resume = None
    if via_miles_reshard.requested(args):  # --resume-*: launch 2 runs at another layout
        try:
            resume = via_miles_reshard.resume_scenario(scenario)
        except ValueError as exc:
            print(f"ERROR invalid resume layout: {exc}", file=sys.stderr)
            return 2
    scenario.dir.mkdir(parents=True, exist_ok=True)
    if scenario.peft:
        _qwen2_base(scenario.hf)
    else:
        scenario.hf.mkdir(exist_ok=True)
        # the wheel's base load asks Bridge (the harness's double) for the architecture; any non-Qwen2
        # config gives the tiny harness model
        base = '{"architectures": ["LlamaForCausalLM"]}\n' if scenario.wheel else "{}\n"
        (scenario.hf / "config.json").write_text(base)
    if scenario.wheel:  # the wheel's Dataset loads the tokenizer from --hf-checkpoint
        build_tokenizer(scenario.hf, DEMO_PROMPTS)
    write_prompts(scenario.prompts, DEMO_PROMPTS)
    data_state = DATA_STATE_CONFIG_TEXT.format(source=scenario.data_source)
    scenario.config.write_text(CONFIG_TEXT + data_state + (PEFT_CONFIG_TEXT if scenario.peft else ""))
    from miles_lora_ckpt_harness.sim.prewarmed import PrewarmedLauncher

    own = launcher is None
    launcher = launcher or PrewarmedLauncher()
    try:
        if resume is not None:
            return via_miles_reshard.run_phases(scenario, resume, launcher)
        return _run_phases(scenario, launcher)
    finally:
        if own:
            launcher.close()


def _wheel_problem(args) -> str | None:
    """--miles-shape miles-rl-0.0.2 needs the real-Miles tier; the wheel has no Bridge export here."""
    if args.miles_shape != WHEEL_SHAPE:
        return None
    from miles_lora_ckpt_harness.realmiles import standins

    if standins.tier_folder() is None:
        return (
            f"--miles-shape {WHEEL_SHAPE} runs the real Miles wheel: install it with `make test` (or "
            f"`make .tier-miles/miles-rl-0.0.2/.installed`) and run `make demo-miles`, or set {standins.ENV}"
        )
    if getattr(args, "export_peft", False):
        return f"--export-peft with --miles-shape {WHEEL_SHAPE}: the wheel runs without Megatron-Bridge's export here"
    return None


def _peft_usage_problem(args) -> str | None:
    if not getattr(args, "export_peft", False):
        return None
    if args.without_plugin:
        return (
            "--export-peft --without-plugin: stock Miles' PEFT export writes a pickled adapter_model.bin under "
            "names PEFT cannot load and swallows its errors; the stand-in does not imitate it (nothing here "
            "writes pickle). For the stock negative control run --without-plugin without --export-peft"
        )
    if (args.ep, args.cp, args.vpp) != (1, 1, 1) or args.pp not in (1, 2):
        return "--export-peft runs the Qwen2-shaped model (2 layers, no experts): no --ep, --cp or --vpp; --pp 1 or 2"
    if args.adapters not in QWEN2_TARGETS:
        return f"--export-peft: the Qwen2-shaped model has no experts: --adapters {' or '.join(QWEN2_TARGETS)}"
    return None


def _qwen2_base(path: Path) -> None:
    """The tiny HF Qwen2 the stand-in's Qwen2-shaped model maps onto (built once, shared with `demo --export-peft`)."""
    from miles_lora_ckpt_harness.sim.hf_base import build_tiny_qwen2
    from miles_lora_ckpt_harness.sim.qwen2_model import Qwen2SimConfig

    config = path / "config.json"
    if not (config.is_file() and "Qwen2ForCausalLM" in config.read_text()):
        build_tiny_qwen2(path, Qwen2SimConfig().hf_config_kwargs())


def _harness_only_flags(args) -> list[str]:
    """The optimizer flags of the harness demo that the Miles stand-in does not take."""
    flags = ["--optimizer muon"] if args.optimizer == "muon" else []
    flags += ["--muon-scalar"] if getattr(args, "muon_scalar", "adam") != "adam" else []
    flags += ["--[no-]distributed-optimizer"] if getattr(args, "distributed_optimizer", None) is not None else []
    flags += ["--layer-wise"] if getattr(args, "layer_wise", False) else []
    flags += ["--chain-slots"] if getattr(args, "chain_slots", 1) != 1 else []
    return flags


def _run_phases(scenario: Scenario, launcher) -> int:
    args = scenario.args
    mode = "with miles-lora-ckpt" if scenario.plugin else "WITHOUT the plugin (stock Miles)"
    print(
        f"demo via Miles ({args.miles_shape} {'real wheel' if scenario.wheel else 'stand-in'}) {mode}: "
        f"{scenario.world} ranks, {args.dtype}, "
        f"{args.adapters} adapters, {args.optimizer}, {args.steps} rollouts x 2 steps, --save-interval "
        f"{args.save_every}, workdir {scenario.dir}"
    )
    if scenario.peft:
        print(
            f"--export-peft: Qwen2-shaped model (tp={scenario.tp}) from the HF base {scenario.hf}; export.peft = true "
            "(peft/ in every generation) and --save-hf; Megatron-Bridge is the harness's double"
        )
    print("each launch: fresh processes forked from a launcher that has imported torch and megatron only")
    print("launch command (every launch, every rank):")
    print("  " + scenario.shell(scenario.command()))
    if args.phase in ("all", "reference"):
        _reference(scenario, launcher)
    if args.phase in ("all", "train"):
        first_launch(scenario, launcher)
    if args.phase in ("all", "resume"):
        return _relaunch(scenario, launcher)
    print("RESULT: reference written" if args.phase == "reference" else "RESULT: trained")
    return 0


def _reference(scenario: Scenario, launcher) -> None:
    argv = scenario.training_flags()
    results, seconds = launch(scenario, launcher, argv + scenario.rollout_flags(plugin=False), env={})
    failed = [r for r in results if not r.ok or r.result["failed"]]
    if failed:
        raise SystemExit("reference run failed:\n" + "\n".join(r.error or r.result["failed"] for r in failed))
    reference = {
        "training": argv,
        "world_size": scenario.world,
        "losses": results[0].result["losses"],
        "digests": {str(r.rank): r.result["final"] for r in results},
        "prompts": results[0].result.get("prompts", {}),
    }
    (scenario.dir / "reference.json").write_text(json.dumps(reference, indent=1))
    print(f"reference: {scenario.args.steps} rollouts uninterrupted, no checkpoints ({seconds:.1f}s)")


def _relaunch(scenario: Scenario, launcher) -> int:
    reference_file = scenario.dir / "reference.json"
    reference = json.loads(reference_file.read_text()) if reference_file.exists() else None
    if (
        reference is None
        or reference["training"] != scenario.training_flags()
        or reference["world_size"] != scenario.world
    ):
        print("ERROR reference.json is missing or was made with other flags; rerun --phase reference", file=sys.stderr)
        return 2
    newest = newest_rollout(scenario)
    argv = scenario.command()
    if not scenario.plugin:
        adapter = newest_stock_adapter(scenario)
        if adapter is not None:
            argv = [*argv, "--lora-adapter-path", adapter]
            print(
                "stock Miles cannot find its LoRA checkpoint with the same command; relaunching with "
                f"--lora-adapter-path {adapter} added, as a stock user must"
            )
    results, seconds = launch(scenario, launcher, argv)
    same = "the identical command" if argv == scenario.command() else "the command plus --lora-adapter-path"
    print(f"launch 2: {same} ({seconds:.1f}s)")
    failed = [r for r in results if not r.ok or r.result["failed"]]
    if failed:
        first = failed[0]
        print(
            f"RESULT: MISMATCH relaunch failed on rank {first.rank}: {last_line(first.error or first.result['failed'])}"
        )
        return 1
    report = results[0].result
    start = report["start_rollout_id"]
    print(f"ROLLOUT: resumed at {start}")
    plugin = report.get("plugin")
    if plugin:
        print(f"  plugin bound to Miles shape {plugin['shape']}: {len(plugin['bindings'])} names rebound")
    print(f"  after init: scheduler at {report['after_init']['scheduler_num_steps']} samples")
    _print_losses(reference, report)
    prompts_differ = _print_prompts(reference, report, start)
    mismatch = _first_mismatch(reference, results, start, newest) or prompts_differ
    if mismatch is None:
        compared = sum(len(d) for d in reference["digests"].values())
        print(
            f"compared {compared} tensors on {scenario.world} ranks (adapter, fp32 masters, every moment, steps, "
            "scheduler), every resumed loss and the rollout counter"
        )
        if scenario.peft:
            mismatch = _peft_report(scenario)
    if mismatch is None:
        print("RESULT: bit-exact")
        return 0
    print(f"RESULT: MISMATCH {mismatch}")
    return 1


def _peft_report(scenario: Scenario) -> str | None:
    """--export-peft: the relaunch's newest generation's peft/ and its last --save-hf adapter, loaded
    with the real PEFT onto the HF base; both roots verified. Returns what failed, or None."""
    from miles_lora_ckpt.core.verify import committed_candidates
    from miles_lora_ckpt.tools.peft_tools import load_report
    from miles_lora_ckpt.tools.root_commands import verify_report

    root = scenario.save / "lora"
    newest = committed_candidates(root)[0][:1]
    if not newest or not (newest[0] / "peft").is_dir():
        return f"the newest generation in {root} holds no peft/ (export.peft = true)"
    complete = [p for p in scenario.hf_out.glob("*") if p.name.isdigit() and (p / ".complete").exists()]
    if not complete:
        return f"no --save-hf export completed under {scenario.hf_out}"
    save_hf = max(complete, key=lambda p: int(p.name)) / "adapter"
    verified = verify_report(str(root)) == 0 and verify_report(str(save_hf)) == 0
    print(f"peft: {newest[0] / 'peft'} (the newest generation), HF base {scenario.hf}")
    report = load_report(newest[0] / "peft", scenario.hf)
    print(report.headline())
    print(f"--save-hf: {save_hf / 'latest'} -> {(save_hf / 'latest').resolve().name}")
    hf_report = load_report(save_hf / "latest", scenario.hf)
    print(f"--save-hf {hf_report.headline()}")
    if not (report.ok and hf_report.ok):
        return f"PEFT adapter not loadable: {report.headline() if not report.ok else hf_report.headline()}"
    return None if verified else "verify failed (see above)"


def _first_mismatch(reference: dict, results, start: int, newest: int | None) -> str | None:
    expected = 0 if newest is None else newest + 1
    if start != expected:
        saved = "nothing committed" if newest is None else f"the newest checkpoint is rollout {newest}"
        return f"rollout counter resumed at {start}, {saved}: expected {expected}"
    losses = results[0].result["losses"]
    for step, loss in sorted(losses.items(), key=lambda item: int(item[0])):
        if reference["losses"].get(step) != loss:
            return f"loss@step{step}"
    for result in results:
        ref = reference["digests"][str(result.rank)]
        got = result.result["final"]
        for name in sorted(set(ref) | set(got)):
            if ref.get(name) != got.get(name):
                return f"rank{result.rank}:{name}"
    return None


def _print_prompts(reference: dict, report: dict, start: int) -> str | None:
    """The prompt indices each rollout drew, reference and resumed, and the comparison line;
    returns the first rollout whose prompts differ (None: all the same)."""
    print("prompts each rollout drew from the data source (prompt indices; rollouts before the resume: launch 1)")
    print(f"{'rollout':>7}  {'reference':<28}  {'resumed':<28}  same")
    differ = []
    for rollout, ref in sorted(reference.get("prompts", {}).items(), key=lambda item: int(item[0])):
        got = report.get("prompts", {}).get(rollout)
        same = "" if got is None else ("yes" if got == ref else "NO")
        if got is not None and got != ref:
            differ.append(int(rollout))
        print(f"{int(rollout):>7}  {_indices(ref):<28}  {'(launch 1)' if got is None else _indices(got):<28}  {same}")
    resumed = sorted(int(r) for r in report.get("prompts", {}))
    if differ:
        print(f"PROMPTS: rollout {differ[0]} drew other prompts than the reference")
        return f"prompts@rollout{differ[0]}"
    how = f"the data state of rollout {start - 1} restored from its generation" if start else "the run started over"
    first, last = (resumed[0], resumed[-1]) if resumed else (start, start)
    print(f"PROMPTS: rollouts {first}..{last} drew the same prompts as the reference ({how})")
    return None


def _indices(indices: list[int]) -> str:
    """Prompt indices, runs of consecutive ones as `a-b`."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _print_losses(reference: dict, report: dict) -> None:
    print(f"{'step':>4}  {'reference loss':>16}  {'resumed loss':>16}  same")
    for step, ref_loss in sorted(reference["losses"].items(), key=lambda item: int(item[0])):
        got = report["losses"].get(step)
        same = "" if got is None else ("yes" if got == ref_loss else "NO")
        shown = "(restored)" if got is None else f"{got:.10f}"
        print(f"{int(step):>4}  {ref_loss:>16.10f}  {shown:>16}  {same}")
