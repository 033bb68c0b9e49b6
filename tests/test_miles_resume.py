"""Miles launch commands with the plugin's init hook, SIGKILLed and relaunched unchanged (CPU, gloo).

Every launch runs the Miles stand-in's train loop (`miles_standin`: argument validation, train
actor init with the hook, model/optimizer setup, load, rollouts, periodic saves) on the real
megatron-core DistributedOptimizer, as fresh processes forked from one pre-warmed launcher
(`sim.prewarmed`). A relaunch is compared with an uninterrupted run without checkpoints, tensor by
tensor (adapter, fp32 masters, every moment, steps, scheduler), loss by loss, and by rollout counter.
These runs rely on the CPU harness's megatron fallback-path fixes (sim/cpu_intercepts.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from jobs_paths import TESTS

from miles_lora_ckpt.core.verify import verify_generation
from miles_lora_ckpt_harness.miles_standin import shape_path

pytestmark = [pytest.mark.megatron, pytest.mark.multirank]

JOB = "miles_lora_ckpt_harness.miles_standin.launch:launch_job"
HOOK = ["--custom-megatron-init-path", "miles_lora_ckpt.hooks.megatron_init"]
TARGETS = {"dense": "linear_qkv,linear_proj", "expert-only": "linear_fc1,linear_fc2", "mixed": None}
ROLLOUTS = 4  # x 2 optimizer steps; saves after every rollout; the crash is in the save of rollout 2


@pytest.fixture
def launcher(prewarmed):
    return prewarmed


class Run:
    """One stand-in run directory: the base model, the plugin config, --save/--load, its launches."""

    def __init__(self, launcher, tmp: Path, shape: str, world: int, adapters="mixed", dtype="bf16", extra=()):
        self.launcher, self.shape, self.world = launcher, shape, world
        self.dir = tmp
        self.hf = tmp / "hf-base"
        self.hf.mkdir(parents=True, exist_ok=True)
        (self.hf / "config.json").write_text("{}\n")
        self.save = tmp / "run"
        self.config = tmp / "plugin.toml"
        self.config.write_text("[consensus]\ntimeout_s = 60\n")
        self.training = ["--megatron-to-hf-mode", "bridge", "--hf-checkpoint", str(self.hf)]
        self.training += ["--num-rollout", str(ROLLOUTS), "--lora-rank", "4", "--lora-alpha", "4"]
        self.training += ["--target-modules", TARGETS[adapters]] if TARGETS[adapters] else []
        self.training += ["--bf16"] if dtype == "bf16" else []
        self.training += [str(self.hf) if flag == "{hf}" else flag for flag in extra]

    def command(self, *more: str, plugin: bool = True) -> list[str]:
        saving = ["--save", str(self.save), "--load", str(self.save), "--save-interval", "1"]
        return (HOOK if plugin else []) + self.training + saving + list(more)

    def launch(self, argv, crash=None, env=None, send_ckpt=False, drop=()):
        results = self.launcher.run(
            self.world,
            JOB,
            {"argv": argv, "crash": crash, "send_ckpt": send_ckpt, "drop": list(drop)},
            env={"MILES_LORA_CKPT_CONFIG": str(self.config), **(env or {})},
            sys_path=[shape_path(self.shape), TESTS],
            timeout_s=240,
            failure_grace_s=5.0,
        )
        return results

    def reference(self):
        return ok(self.launch(self.training))


def ok(results) -> list[dict]:
    """Every rank's report; fails the test with the first error otherwise."""
    for r in results:
        assert r.ok and not r.result["failed"], f"rank {r.rank}: {r.error or r.result['failed']}\n{r.stderr_tail}"
    return [r.result for r in results]


def failed(results) -> list[str]:
    """The error text of every rank (every one must have failed)."""
    texts = []
    for r in results:
        text = r.error if not r.ok else r.result["failed"]
        assert text, f"rank {r.rank} did not fail"
        texts.append(text)
    return texts


