"""Multi-LoRA under Miles' async producer, tier 1: groups finish out of order and some are
discarded, so an adapter's step is not a count of draws. The plugin's rollout-function wrapper
records which drawn groups were shipped; each slot generation's data state carries the adapter's
groups still in flight, given back first at a resume. Over a kill across a slot save, every adapter
trains the same prompts as an uninterrupted run, none twice and none skipped (per-step order may
differ: completion order depends on what is in flight)."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest
from test_data_state import _commit

from miles_lora_ckpt.core import data_state, settings
from miles_lora_ckpt.integration import data_state as train_side
from miles_lora_ckpt.integration.config import load_config
from miles_lora_ckpt.integration.multi_lora_data_source import (
    CheckpointedMultiLoRADataSource,
    generate_multi_lora_rollout,
)
from miles_lora_ckpt.savers.multi_lora import SLOT_SAVER
from miles_lora_ckpt_harness.miles_standin.common import multi_lora as common
from miles_lora_ckpt_harness.miles_standin.common.multi_lora_async_rollout import aborted, generate_rollout_multi_lora
from miles_lora_ckpt_harness.miles_standin.common.multi_lora_data_source import MultiLoRAAsyncDataSource
from miles_lora_ckpt_harness.miles_standin.common.rollout import Prompt, PromptSource, write_prompts

STOCK_ROLLOUT = "miles_lora_ckpt_harness.miles_standin.common.multi_lora_async_rollout.generate_rollout_multi_lora"
PROMPTS = {"a": 20, "b": 15}  # one epoch each; 2 groups a step (4 samples, 2 per prompt)
SAVE_INTERVAL = 3


class OneEpoch(PromptSource):
    """The stand-in's per-adapter source, ending after one epoch: a run ends when every prompt is done."""

    def get_samples(self, num_samples: int):
        if not self.buffer and self.offset == len(self.prompts):
            return []
        return super().get_samples(num_samples)


class OneEpochMulti(MultiLoRAAsyncDataSource):
    def create_source(self, adapter):
        return OneEpoch(super().create_source(adapter).args)


@pytest.fixture(autouse=True)
def _clean():
    yield
    common._CONTROLLER = None
    settings.reset()


def _adapters(tmp_path, steps: dict[str, int]) -> list[common.AdapterRun]:
    runs = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    for slot, (name, count) in enumerate(PROMPTS.items()):
        data = write_prompts(tmp_path / f"{name}.jsonl", count)
        config = common.AdapterConfig(name=name, steps=99, save=tmp_path / name, data=str(data))
        runs.append(common.AdapterRun(config, slot, steps.get(name, 0)))
    return runs


def _launch(tmp_path, steps: dict[str, int], *, rollouts: int | None = None, wrapper: bool = True) -> dict:
    """One launch from the adapters' committed `steps`; killed after `rollouts` rollouts (None: to the
    end). Returns {adapter: {step: prompt indices}} of the steps it trained."""
    adapters = _adapters(tmp_path, steps)
    common._CONTROLLER = common.Controller(adapters)
    common._CONTROLLER.active = {a.name for a in adapters}
    args = argparse.Namespace(
        n_samples_per_prompt=2,
        rollout_batch_size=8,  # the producer's groups in flight
        global_batch_size=8,  # samples a train batch
        seed=1234,
        save=None,
        prompt_data=None,
        data_source_path=train_side.MULTI_HOOK,
        rollout_function_path=STOCK_ROLLOUT,
    )
    config = load_config({"MILES_LORA_CKPT_MULTI_LORA_DATA_SOURCE": "test_multi_lora_in_flight.OneEpochMulti"})
    source = CheckpointedMultiLoRADataSource(args, config=config)
    rollout = generate_multi_lora_rollout if wrapper else generate_rollout_multi_lora
    trained: dict[str, dict[int, list[int]]] = {a.name: {} for a in adapters}
    pending: dict[str, list[int]] = {a.name: [] for a in adapters}
    by_name = {a.name: a for a in adapters}
    rollout_id = 0
    while rollouts is None or rollout_id < rollouts:
        groups = rollout(args, rollout_id, source).samples
        if not groups:
            break
        for group in groups:
            pending[group[0].adapter.name].append(int(group[0].label))
        for name in groups[0][0].metadata["step_adapter_names"]:
            adapter = by_name[name]
            adapter.step += 1  # the train step
            trained[name][adapter.step] = pending.pop(name)
            pending[name] = []
            if adapter.step % SAVE_INTERVAL == 0:  # the slot save commits the staged state of its step
                root = adapter.config.save
                doc = train_side.staged_for_slot(load_config({}), args, root, adapter.step, adapter.slot)
                _commit(root, adapter.step, doc, saver=SLOT_SAVER)
        source.save(rollout_id)
        rollout_id += 1
    return trained


