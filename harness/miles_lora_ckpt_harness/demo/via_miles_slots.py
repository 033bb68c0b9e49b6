"""`miles-lora-ckpt demo --via miles --slots N`: a Miles multi-LoRA launch, SIGKILLed mid-save, relaunched unchanged.

The Miles stand-in's multi-LoRA loop (`miles_standin/common/multi_lora.py`: Miles'
`train_multi_lora_async.py` with v1's `multi_lora_utils` or v2's `lora/checkpoint.py`, per
`--miles-shape`) trains N adapters `s0..s{N-1}` in the N slots of one slot model, on Miles'
per-slot LayerWise chain of real megatron-core children. Adapter k trains one step every k+1
rounds (different cadences), `--steps` steps in all; adapter s1 is retired at its step 2 and
registered again (resuming from its retire save) once s0 has reached step 4. `--save-every` is
Miles' `--save-interval` (in adapter steps). Each adapter's slot root is
`DIR/miles-slots/run/adapters/<name>/checkpoints` (v1; `step_N` links) or `.../adapters/<name>`
(v2; the `current` link).

    reference  the same launch, uninterrupted                  -> every slot's final state
    train      rank --crash-rank SIGKILLs itself at --crash-at (default mid-write) in s0's last
               periodic save before its end
    resume     the identical command: every adapter resumes from its own slot root; each slot's
               adapter, fp32 masters, moments, steps, param groups and scheduler must equal the reference
    all        the three (default)

--export-peft: `--hf-checkpoint` is a tiny HF Qwen2 whose MLPs have the slot model's shapes
(DIR/miles-slots/hf-base, built from a config, no hub), and the config sets `export.peft = true`.
Every slot save then also exports the slot through the harness's Bridge double, at the top of its
generation under Miles v1's stock names. After the relaunch, the real HF PEFT loads each adapter's
newest checkpoint as is onto that base, by the name Miles' readers use (v1 `<slot root>/step_N`, v2
`<adapter save>/current`). It prints `PEFT: loadable (0 missing, 0 unexpected)` per slot.

Ends with `RESULT: bit-exact` (exit 0) or `RESULT: MISMATCH <slot>:<tensor>` (exit 1).
`--without-plugin` runs stock Miles (no init hook): its relaunch resumes the adapters without
optimizer state, and the demo reports the mismatch that leaves (exit 1).
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from miles_lora_ckpt_harness.demo.via_miles_config import CONFIG_TEXT, INIT_HOOK, PEFT_CONFIG_TEXT, STOCK_PHASES

JOB = "miles_lora_ckpt_harness.miles_standin.launch_multi_lora:launch_job"
V2_SHAPES = ("lora-package-2026-09",)
MULTI_LORA_SHAPES = ("lora-utils-2026-08", "lora-package-2026-09")


def check_args(args) -> str | None:
    """A usage error of `--via miles --slots`, or None."""
    if args.slots < 2 or args.slots > 4:
        return "--via miles --slots needs 2 to 4 slots (one is retired until a co-tenant has trained on)"
    if args.miles_shape not in MULTI_LORA_SHAPES:
        return f"--miles-shape {args.miles_shape} has no multi-LoRA; use one of {', '.join(MULTI_LORA_SHAPES)}"
    if (args.pp, args.vpp, args.ep, args.cp) != (1, 1, 1, 1) or args.tp not in (1, 2) or args.world_size % args.tp:
        return "--via miles --slots runs Miles' multi-LoRA layout: --pp/--ep/--cp/--vpp 1, --tp 1 or 2"
    if args.optimizer != "adam" or args.dtype != "bf16":
        return "Miles' multi-LoRA trains Adam per slot in bf16: drop --optimizer and --dtype"
    if args.steps < 6 or args.save_every < 1 or args.save_every >= args.steps:
        return "--via miles --slots needs --steps >= 6 and 1 <= --save-every < --steps"
    if getattr(args, "export_peft", False) and args.without_plugin:
        return "--export-peft --without-plugin: the stand-in's stock multi-LoRA writes no PEFT files (no Bridge)"
    return None


class SlotScenario:
    def __init__(self, args):
        self.args = args
        self.dir = Path(args.workdir).resolve() / "miles-slots"
        self.plugin = not args.without_plugin
        self.crash_step = max(s for s in range(1, args.steps) if s % args.save_every == 0)
        self.crash_rank = args.world_size - 1 if args.crash_rank is None else args.crash_rank
        self.peft = bool(getattr(args, "export_peft", False))
        self.hf = self.dir / "hf-base"

    def adapters(self) -> list[dict]:
        steps = self.args.steps
        out = [{"name": f"s{k}", "steps": steps, "every": k + 1} for k in range(self.args.slots)]
        out[1].update(retire_at=2, return_when={"s0": 4})
        return out

    def command(self, run: Path) -> list[str]:
        hook = ["--custom-megatron-init-path", INIT_HOOK] if self.plugin else []
        tp = ["--tensor-model-parallel-size", str(self.args.tp)] if self.args.tp != 1 else []
        return hook + [
            "--save",
            str(run / "run"),
            "--save-interval",
            str(self.args.save_every),
            "--lora-rank",
            "4",
            "--bf16",
            "--multi-lora-n-adapters",
            str(self.args.slots),
            "--multi-lora-config",
            str(self.dir / "adapters.json"),
            "--num-rollout",
            "1",
            *tp,
            *(["--hf-checkpoint", str(self.hf)] if self.peft else []),
        ]

    def env(self) -> dict[str, str]:
        return {"MILES_LORA_CKPT_CONFIG": str(self.dir / "miles-lora-ckpt.toml")} if self.plugin else {}


def run(args, launcher=None) -> int:
    problem = check_args(args)
    if problem:
        print(f"ERROR {problem}", file=sys.stderr)
        return 2
    crash_at = args.crash_at or ("mid-write" if args.phase in ("all", "train") else None)
    if not args.without_plugin and crash_at is None and args.phase == "train":
        crash_at = "mid-write"
    if args.without_plugin and crash_at not in (None, *STOCK_PHASES):
        print(f"ERROR stock Miles' slot save has only {', '.join(STOCK_PHASES)} to crash at", file=sys.stderr)
        return 2
    scenario = SlotScenario(args)
    if not 0 <= scenario.crash_rank < args.world_size:
        print(f"ERROR --crash-rank must be in [0, {args.world_size})", file=sys.stderr)
        return 2
    scenario.dir.mkdir(parents=True, exist_ok=True)
    (scenario.dir / "adapters.json").write_text(json.dumps({"adapters": scenario.adapters()}, indent=1))
    (scenario.dir / "miles-lora-ckpt.toml").write_text(CONFIG_TEXT + (PEFT_CONFIG_TEXT if scenario.peft else ""))
    if scenario.peft:
        _hf_base(scenario.hf)
    from miles_lora_ckpt_harness.sim.prewarmed import PrewarmedLauncher

    own = launcher is None
    launcher = launcher or PrewarmedLauncher()
    try:
        return _phases(scenario, launcher, crash_at)
    finally:
        if own:
            launcher.close()


def _launch(scenario: SlotScenario, launcher, argv, crash=None):
    from miles_lora_ckpt_harness.miles_standin import shape_path

    return launcher.run(
        scenario.args.world_size,
        JOB,
        {"argv": argv, "crash": crash},
        env=scenario.env(),
        sys_path=[shape_path(scenario.args.miles_shape)],
        timeout_s=300,
        failure_grace_s=5.0,
    )


def _phases(scenario: SlotScenario, launcher, crash_at: str | None) -> int:
    args = scenario.args
    mode = "with miles-lora-ckpt" if scenario.plugin else "WITHOUT the plugin (stock Miles)"
    print(
        f"demo via Miles multi-LoRA ({args.miles_shape} stand-in) {mode}: {args.world_size} ranks, "
        f"{args.slots} slots ({', '.join(f's{k} every {k + 1} round(s)' for k in range(args.slots))}), "
        f"{args.steps} steps each, s1 retired at step 2 and re-registered, --save-interval {args.save_every}, "
        f"workdir {scenario.dir}"
    )
    reference_file = scenario.dir / "reference.json"
    if args.phase in ("all", "reference"):
        shutil.rmtree(scenario.dir / "reference", ignore_errors=True)
        started = time.monotonic()
        results = _launch(scenario, launcher, scenario.command(scenario.dir / "reference"))
        failed = [r for r in results if not r.ok or r.result.get("failed")]
        if failed:
            print(f"RESULT: ERROR the reference run failed: {_reason(failed[0])}")
            return 1
        reference_file.write_text(json.dumps([r.result for r in results]))
        print(f"reference: every slot trained uninterrupted ({time.monotonic() - started:.1f}s)")
    argv = scenario.command(scenario.dir)
    if args.phase in ("all", "train"):
        shutil.rmtree(scenario.dir / "run", ignore_errors=True)
        crash = None
        if crash_at:
            crash = {
                "adapter": "s0",
                "step": scenario.crash_step,
                "rank": scenario.crash_rank,
                "phase": crash_at,
                "reason": "periodic",
            }
        print("train: " + _shell(scenario, argv))
        results = _launch(scenario, launcher, argv, crash)
        for r in results:
            if r.exitcode is not None and r.exitcode < 0:
                print(
                    f"  rank {r.rank}: killed by signal {-r.exitcode} (crash at {crash_at} in s0's step-{scenario.crash_step} save)"
                )
            elif not r.ok or r.result.get("failed"):
                print(f"  rank {r.rank}: stopped: {_reason(r)}")
    if args.phase not in ("all", "resume"):
        return 0
    if not reference_file.exists():
        print("RESULT: ERROR no reference: run --phase reference first")
        return 1
    print("resume: the identical command: " + _shell(scenario, argv))
    results = _launch(scenario, launcher, argv)
    failed = [r for r in results if not r.ok or r.result.get("failed")]
    if failed:
        print(f"RESULT: ERROR the relaunch failed: {_reason(failed[0])}")
        return 1
    reference = json.loads(reference_file.read_text())
    mismatch = None
    for rank, r in enumerate(results):
        for name, want in reference[rank]["final"].items():
            got = r.result["final"].get(name, {})
            bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            status = "bit-exact" if not bad else f"MISMATCH ({len(bad)} of {len(want)}; first {bad[0]})"
            if rank == 0:
                resumed = r.result["registered_at"].get(name)
                print(
                    f"  slot of {name}: resumed at step {resumed}, trained to {r.result['final_steps'][name]}: {status}"
                )
            if bad and mismatch is None:
                mismatch = f"{name}:{bad[0]} (rank {rank})"
    if scenario.peft and mismatch is None:
        mismatch = _peft_report(scenario)
    print(f"RESULT: MISMATCH {mismatch}" if mismatch else "RESULT: bit-exact")
    return 1 if mismatch else 0


def _hf_base(path: Path) -> None:
    """The tiny HF Qwen2 the slot model's MLPs map onto (built once per workdir)."""
    from miles_lora_ckpt_harness.sim.hf_base import build_tiny_qwen2
    from miles_lora_ckpt_harness.sim.multi_lora_model import MultiLoraSimConfig

    if not (path / "config.json").is_file():
        build_tiny_qwen2(path, MultiLoraSimConfig().hf_config_kwargs())


