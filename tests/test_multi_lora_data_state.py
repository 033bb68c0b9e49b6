"""Multi-LoRA's data state per adapter, tier 1: staging per step, the slot save's hand-over, the
restore when an adapter's source is built, and the refusals (the multi-rank stand-in run is in
tests/test_miles_multi_lora.py)."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import pytest
from test_data_state import Counting, _commit

from miles_lora_ckpt.core import data_state, settings
from miles_lora_ckpt.integration import data_state as train_side
from miles_lora_ckpt.integration.config import load_config
from miles_lora_ckpt.integration.data_source import DataStateRefused
from miles_lora_ckpt.integration.multi_lora_data_source import CheckpointedMultiLoRADataSource
from miles_lora_ckpt.savers.multi_lora import SLOT_SAVER

ADAPTERS: dict = {}  # the fake controller's snapshot


@pytest.fixture(autouse=True)
def _clean():
    ADAPTERS.clear()
    yield
    settings.reset()


class Group(list):
    """A prompt group whose samples carry the adapter they were drawn for, as Miles stamps them."""


class FakeMulti:
    """The shape of Miles' multi-LoRA data source: lazy per-adapter sources, one group a draw in turn."""

    def __init__(self, args):
        self.args, self.sources, self.turn = args, {}, 0

    def create_source(self, adapter):
        return Counting(self.args)

    def get_samples(self, num_samples=1):
        for name in [n for n in self.sources if n not in ADAPTERS]:
            del self.sources[name]
        for name, adapter in ADAPTERS.items():
            if name not in self.sources:
                self.sources[name] = self.create_source(adapter)
        names = sorted(self.sources)
        name = names[self.turn % len(names)]
        self.turn += 1
        index = self.sources[name].get_samples(1)[0][0]
        return [[SimpleNamespace(index=index, adapter=SimpleNamespace(name=name))]]

    def add_samples(self, samples): ...


def _adapter(tmp_path, name, step=0):
    config = SimpleNamespace(name=name, save=str(tmp_path / name), adapter_global_batch_size=4)
    return SimpleNamespace(config=config, step=step, slot=0)


def _source(**env):
    args = argparse.Namespace(n_samples_per_prompt=2, data_source_path=train_side.MULTI_HOOK)
    config = load_config({"MILES_LORA_CKPT_MULTI_LORA_DATA_SOURCE": "test_multi_lora_data_state.FakeMulti", **env})
    return args, CheckpointedMultiLoRADataSource(args, config=config)


def _draw(source, groups) -> dict[str, list[int]]:
    drawn: dict[str, list[int]] = {}
    for _ in range(groups):
        sample = source.get_samples(1)[0][0]
        drawn.setdefault(sample.adapter.name, []).append(sample.index)
    return drawn


def test_each_adapter_resumes_its_own_cursor_from_its_slot_generation(tmp_path):
    ADAPTERS.update(a=_adapter(tmp_path, "a"), b=_adapter(tmp_path, "b"))
    args, source = _source()
    assert _draw(source, 8) == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}  # 2 groups a step: steps 1, 2 each
    for name in ("a", "b"):
        root = tmp_path / name
        assert data_state.staged_rollouts(root) == [1, 2]
        doc = train_side.staged_for_slot(load_config({}), args, root, 2, 0)
        assert (doc["adapter"], doc["rollout_id"], doc["state"]["value"]["cursor"]) == (name, 2, 4)
        _commit(root, 2, doc, saver=SLOT_SAVER)
    _draw(source, 2)  # step 3's draws start: staged 3 is not committed (a kill now)
    source.save(0)
    assert data_state.staged_rollouts(tmp_path / "a") == [2]  # below the newest committed step: removed
    # relaunch: both resumed at step 2; b also retired and registered again on the way
    ADAPTERS.update(a=_adapter(tmp_path, "a", 2), b=_adapter(tmp_path, "b", 2))
    _, relaunched = _source()
    assert _draw(relaunched, 4) == {"a": [4, 5], "b": [4, 5]}
    del ADAPTERS["b"]
    _draw(relaunched, 1)
    ADAPTERS["b"] = _adapter(tmp_path, "b", 2)  # re-registered from its step-2 generation
    assert _draw(relaunched, 3)["b"] == [4, 5]


def test_an_adapter_without_a_generation_of_its_step_or_with_anothers_state_is_refused(tmp_path):
    ADAPTERS["a"] = _adapter(tmp_path, "a", 2)
    _, source = _source()
    with pytest.raises(DataStateRefused, match=r"no intact committed generation of step 2, the step adapter a"):
        _draw(source, 1)
    other = data_state.document(2, "x.Counting", {"kind": "custom", "value": {"cursor": 4, "buffer": []}}, adapter="b")
    _commit(tmp_path / "a", 2, other, saver=SLOT_SAVER)
    with pytest.raises(DataStateRefused, match=r"data state of adapter 'b', not of 'a'"):
        _draw(_source()[1], 1)


