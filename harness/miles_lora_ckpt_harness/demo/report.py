"""What a demo prints of its layout and of one train job's ranks (shared by the single- and multi-LoRA demos
and the resharding demo)."""

from __future__ import annotations


def describe_layout(config: dict) -> str:
    """`"tp1 pp2 vpp2 ep1 cp1 dp1"`: every axis of a demo config, data parallel derived; the expert
    tensor parallel size after `ep` (`ep1 etp2`) only where it is not the TP size."""
    dp = config["world_size"] // (config["tp"] * config["cp"] * config["pp"])
    etp = config.get("etp") or config["tp"]
    axes = ("tp", "pp", "vpp", "ep", *(("etp",) if etp != config["tp"] else ()), "cp")
    return " ".join(f"{axis}{config[axis]}" for axis in axes) + f" dp{dp}"


def report_train(results: list, crash_at: str | None) -> None:
    """One line per rank of a train job: its summary, the injected SIGKILL, or its error; a failure
    with no crash injected ends the demo (SystemExit with every rank's error)."""
    for result in results:
        if result.ok:
            print(f"  rank {result.rank}: {result.result['summary']}")
        elif result.exitcode is not None and result.exitcode < 0:
            print(f"  rank {result.rank}: killed by signal {-result.exitcode} (crash injected at {crash_at})")
        else:
            print(f"  rank {result.rank}: failed: {(result.error or '').strip().splitlines()[-1:]}")
    if crash_at is None and not all(r.ok for r in results):
        raise SystemExit("train phase failed without an injected crash:\n" + "\n".join(r.error or "" for r in results))


def load_newest(run, root, timeout_s: float):
    """`(result, consensus, refusal)`: the run loads the newest intact generation under `root` on a
    fresh consensus; a refusal (the same on every rank) comes back as one line instead of raising."""
    from miles_lora_ckpt.core.consensus import Consensus
    from miles_lora_ckpt.core.errors import CheckpointError
    from miles_lora_ckpt.savers.single_lora import load_lora_checkpoint

    consensus = Consensus.for_world(timeout_s=timeout_s)
    try:
        result = load_lora_checkpoint(
            run.model, root, optimizer=run.optimizer, opt_param_scheduler=run.scheduler, consensus=consensus
        )
    except CheckpointError as exc:
        return None, consensus, " ".join(line.strip() for line in str(exc).splitlines())
    return result, consensus, None
