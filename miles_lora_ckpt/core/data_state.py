"""The rollout side's data state: its JSON form, its checks, and its sealed hand-over to a save.

Miles' rollout manager owns the data source: prompt cursor, epoch, counters, metadata and a buffer
of sample groups. The plugin's data source (`integration.data_source`) snapshots it once rollout N's
draw is complete and stages it here. The save of generation N commits the staged state of rollout
N as `rollout_data_state.json`, verified like every file. See docs/file-format.md, "Rollout data
state".

The document (bounded JSON, no pickle; values JSON cannot hold are tagged by `jsoncodec`)::

    {"format": 1, "rollout_id": N, "source": "<the wrapped class, dotted>",
     "state": null                                  (accepted: this source has no data state)
            | {"kind": "miles", "cursor": {"sample_offset", "epoch_id", "sample_group_index",
                                            "sample_index"},
               "metadata": {...}, "dataset": {"size", "shuffle", "seed"} | null,
               "buffer": [[<sample>, ...], ...] | null}
            | {"kind": "custom", "value": <the class's own state_dict()>},
     "adapter": "<name>",                      (multi-LoRA only: the adapter whose data this is)
     "in_flight": [[<sample>, ...], ...]}      (optional, multi-LoRA: groups drawn, not shipped)

A resume gives the `in_flight` groups back before it draws new ones; without the key, none are in
flight. In a multi-LoRA slot generation, `rollout_id` is the adapter's own step. Staged files are
`<save root>/.rollout-data/data_state_<N>.json`, a sealed envelope written crash-safely:
`{"seal": "<xxh3 of the document's bytes>", "data_state": <document>}`. A torn or altered one fails
its seal, naming the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from miles_lora_ckpt.core import atomic_files, bounded, json_files
from miles_lora_ckpt.core.digest import digest_bytes
from miles_lora_ckpt.core.errors import MilesLoraCkptError
from miles_lora_ckpt.core.jsoncodec import check_tags

__all__ = [
    "CURSOR_KEYS",
    "DATA_STATE",
    "ROLE_DATA_STATE",
    "DataStateMissing",
    "check",
    "discard_staged",
    "document",
    "in_flight",
    "read_staged",
    "stage",
    "staged_rollouts",
    "summary",
]

DATA_STATE = "rollout_data_state.json"  # the file inside a generation
ROLE_DATA_STATE = "rollout-data-state"
FORMAT = 1
STAGED_DIR = ".rollout-data"  # inside the save root; never a generation, never read by a loader
CURSOR_KEYS = ("sample_offset", "epoch_id", "sample_group_index", "sample_index")
KINDS = ("miles", "custom")
_STAGED_RE = re.compile(r"data_state_([0-9]{9})\.json\Z", re.ASCII)


class DataStateMissing(MilesLoraCkptError, ValueError):
    """The staged data state of a rollout is absent, torn or not the rollout's; names the file."""


# --------------------------------------------------------------------------- the document


def document(
    rollout_id: int, source: str, state: dict | None, *, adapter: str | None = None, in_flight: list | None = None
) -> dict:
    """The checked data-state document of `rollout_id` from `source`; ValueError if refused.

    `state` None records a source without one. `adapter` names a multi-LoRA adapter, whose step
    `rollout_id` then is. `in_flight` holds its groups drawn and not shipped, recorded when given.
    """
    doc = {"format": FORMAT, "rollout_id": int(rollout_id), "source": str(source), "state": state}
    if adapter is not None:
        doc["adapter"] = str(adapter)
    if in_flight is not None:
        doc["in_flight"] = in_flight
    check(doc, iteration=int(rollout_id))
    return doc


def check(doc: Any, *, iteration: int) -> dict:
    """`doc` if it is a data-state document of `iteration`; else ValueError naming the field."""
    bounded.mapping(doc, "data state")
    unknown = sorted(set(doc) - {"format", "rollout_id", "source", "state", "adapter", "in_flight"})
    if unknown:
        raise ValueError(f"data state has unknown keys {unknown}")
    if doc.get("format") != FORMAT:
        raise ValueError(f"data state format is {bounded.show(doc.get('format'))}, not {FORMAT}")
    rollout = bounded.integer(doc.get("rollout_id"), "data state rollout_id")
    if rollout != iteration:
        raise ValueError(f"data state belongs to rollout {rollout}, not to this generation's rollout {iteration}")
    bounded.string(doc.get("source"), "data state source")
    if "adapter" in doc:
        bounded.string(doc["adapter"], "data state adapter")
    if "in_flight" in doc:
        _check_groups(doc["in_flight"], "data state.in_flight")
    state = doc.get("state")
    if state is None:
        return doc
    bounded.mapping(state, "data state.state")
    kind = state.get("kind")
    if kind not in KINDS:
        raise ValueError(f"data state.state.kind is {bounded.show(kind)}, not one of {list(KINDS)}")
    check_tags(state, "data state.state")
    if kind == "custom":
        if set(state) != {"kind", "value"}:
            raise ValueError(f"data state.state (custom) has keys {sorted(state)}, not ['kind', 'value']")
        return doc
    expected = {"kind", "cursor", "metadata", "dataset", "buffer"}
    if set(state) != expected:
        raise ValueError(f"data state.state has keys {sorted(state)}, not {sorted(expected)}")
    cursor = bounded.mapping(state["cursor"], "data state.state.cursor")
    if sorted(cursor) != sorted(CURSOR_KEYS):
        raise ValueError(f"data state.state.cursor has keys {sorted(cursor)}, not {sorted(CURSOR_KEYS)}")
    for key in CURSOR_KEYS:
        bounded.integer(cursor[key], f"data state.state.cursor.{key}")
    bounded.mapping(state["metadata"], "data state.state.metadata")
    if state["dataset"] is not None:
        dataset = bounded.mapping(state["dataset"], "data state.state.dataset")
        if set(dataset) != {"size", "shuffle", "seed"}:
            raise ValueError(f"data state.state.dataset has keys {sorted(dataset)}, not ['seed', 'shuffle', 'size']")
        bounded.integer(dataset["size"], "data state.state.dataset.size")
        if not isinstance(dataset["shuffle"], bool):
            raise ValueError("data state.state.dataset.shuffle is not a boolean")
    if state["buffer"] is not None:
        _check_groups(state["buffer"], "data state.state.buffer")
    return doc