def assert_resumed_exactly(reference, crashed, resumed, *, resumed_at: int) -> None:
    """The relaunch restarted at `resumed_at`, in exactly the state each surviving rank saved at
    `resumed_at - 1` (adapter, masters, moments, scheduler: stepped once), and ended bit for bit
    where the uninterrupted reference ended."""
    compared = 0
    for rank, (ref, got) in enumerate(zip(reference, resumed, strict=True)):
        assert got["start_rollout_id"] == resumed_at, (rank, got["start_rollout_id"])
        assert got["rollouts"] == list(range(resumed_at, ROLLOUTS)), (rank, got["rollouts"])
        saved = (crashed[rank].result or {}).get("at_save", {}).get(str(resumed_at - 1))
        if resumed_at == 0:  # nothing was committed: the relaunch starts as the reference started
            saved = ref["after_init"]["digests"]
        # stepped once: where rollouts 0..resumed_at-1 left it (8 samples each), not twice as far
        assert got["after_init"]["scheduler_num_steps"] == resumed_at * 8, (rank, got["after_init"])
        if saved is not None:
            assert got["after_init"]["digests"] == saved, _first_difference(saved, got["after_init"]["digests"])
            compared += 1
        for step, loss in got["losses"].items():
            assert loss == ref["losses"][step], (rank, step)
        assert got["final"] == ref["final"], (rank, _first_difference(ref["final"], got["final"]))
    assert compared, "no rank's saved state to compare the resumed state with"


def _first_difference(a: dict, b: dict) -> str | None:
    return next((name for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)), None)


SHAPE_CASES = {
    # shape: (adapters, dtype, extra training flags)
    "lora-utils-2026-08": ("mixed", "bf16", ["--use-kl-loss", "--ref-load", "{hf}", "--keep-old-actor"]),
    "lora-package-2026-09": ("expert-only", "bf16", []),  # a stub dense optimizer child
    "positional-args-pr": ("dense", "fp32", ["--optimizer", "lion"]),
}


@pytest.mark.parametrize("world", [2, 3])
def test_each_shape_killed_mid_save_resumes_bit_exact_with_the_same_command(launcher, tmp_path, world):
    for shape, (adapters, dtype, extra) in SHAPE_CASES.items():
        run = Run(launcher, tmp_path / shape, shape, world, adapters, dtype, extra)
        hooks = []
        if shape == "lora-package-2026-09":  # a user's post-save hook keeps working (--save-hf: test_miles_peft)
            hooks = ["--custom-megatron-post-save-hook-path", "miles_hooks.record_post_save"]
        reference = run.reference()
        crashed = run.launch(run.command(*hooks), crash={"rollout": 2, "rank": world - 1, "phase": "mid-write"})
        assert crashed[world - 1].exitcode == -9
        for survivor in crashed[: world - 1]:  # the peers of the killed rank stop with the same error
            assert "CheckpointError" in (survivor.result or {}).get("failed", ""), survivor.error
        resumed = ok(run.launch(run.command(*hooks)))
        assert_resumed_exactly(reference, crashed, resumed, resumed_at=2)
        assert resumed[0]["plugin"]["shape"] == shape
        if shape == "lora-utils-2026-08":
            for rank, (ref, got) in enumerate(zip(reference, resumed, strict=True)):
                assert got["tags"]["ref"] == ref["tags"]["ref"], rank  # the ref load is unaffected
                params = sorted(v for k, v in got["after_init"]["digests"].items() if k.startswith("param/"))
                assert sorted(got["tags"]["old_actor"].values()) == params, rank  # old actor = resumed adapter
        if shape == "lora-package-2026-09":
            _check_post_save_hook(run)