def _trained_over_the_run(tmp_path, *, wrapper: bool = True) -> tuple[dict, dict]:
    """Launch 1 killed after 5 rollouts (past each adapter's step-3 slot save), launch 2 to the end:
    {adapter: Counter of prompts trained in committed or final steps}, and the steps resumed at."""
    first = _launch(tmp_path, {}, rollouts=5, wrapper=wrapper)
    resumed = {name: max(s for s in steps if s % SAVE_INTERVAL == 0) for name, steps in first.items()}
    second = _launch(tmp_path, resumed, wrapper=wrapper)
    prompts = {}
    for name in PROMPTS:
        kept = [p for s, ps in first[name].items() if s <= resumed[name] for p in ps]
        prompts[name] = Counter(kept + [p for ps in second[name].values() for p in ps])
    return prompts, resumed


def _expected() -> dict:
    """Every prompt of the epoch but the ones the producer discards, each once."""
    return {name: Counter(i for i in range(count) if not aborted([Prompt(str(i))])) for name, count in PROMPTS.items()}


def test_every_adapter_trains_the_uninterrupted_runs_prompts_once_across_a_kill(tmp_path):
    reference = _launch(tmp_path / "reference", {})
    assert {n: Counter(p for ps in steps.values() for p in ps) for n, steps in reference.items()} == _expected()
    prompts, resumed = _trained_over_the_run(tmp_path / "killed")
    assert resumed == {"a": 3, "b": 3}
    assert prompts == _expected()  # no repeat, no skip
    # the mechanism: the step-3 generations hold groups drawn and not shipped, given back first
    docs = [json.loads(next((tmp_path / "killed" / n).glob("*/rollout_data_state.json")).read_text()) for n in PROMPTS]
    assert all(data_state.in_flight(doc) for doc in docs)
    assert "groups in flight" in data_state.summary(docs[0])


def _repeated(prompts: dict) -> dict:
    return {name: sorted(p for p, count in prompts[name].items() if count > 1) for name in PROMPTS}


def test_without_the_rollout_wrapper_a_resume_repeats_groups(tmp_path):
    # staged by draw count: step 3 trained prompt 7 (drawn after the step's 6th draw) and not 6,
    # so the resumed cursor after prompt 5 hands out 7 again
    prompts, _ = _trained_over_the_run(tmp_path, wrapper=False)
    assert prompts != _expected()
    assert _repeated(prompts) == {"a": [7], "b": [7]}


def test_without_giving_back_the_in_flight_groups_a_resume_skips_them(tmp_path, monkeypatch):
    monkeypatch.setattr(data_state, "in_flight", lambda doc: [])
    prompts, _ = _trained_over_the_run(tmp_path)
    skipped = {name: sorted(_expected()[name] - prompts[name]) for name in PROMPTS}
    assert skipped == {"a": [6, 8], "b": [6, 8]}  # in flight at step 3's shipping: never trained
    assert _repeated(prompts) == {"a": [], "b": []}


def test_a_document_without_in_flight_reads_as_none_in_flight():
    doc = data_state.document(2, "x.Counting", {"kind": "custom", "value": {}}, adapter="a")
    assert "in_flight" not in doc and data_state.in_flight(doc) == []
    with pytest.raises(ValueError, match=r"data state.in_flight\[0\] is not a list of samples"):
        data_state.check({**doc, "in_flight": [7]}, iteration=2)


def test_the_wrapper_refuses_what_it_cannot_follow(tmp_path):
    from miles_lora_ckpt import hooks
    from miles_lora_ckpt.integration.data_state import MULTI_ROLLOUT_HOOK, DataStateRefused

    assert hooks.generate_multi_lora_rollout is generate_multi_lora_rollout
    common._CONTROLLER = common.Controller(_adapters(tmp_path, {}))
    args = argparse.Namespace(n_samples_per_prompt=2, rollout_function_path=MULTI_ROLLOUT_HOOK)
    config = load_config({"MILES_LORA_CKPT_MULTI_LORA_DATA_SOURCE": "test_multi_lora_in_flight.OneEpochMulti"})
    with pytest.raises(DataStateRefused, match=r"which the plugin's multi-LoRA data source sets itself"):
        CheckpointedMultiLoRADataSource(args, config=config)
    args.rollout_function_path = STOCK_ROLLOUT
    source = CheckpointedMultiLoRADataSource(args, config=config)
    assert args.rollout_function_path == MULTI_ROLLOUT_HOOK  # what Miles' manager loads next
    with pytest.raises(DataStateRefused, match=r"got a OneEpochMulti data source, not the plugin's"):
        generate_multi_lora_rollout(args, 0, source.inner)
    common._CONTROLLER.active = {"a"}
    source.get_samples(1)  # builds a's source
    stranger = [Prompt("3", source.inner.get_samples(1)[0][0].adapter)]
    with pytest.raises(DataStateRefused, match=r"shipped a group of adapter a its data source did not draw"):
        source.shipped([stranger])