def _check_groups(groups: Any, where: str) -> None:
    """A list of sample groups, each a list of samples as JSON objects (tags checked)."""
    if not isinstance(groups, list):
        raise ValueError(f"{where} is not a list of sample groups")
    for g, group in enumerate(groups):
        if not isinstance(group, list):
            raise ValueError(f"{where}[{g}] is not a list of samples")
        for s, sample in enumerate(group):
            bounded.mapping(sample, f"{where}[{g}][{s}]")
    check_tags(groups, where)


def in_flight(doc: dict) -> list:
    """The document's groups drawn and not shipped (none for a document without the key)."""
    return list(doc.get("in_flight") or [])


def summary(doc: dict) -> str:
    """One line: the rollout, the cursor and the buffer (for `inspect`, logs and the demo)."""
    state = doc["state"]
    head = f"rollout {doc['rollout_id']} of {doc['source']}"
    if "adapter" in doc:
        head = f"adapter {doc['adapter']} step {doc['rollout_id']} of {doc['source']}"
    if "in_flight" in doc:
        head = f"{head}, {len(doc['in_flight'])} groups in flight"
    if state is None:
        return f"{head}: no data state (accepted by data_state.accept_none)"
    if state["kind"] == "custom":
        return f"{head}: the class's own state_dict()"
    cursor = state["cursor"]
    groups = state["buffer"] or []
    return (
        f"{head}: cursor {cursor['sample_offset']} of epoch {cursor['epoch_id']}, next group "
        f"{cursor['sample_group_index']}, next sample {cursor['sample_index']}, buffer {len(groups)} groups "
        f"({sum(len(g) for g in groups)} samples)"
    )


# --------------------------------------------------------------------------- staging


def staged_dir(root: str | os.PathLike) -> Path:
    """The directory of staged data states under the save root `root`."""
    return Path(root) / STAGED_DIR


def staged_path(root: str | os.PathLike, rollout_id: int) -> Path:
    """Where the data state of `rollout_id` is staged under the save root `root`."""
    return staged_dir(root) / f"data_state_{int(rollout_id):09d}.json"


def stage(root: str | os.PathLike, doc: dict) -> Path:
    """Seal and stage `doc` crash-safely; returns the staged file's path.

    A refused `doc` raises ValueError; an OSError of the write propagates.
    """
    check(doc, iteration=doc["rollout_id"])
    body = json_files.json_bytes(doc)
    directory = staged_dir(root)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_temporaries(directory)
    path = staged_path(root, doc["rollout_id"])
    envelope = {"seal": digest_bytes(body), "data_state": doc}
    atomic_files.write_file_atomic(path, [json_files.json_bytes(envelope)])
    atomic_files.fsync_dir(directory)
    return path


def read_staged(root: str | os.PathLike, rollout_id: int) -> dict:
    """The staged data state of `rollout_id`, its seal checked; DataStateMissing names the file."""
    path = staged_path(root, rollout_id)
    if not path.is_file():
        raise DataStateMissing(f"{path}: no data state was staged for rollout {rollout_id}")
    try:
        envelope = bounded.mapping(json_files.read_json(path), "staged data state")
        if set(envelope) != {"seal", "data_state"}:
            raise ValueError(f"has keys {sorted(envelope)}, not ['data_state', 'seal']")
        doc = envelope["data_state"]
        if digest_bytes(json_files.json_bytes(doc)) != envelope["seal"]:
            raise ValueError("its content does not match its seal (torn or altered)")
        return check(doc, iteration=int(rollout_id))
    except DataStateMissing:
        raise
    except (OSError, ValueError) as exc:
        raise DataStateMissing(f"{path}: {exc}") from exc


def staged_rollouts(root: str | os.PathLike) -> list[int]:
    """The rollouts with a staged file (sealed or not), ascending."""
    directory = staged_dir(root)
    if not directory.is_dir():
        return []
    return sorted(int(m[1]) for name in os.listdir(directory) if (m := _STAGED_RE.fullmatch(name)))


def discard_staged(root: str | os.PathLike, *, above: int | None = None, upto: int | None = None) -> list[int]:
    """Remove staged files of rollouts above `above` or up to `upto`; returns those rollouts.

    A relaunch redraws the rollouts above; those up to `upto` are committed. Temporaries of a killed
    write go too. An OSError propagates.
    """
    directory = staged_dir(root)
    if not directory.is_dir():
        return []
    _remove_temporaries(directory)
    removed = []
    for rollout in staged_rollouts(root):
        if (above is not None and rollout > above) or (upto is not None and rollout <= upto):
            staged_path(root, rollout).unlink(missing_ok=True)
            removed.append(rollout)
    if removed:
        atomic_files.fsync_dir(directory)
    return removed


def _remove_temporaries(directory: Path) -> None:
    """Remove `write_file_atomic`'s temporaries (`.<name>.tmp-<hex>`), left by killed writes."""
    for name in os.listdir(directory):
        if name.startswith(".data_state_") and ".tmp-" in name:
            (directory / name).unlink(missing_ok=True)