def _check_post_save_hook(run: Run) -> None:
    for rollout in range(ROLLOUTS):  # saved by the first launch (0, 1) and by the relaunch (2, 3)
        record = json.loads((run.save / f"post_save_{rollout}.json").read_text())
        generation = verify_generation(Path(record["checkpoint_dir"]))
        assert generation.intact and generation.manifest.iteration == rollout, record
        assert record["hf_checkpoint_dir"] is None  # no --save-hf


def test_a_2026_08_tree_without_load_training_state_binds_and_resumes_bit_exact(launcher, tmp_path):
    """PR #1792's branch and current working branches: the 2026-08 tree minus `_load_training_state`
    binds as lora-utils-2026-08 and resumes bit-exact after a kill mid-save."""
    drop = ["miles.backends.megatron_utils.lora_utils._load_training_state"]
    run = Run(launcher, tmp_path, "lora-utils-2026-08", 2, "mixed", "bf16")
    reference = run.reference()
    crashed = run.launch(run.command(), crash={"rollout": 2, "rank": 1, "phase": "mid-write"}, drop=drop)
    assert crashed[1].exitcode == -9
    resumed = ok(run.launch(run.command(), drop=drop))
    assert_resumed_exactly(reference, crashed, resumed, resumed_at=2)
    for got in resumed:
        assert got["plugin"]["shape"] == "lora-utils-2026-08"
        assert not any(b.endswith("_load_training_state") for b in got["plugin"]["bindings"]), got["plugin"]


def test_without_the_plugin_stock_defects_show(launcher, tmp_path):
    """Negative control: stock Miles on the same stand-in."""
    run = Run(launcher, tmp_path / "dense", "lora-utils-2026-08", 2, "dense", "bf16")
    reference = run.reference()
    crash = {"rollout": 2, "rank": 1, "phase": "after-write"}  # a complete stock checkpoint of rollout 2
    crashed = run.launch(run.command(plugin=False), crash=crash)
    assert crashed[1].exitcode == -9
    saved = crashed[0].result["at_save"]["2"]
    adapter = str(run.save / "iter_0000002" / "adapter")
    resumed = ok(run.launch(run.command("--lora-adapter-path", adapter, plugin=False)))
    for rank, (ref, got) in enumerate(zip(reference, resumed, strict=True)):
        after = got["after_init"]
        assert got["start_rollout_id"] == 0, rank  # the rollout counter starts over
        assert after["scheduler_num_steps"] == 24 + 2 * 4, rank  # restored 24 samples, then + 2 x 4 again
        assert not after["masters_match_adapter"], rank  # stale fp32 masters under the loaded adapter
        if rank == 0:  # rank 0 saved rollout 2 before its peer was killed
            params = [n for n in saved if n.startswith("param/")]
            assert all(after["digests"][n] == saved[n] for n in params)  # the adapter itself did load
            state = [n for n in saved if "/master/" in n or n.endswith("/exp_avg") or n.endswith("/exp_avg_sq")]
            assert all(after["digests"].get(n) != saved[n] for n in state)  # masters and moments did not
        assert got["final"] != ref["final"], rank

    expert = Run(launcher, tmp_path / "expert", "lora-utils-2026-08", 2, "expert-only", "bf16")
    errors = failed(expert.launch(expert.command(plugin=False)))
    assert all("AttributeError" in e for e in errors)  # stub child: state_dict() raises on every rank
    first = expert.save / "iter_0000000" / "adapter"
    assert sorted(p.name for p in first.iterdir()) == ["adapter_megatron_rank0.pt", "adapter_megatron_rank1.pt"]


