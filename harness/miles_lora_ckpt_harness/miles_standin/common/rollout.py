"""The rollout manager's side of a harness launch, as far as the data source goes.

Miles' `RolloutManager` (`miles/ray/rollout.py`) builds its data source from `--data-source-path`,
then loads `--rollout-function-path`; `generate(N)` calls that function with the data source;
`save(N)` and `load(N)` pass on to the data source. The driver (`driver.drive`) runs it on rank 0
when the command has `--prompt-data`, in Miles' order: `load(start - 1)` once, `generate(N)`
before rollout N trains, `save(N)` after the actor's save of N. Its args are a copy, as Ray's
serialisation gives the manager its own. The harness's training data stays seeded by rollout id;
the prompts each rollout drew are reported next to it.

- `scripted_rollout`: the data-source calls of Miles' `sglang_rollout.generate_rollout`: draws of
  `--over-sampling-batch-size` groups until `--rollout-batch-size` groups are done (the first drawn
  finish first), the rest aborted and handed back with `add_samples` under `--partial-rollout`
  (else dropped); a group's prompt index is its label.
- `PromptSource`: the data source of the stand-in shapes (their Miles is not installable, so the
  real `RolloutDataSourceWithBuffer` runs only on the wheel): a cursor over the prompt file and a
  buffer, with the plugin's state protocol (`state_dict` / `load_state_dict`); its `save` and
  `load` do nothing (stock Miles' pickle file is not imitated): a relaunch starts it over.
- `build_tokenizer`, `write_prompts`: a tiny word-level tokenizer folder (`tokenizers`, no hub)
  and a jsonl prompt file, for the wheel's `Dataset`.
"""

from __future__ import annotations

import copy
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

PROMPT_SOURCE = "miles_lora_ckpt_harness.miles_standin.common.rollout.PromptSource"
ROLLOUT_FN = "miles_lora_ckpt_harness.miles_standin.common.rollout.scripted_rollout"


def build_tokenizer(folder: Path, prompts: int) -> Path:
    """A tiny word-level tokenizer saved as an HF tokenizer folder (`tokenizers`, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1, "prompt": 2, **{str(i): 3 + i for i in range(prompts)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "pad_token": "[PAD]"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_prompts(path: Path, prompts: int) -> Path:
    """`prompts` lines `{"text": "prompt i", "label": "i"}`."""
    path.write_text("".join(json.dumps({"text": f"prompt {i}", "label": str(i)}) + "\n" for i in range(prompts)))
    return path


def scripted_rollout(args, rollout_id, data_source, evaluation=False):
    """Miles' `generate_rollout`'s data-source calls (see module doc); returns the done groups."""
    done, aborted = [], []
    while len(done) < args.rollout_batch_size:
        drawn = data_source.get_samples(args.over_sampling_batch_size or args.rollout_batch_size)
        room = args.rollout_batch_size - len(done)
        done += drawn[:room]
        aborted += drawn[room:]
    data_source.add_samples(aborted if args.partial_rollout else [])
    return done


@dataclass(frozen=True)
class AdapterRef:
    """Miles' `AdapterRef`: the adapter a multi-LoRA sample is drawn for."""

    name: str
    slot: int


@dataclass
class Prompt:
    """One sample of a prompt group; `to_dict` / `from_dict` as Miles' `Sample` has them."""

    label: str
    adapter: AdapterRef | None = None  # multi-LoRA: the adapter the group was drawn for (its data source stamps it)
    metadata: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        adapter = None if self.adapter is None else {"name": self.adapter.name, "slot": self.adapter.slot}
        return {"label": self.label, "adapter": adapter, "metadata": dict(self.metadata)}

    @classmethod
    def from_dict(cls, data: dict) -> Prompt:
        adapter = data.get("adapter")
        ref = None if adapter is None else AdapterRef(adapter["name"], int(adapter["slot"]))
        return cls(data["label"], ref, dict(data.get("metadata") or {}))


class PromptSource:
    """The stand-in shapes' data source (see module doc)."""

    def __init__(self, args):
        self.args = args
        lines = Path(args.prompt_data).read_text().splitlines()
        self.prompts = [json.loads(line)["label"] for line in lines if line.strip()]
        self.offset, self.epoch, self.buffer = 0, 0, []

    def get_samples(self, num_samples: int) -> list[list[Prompt]]:
        groups = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        while len(groups) < num_samples:
            if self.offset == len(self.prompts):
                self.offset, self.epoch = 0, self.epoch + 1
            label = self.prompts[self.offset]
            self.offset += 1
            groups.append([Prompt(label) for _ in range(self.args.n_samples_per_prompt)])
        return groups

    def add_samples(self, samples) -> None:
        self.buffer += samples

    def save(self, rollout_id) -> None: ...

    def load(self, rollout_id=None) -> None: ...

    def state_dict(self) -> dict:
        return {"offset": self.offset, "epoch": self.epoch, "buffer": [g[0].label for g in self.buffer]}

    def load_state_dict(self, state: dict) -> None:
        self.offset, self.epoch = state["offset"], state["epoch"]
        self.buffer = [[Prompt(label) for _ in range(self.args.n_samples_per_prompt)] for label in state["buffer"]]


def _load(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class Manager:
    """Miles' RolloutManager as far as the data source goes (see module doc)."""

    def __init__(self, args):
        self.args = copy.deepcopy(args)  # Ray gives the manager its own copy
        self.data_source = _load(self.args.data_source_path)(self.args)
        self.generate_rollout = _load(self.args.rollout_function_path)  # after the data source, as Miles

    def generate(self, rollout_id: int) -> list[int]:
        groups = self.generate_rollout(self.args, rollout_id, self.data_source, evaluation=False)
        return [int(group[0].label) for group in groups]

    def save(self, rollout_id: int) -> None:
        self.data_source.save(rollout_id)

    def load(self, rollout_id: int) -> None:
        if self.args.rollout_global_dataset:  # Miles' train.py loads only with the global dataset
            self.data_source.load(rollout_id)


def manager_for(args, rank: int) -> Manager | None:
    """Rank 0's rollout manager when the command has `--prompt-data`, else None."""
    if rank != 0 or not getattr(args, "prompt_data", None):
        return None
    return Manager(args)