def test_a_generation_without_data_state_warns_and_starts_over(tmp_path, caplog):
    _commit(tmp_path / "a", 2, None, saver=SLOT_SAVER)
    ADAPTERS["a"] = _adapter(tmp_path, "a", 2)
    with caplog.at_level(logging.WARNING):
        assert _draw(_source()[1], 2) == {"a": [0, 1]}
    assert "holds no data state: its data source starts over" in caplog.text


def test_the_slot_save_takes_its_steps_staged_state_or_refuses(tmp_path, caplog):
    args = argparse.Namespace(data_source_path=train_side.MULTI_HOOK)
    root = tmp_path / "a"
    with pytest.raises(DataStateRefused, match=r"data_state_000000003.json.*slot 1 generation of step 3"):
        train_side.staged_for_slot(load_config({}), args, root, 3, 1)
    with caplog.at_level(logging.WARNING):
        assert (
            train_side.staged_for_slot(load_config({"MILES_LORA_CKPT_DATA_STATE_MISSING": "warn"}), args, root, 3, 1)
            is None
        )
    assert train_side.staged_for_slot(load_config({}), args, root, 0, 1) is None  # nothing drawn at step 0
    stock = argparse.Namespace(data_source_path="miles.rollout.multi_lora.data_source.MultiLoRAAsyncDataSource")
    assert train_side.staged_for_slot(load_config({}), stock, root, 3, 1) is None


def test_a_class_without_per_adapter_sources_or_a_step_boundary_is_refused(tmp_path):
    with pytest.raises(DataStateRefused, match=r"test_data_state.Counting has no create_source"):
        _source(MILES_LORA_CKPT_MULTI_LORA_DATA_SOURCE="test_data_state.Counting")
    ADAPTERS["a"] = _adapter(tmp_path, "a")
    ADAPTERS["a"].config.adapter_global_batch_size = 3
    with pytest.raises(DataStateRefused, match=r"adapter a: adapter_global_batch_size 3 is not a positive multiple"):
        _draw(_source()[1], 1)


def test_the_slot_generations_data_state_is_verified_and_inspected_naming_its_adapter(tmp_path, capsys):
    from miles_lora_ckpt.tools.cli import main as cli

    doc = data_state.document(4, "x.Counting", {"kind": "custom", "value": {}}, adapter="a")
    gen = _commit(tmp_path / "a", 4, doc, saver=SLOT_SAVER)
    assert cli(["verify", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert cli(["inspect", str(gen)]) == 0
    assert "data state  adapter a step 4 of x.Counting: the class's own state_dict()" in capsys.readouterr().out
    wrong = _commit(tmp_path / "a", 6, data_state.document(4, "x.Counting", None, adapter="a"), saver=SLOT_SAVER)
    assert cli(["verify", str(wrong)]) != 0  # step 4's state in the generation of step 6
    assert "data state belongs to rollout 4, not to this generation's rollout 6" in capsys.readouterr().out
    with pytest.raises(ValueError, match="data state adapter is 7, not a string"):
        data_state.check({**doc, "adapter": 7}, iteration=4)


def test_a_v1_adapter_stages_in_its_save_directory_and_resumes_from_its_checkpoints_slot_root(tmp_path):
    """Miles v1 keeps the slot root in `<adapter save>/checkpoints`: the states are staged in
    `<adapter save>` (where v1's slot save takes them) and restored from the generation there."""
    ADAPTERS["a"] = _adapter(tmp_path, "a")
    args, source = _source()
    assert _draw(source, 4) == {"a": [0, 1, 2, 3]}
    doc = train_side.staged_for_slot(load_config({}), args, tmp_path / "a", 2, 0)
    _commit(tmp_path / "a" / "checkpoints", 2, doc, saver=SLOT_SAVER)
    source.save(0)
    assert data_state.staged_rollouts(tmp_path / "a") == [2]  # below v1's newest committed step: removed
    ADAPTERS["a"] = _adapter(tmp_path, "a", 2)
    assert _draw(_source()[1], 2) == {"a": [4, 5]}


def test_a_slot_root_holding_only_a_killed_first_saves_staging_has_no_step(tmp_path):
    from miles_lora_ckpt.integration.multi_lora_data_source import newest_committed_step

    ADAPTERS["a"] = _adapter(tmp_path, "a")
    _, source = _source()
    _draw(source, 2)
    (tmp_path / "a" / ".staging-00000000000000aa").mkdir()  # the first save, killed: nothing committed
    assert newest_committed_step(tmp_path / "a") is None
    source.save(0)  # the rollout side goes on
    assert data_state.staged_rollouts(tmp_path / "a") == [1]