def test_no_load_optim_restores_the_adapter_refreshes_masters_keeps_fresh_moments(launcher, tmp_path):
    run = Run(launcher, tmp_path, "lora-package-2026-09", 2, "mixed", "bf16")
    crashed = run.launch(run.command(), crash={"rollout": 2, "rank": 1, "phase": "mid-write"})
    saved = crashed[0].result["at_save"]["1"]
    resumed = ok(run.launch(run.command("--no-load-optim")))
    for rank, got in enumerate(resumed):
        after = got["after_init"]
        assert got["start_rollout_id"] == 2, rank
        if rank == 0:
            params = [n for n in saved if n.startswith("param/")]
            assert params and all(after["digests"][n] == saved[n] for n in params)  # adapter restored
            assert after["digests"]["scheduler"] == saved["scheduler"]  # repositioned to rollout 2's start
        assert after["masters_match_adapter"], rank  # masters refreshed from the adapter
        assert after["moments"] == [], rank  # fresh moments
        assert after["scheduler_num_steps"] == 2 * 8, rank  # (rollout 1 + 1) x 8 samples per rollout

    finetuned = ok(run.launch(run.command("--finetune")))  # the newest generation is rollout 3 now
    for rank, got in enumerate(finetuned):
        after = got["after_init"]
        assert got["start_rollout_id"] == 0 and got["rollouts"] == list(range(ROLLOUTS)), rank
        assert after["masters_match_adapter"] and after["moments"] == [] and after["scheduler_num_steps"] == 0, rank
        if rank == 0:
            final = resumed[0]["final"]
            assert all(after["digests"][n] == final[n] for n in final if n.startswith("param/"))


def test_lora_dropout_resumes_bit_exact_and_no_load_rng_keeps_the_launchs_rng(launcher, tmp_path):
    """--lora-dropout draws from every rank's RNG: the same command restores each rank's RNG states
    and ends bit-exact; with --no-load-rng (Megatron's flag) everything else is restored the same,
    but the dropout masks come from the launch's own seeding, so the losses differ."""
    dropout = ["--lora-dropout", "0.1"]
    run = Run(launcher, tmp_path / "same", "lora-package-2026-09", 2, "mixed", "bf16", dropout)
    reference = run.reference()
    crashed = run.launch(run.command(), crash={"rollout": 2, "rank": 1, "phase": "mid-write"})
    other = Run(launcher, tmp_path / "no-load-rng", "lora-package-2026-09", 2, "mixed", "bf16", dropout)
    shutil.copytree(run.save, other.save)  # the same committed generations, for the other relaunch
    assert_resumed_exactly(reference, crashed, ok(run.launch(run.command())), resumed_at=2)
    for rank, got in enumerate(ok(other.launch(other.command("--no-load-rng")))):
        assert got["start_rollout_id"] == 2, rank
        if rank == 0:  # adapter, masters, moments and scheduler as saved
            assert got["after_init"]["digests"] == crashed[0].result["at_save"]["1"]
        assert any(loss != reference[rank]["losses"][step] for step, loss in got["losses"].items()), rank


def test_refusals_are_loud_collective_and_name_the_flag(launcher, tmp_path):
    run = Run(launcher, tmp_path / "run", "lora-utils-2026-08", 2, "dense", "fp32")
    ok(run.launch(run.command()))  # every rollout saved
    tracker = run.save / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == str(ROLLOUTS - 1)

    tracker.unlink()  # Miles now replaces --load by the base model and restarts the counter at 0
    errors = failed(run.launch(run.command()))
    assert all("Pass --load" in e and "restart the rollout counter at 0" in e for e in errors)
    assert tracker.exists()  # put back: the next identical launch resumes
    again = ok(run.launch(run.command(), send_ckpt=True))
    assert all(r["start_rollout_id"] == ROLLOUTS and r["rollouts"] == [] for r in again)
    assert all("in-memory fault-tolerance checkpoint" in r["send_ckpt_error"] for r in again)

    no_load = run.command()
    at = no_load.index("--load")
    errors = failed(run.launch(no_load[:at] + no_load[at + 2 :]))
    assert all("Pass --load" in e for e in errors)

    errors = failed(run.launch(run.command("--non-persistent-ckpt-type", "local")))
    assert all("--non-persistent-ckpt-type local" in e for e in errors)

    partial = Run(launcher, tmp_path / "no-save-optim", "lora-utils-2026-08", 2, "dense", "fp32")
    crashed = partial.launch(
        partial.command("--no-save-optim"), crash={"rollout": 2, "rank": 0, "phase": "before-write"}
    )
    assert crashed[0].exitcode == -9
    errors = failed(partial.launch(partial.command()))
    assert all("holds no optimizer state" in e and "--no-load-optim" in e for e in errors)
    lenient = ok(partial.launch(partial.command(), env={"MILES_LORA_CKPT_STRICT": "0"}))
    assert all(r["start_rollout_id"] == 2 for r in lenient)