def adapter_checkpoints(scenario: SlotScenario) -> dict[str, Path]:
    """Each adapter's newest checkpoint by the name Miles' readers use: v1 `<slot root>/step_N`
    (the newest reader link), v2 `<adapter save>/current`."""
    from miles_lora_ckpt.savers.multi_lora import reader_links

    out = {}
    for k in range(scenario.args.slots):
        save = scenario.dir / "run" / "adapters" / f"s{k}"
        if scenario.args.miles_shape in V2_SHAPES:
            out[f"s{k}"] = save / "current"
        else:
            steps = [int(n.split("_")[1]) for n in reader_links(save / "checkpoints")]
            out[f"s{k}"] = save / "checkpoints" / f"step_{max(steps)}" if steps else save / "checkpoints"
    return out


def _peft_report(scenario: SlotScenario) -> str | None:
    """--export-peft: every adapter's newest checkpoint, loaded as is with the real HF PEFT onto the
    HF base; the slot roots verified. Returns what failed, or None."""
    from miles_lora_ckpt.tools.peft_tools import load_report
    from miles_lora_ckpt.tools.root_commands import verify_report

    failed = None
    for name, path in adapter_checkpoints(scenario).items():
        result = load_report(path, scenario.hf)
        print(f"  slot of {name}: {path.relative_to(scenario.dir)}: {result.headline()}")
        if not result.ok and failed is None:
            failed = f"{name}: {result.headline()}"
    if failed is None and verify_report(str(scenario.dir / "run" / "adapters")) != 0:
        failed = "verify of the slot roots failed (see above)"
    return failed


def _shell(scenario: SlotScenario, argv) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in scenario.env().items())
    return (env + " " if env else "") + "python train_multi_lora_async.py " + " ".join(shlex.quote(a) for a in argv)


def _reason(result) -> str:
    text = (result.result or {}).get("failed") or result.error or ""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else f"exit code {result.exitcode}"