@pytest.mark.parametrize(
    "phase, rank, rollout, resumed_at",
    [
        ("before-write", 0, 2, 2),
        ("before-publish", 1, 2, 2),
        ("after-publish", 0, 2, 3),
        ("between-saves", 1, 2, 2),
        ("mid-write", 1, 0, 0),  # in the first save: nothing committed, the relaunch starts at rollout 0
    ],
)
def test_killed_at_any_point_the_same_command_resumes_from_the_newest_commit(
    launcher, tmp_path, phase, rank, rollout, resumed_at
):
    run = Run(launcher, tmp_path, "positional-args-pr", 2, "mixed", "bf16")
    reference = _reference_for(run)
    crashed = run.launch(run.command(), crash={"rollout": rollout, "rank": rank, "phase": phase})
    assert crashed[rank].exitcode == -9
    resumed = ok(run.launch(run.command()))
    assert_resumed_exactly(reference, crashed, resumed, resumed_at=resumed_at)


_REFERENCES: dict = {}


def _reference_for(run: Run):
    key = (run.shape, run.world, tuple(run.training[4:]))  # the same training, wherever its base model lies
    if key not in _REFERENCES:
        _REFERENCES[key] = run.reference()
    return _REFERENCES[key]


def test_initial_adapter_and_scheduler_flags_keep_their_meaning(launcher, tmp_path):
    donor = Run(launcher, tmp_path / "donor", "lora-package-2026-09", 2, "mixed", "bf16")
    trained = ok(donor.launch(donor.command()))

    # --lora-adapter-path: the initial adapter of a fresh run (here another run's save root), for
    # the actor (weights, masters refreshed, fresh moments and scheduler, rollout 0) and the ref model
    extra = ["--use-kl-loss", "--ref-load", "{hf}", "--lora-adapter-path", str(donor.save / "lora")]
    fresh = Run(launcher, tmp_path / "warm", "lora-package-2026-09", 2, "mixed", "bf16", extra)
    started = ok(fresh.launch(fresh.command()))
    for rank, got in enumerate(started):
        after = got["after_init"]
        assert got["start_rollout_id"] == 0 and after["masters_match_adapter"] and after["moments"] == [], rank
        assert after["scheduler_num_steps"] == 0, rank
        params = {n: d for n, d in trained[rank]["final"].items() if n.startswith("param/")}
        assert all(after["digests"][n] == d for n, d in params.items()), rank
        assert sorted(got["tags"]["ref"].values()) == sorted(params.values()), rank

    # a changed schedule is refused on resume (resume.strict, before anything changes) unless
    # --use-checkpoint-opt-param-scheduler; the refusal names the field and both values
    errors = failed(donor.launch(donor.command("--lr-warmup-iters", "2")))
    assert all("scheduler: lr_warmup_steps differs: checkpoint " in e for e in errors), errors[0]
    assert all("add --use-checkpoint-opt-param-scheduler" in e for e in errors), errors[0]
    resumed = ok(donor.launch(donor.command("--lr-warmup-iters", "2", "--use-checkpoint-opt-param-scheduler")))
    assert all(r["start_rollout_id"] == ROLLOUTS and r["after_init"]["scheduler_num_steps"] == 32 for r in resumed)
