"""The rollout data state (tier 1, no Miles): its document, sealed staging, the generation file and
its content rule, the train side's refusal, and the plugin's data source over a class of the test's
own (Miles' own classes run in the real-Miles tier: tests/test_real_miles_data_state.py)."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch

from miles_lora_ckpt.core import data_state, settings
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.layout import Topology
from miles_lora_ckpt.core.protocol import save_generation
from miles_lora_ckpt.integration import data_source, resume
from miles_lora_ckpt.integration import data_state as train_side
from miles_lora_ckpt.integration.config import load_config
from miles_lora_ckpt.savers.single_lora.save import DATA_STATE_BINDING
from miles_lora_ckpt.tools.cli import main as cli

MILES_STATE = {
    "kind": "miles",
    "cursor": {"sample_offset": 24, "epoch_id": 1, "sample_group_index": 40, "sample_index": 80},
    "metadata": {"seen": 3},
    "dataset": {"size": 64, "shuffle": True, "seed": 42},
    "buffer": [[{"index": 7, "prompt": "p", "reward": {"__float__": "nan"}}]],
}


@pytest.fixture(autouse=True)
def _no_settings_left_behind():
    yield
    settings.reset()  # the data source applies its config's core settings, as the rollout manager would


def _doc(rollout=3, state=MILES_STATE):
    return data_state.document(rollout, "miles.rollout.data_source.RolloutDataSourceWithBuffer", state)


def _commit(root, rollout, doc=None, *, saver="single-lora", binding=DATA_STATE_BINDING):
    def write(writer):
        writer.write_json("harness.json", {"iteration": rollout}, binding={"role": "harness"})
        if doc is not None:
            writer.write_json(data_state.DATA_STATE, doc, binding=binding)

    gen = save_generation(
        Consensus.single_process(),
        root,
        iteration=rollout,
        saver=saver,
        topology=Topology(world=1, tp=1),
        write_files=write,
    )
    return gen


# --------------------------------------------------------------------------- document and staging


def test_staged_state_round_trips_sealed(tmp_path):
    doc = _doc()
    path = data_state.stage(tmp_path, doc)
    assert path == tmp_path / ".rollout-data" / "data_state_000000003.json"
    assert data_state.read_staged(tmp_path, 3) == doc
    assert "cursor 24 of epoch 1" in data_state.summary(doc) and "buffer 1 groups (1 samples)" in data_state.summary(
        doc
    )


def test_a_torn_or_altered_staged_state_is_refused_naming_the_file(tmp_path):
    path = data_state.stage(tmp_path, _doc())
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(data_state.DataStateMissing, match="data_state_000000003.json"):
        data_state.read_staged(tmp_path, 3)
    envelope = json.loads(raw)
    envelope["data_state"]["state"]["cursor"]["sample_offset"] = 0
    path.write_text(json.dumps(envelope))
    with pytest.raises(data_state.DataStateMissing, match="does not match its seal"):
        data_state.read_staged(tmp_path, 3)
    with pytest.raises(data_state.DataStateMissing, match="no data state was staged for rollout 4"):
        data_state.read_staged(tmp_path, 4)


def test_discard_removes_killed_writes_and_the_chosen_rollouts(tmp_path):
    for rollout in (2, 3, 4):
        data_state.stage(tmp_path, _doc(rollout))
    dead = tmp_path / ".rollout-data" / ".data_state_000000005.json.tmp-dead"
    dead.write_bytes(b'{"seal": "xx')
    assert data_state.staged_rollouts(tmp_path) == [2, 3, 4]
    assert data_state.discard_staged(tmp_path, above=3) == [4]
    assert not dead.exists()
    assert data_state.discard_staged(tmp_path, upto=2) == [2]
    assert data_state.staged_rollouts(tmp_path) == [3]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(rollout_id=4), "belongs to rollout 4"),
        (lambda d: d.update(extra=1), "unknown keys"),
        (lambda d: d["state"]["cursor"].pop("epoch_id"), "cursor has keys"),
        (lambda d: d["state"]["cursor"].update(sample_offset=-1), "sample_offset"),
        (lambda d: d["state"].update(buffer=[{"a": 1}]), r"buffer\[0\] is not a list"),
        (lambda d: d["state"].update(kind="pickle"), "kind"),
        (lambda d: d["state"]["buffer"][0][0].update(reward={"__float__": "zero"}), "malformed"),
    ],
)
def test_check_refuses_a_malformed_document(change, message):
    doc = json.loads(json.dumps(_doc()))
    change(doc)
    with pytest.raises(ValueError, match=message):
        data_state.check(doc, iteration=3)


# --------------------------------------------------------------------------- in a generation


def test_the_generation_file_is_verified_inspected_and_listed(tmp_path, capsys):
    gen = _commit(tmp_path, 3, _doc())
    assert cli(["verify", str(tmp_path)]) == 0
    capsys.readouterr()
    assert cli(["inspect", str(gen)]) == 0
    out = capsys.readouterr().out
    assert "data state  rollout 3 of miles.rollout.data_source.RolloutDataSourceWithBuffer: cursor 24" in out
    assert "role=rollout-data-state" in out
    data_state.stage(tmp_path, _doc(4))
    assert cli(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[data state]" in out and "staged, not committed yet: rollouts 4" in out
    # a staged state in the root is no generation: verify and gc leave it alone
    assert cli(["verify", str(tmp_path)]) == 0
    assert cli(["gc", str(tmp_path), "--keep", "1"]) == 0
    assert data_state.staged_rollouts(tmp_path) == [4]


def test_verify_refuses_a_data_state_of_another_rollout_or_without_its_role(tmp_path, capsys):
    doc = _doc(2)  # the state of rollout 2 committed as generation 3's
    _commit(tmp_path / "a", 3, doc)
    assert cli(["verify", str(tmp_path / "a")]) == 1
    assert "belongs to rollout 2, not to this generation's rollout 3" in capsys.readouterr().out
    _commit(tmp_path / "b", 3, _doc(), binding={})  # a resealed manifest that drops the role
    assert cli(["verify", str(tmp_path / "b")]) == 1
    assert "rollout_data_state.json" in capsys.readouterr().out


# --------------------------------------------------------------------------- the train side


def _args(tmp_path, **kw):
    base = dict(
        data_source_path=train_side.HOOK,
        rollout_function_path="test_data_state.rollout_fn",
        save=str(tmp_path / "save"),
        load=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_the_save_takes_its_own_rollouts_staged_state_or_refuses(tmp_path, caplog):
    args = _args(tmp_path)
    root = resume.save_root(load_config({}), args.save)
    data_state.stage(root, _doc(3))
    assert train_side.staged_for_save(load_config({}), args, root, 3)["rollout_id"] == 3
    with pytest.raises(train_side.DataStateRefused, match=r"data_state_000000004.json.*not committed"):
        train_side.staged_for_save(load_config({}), args, root, 4)
    warn = load_config({"MILES_LORA_CKPT_DATA_STATE_MISSING": "warn"})
    with caplog.at_level(logging.WARNING):
        assert train_side.staged_for_save(warn, args, root, 4) is None
    assert "WITHOUT its rollout data state" in caplog.text
    stock = _args(tmp_path, data_source_path="miles.rollout.data_source.RolloutDataSourceWithBuffer")
    assert train_side.staged_for_save(load_config({}), stock, root, 4) is None
    assert train_side.startup_note(stock).startswith("WARNING: --data-source-path")
    from miles_lora_ckpt_harness.demo.via_miles_config import DATA_SOURCE_HOOK

    assert DATA_SOURCE_HOOK == train_side.HOOK  # the demo's command names the real entry point


# --------------------------------------------------------------------------- the rollout side


class Counting:
    """A data source of the test's own with the plugin's state protocol."""

    def __init__(self, args):
        self.cursor, self.buffer = 0, []

    def get_samples(self, n):
        drawn = self.buffer[:n] + list(range(self.cursor, self.cursor + n - len(self.buffer[:n])))
        self.cursor += n - len(self.buffer[:n])
        del self.buffer[:n]
        return [[i] for i in drawn]

    def add_samples(self, groups):
        self.buffer += [g[0] for g in groups]

    def state_dict(self):
        return {"cursor": self.cursor, "buffer": list(self.buffer)}

    def load_state_dict(self, state):
        self.cursor, self.buffer = state["cursor"], list(state["buffer"])


class Opaque(Counting):
    state_dict = None  # no state the plugin understands


def rollout_fn(args, rollout_id, source, evaluation=False):
    groups = source.get_samples(5)
    source.add_samples(groups[4:])  # one aborted group back to the buffer
    return groups[:4]


def _source(args, cls="test_data_state.Counting", **env):
    return data_source.CheckpointedDataSource(args, config=load_config({"MILES_LORA_CKPT_DATA_SOURCE": cls, **env}))


def _train(args, source, rollouts, trained):
    from miles_lora_ckpt.integration.data_source import generate_rollout

    root = resume.save_root(load_config({}), args.save)
    for rollout in rollouts:
        trained[rollout] = [g[0] for g in generate_rollout(args, rollout, source)]
        _commit(root, rollout, train_side.staged_for_save(load_config({}), args, root, rollout))
        resume.write_megatron_tracker(args.save, rollout)
        source.save(rollout)


def test_the_data_source_resumes_from_the_committed_generation(tmp_path):
    reference = {}
    args = _args(tmp_path / "ref")
    _train(args, _source(args), range(4), reference)
    trained = {}
    args = _args(tmp_path / "run")
    source = _source(args)
    assert args.rollout_function_path == train_side.ROLLOUT_HOOK  # the manager loads the wrapper next
    _train(args, source, range(2), trained)
    # a stale staged state of rollout 2 (drawn before a kill, never committed) must not be read
    root = resume.save_root(load_config({}), args.save)
    data_state.stage(root, data_state.document(2, "x", {"kind": "custom", "value": {"cursor": 99, "buffer": []}}))
    relaunched = _args(tmp_path / "run", load=str(tmp_path / "run" / "save"))
    source = _source(relaunched)
    source.load(1)
    assert data_state.staged_rollouts(root) == []
    assert source.inner.state_dict() == {"cursor": 9, "buffer": [8]}
    _train(relaunched, source, range(2, 4), trained)
    assert trained == reference


def test_a_class_without_state_is_refused_at_startup_unless_accepted(tmp_path, caplog):
    args = _args(tmp_path)
    with pytest.raises(train_side.DataStateRefused, match=r"data source class test_data_state.Opaque .*state_dict"):
        _source(args, "test_data_state.Opaque")
    args = _args(tmp_path)
    source = _source(args, "test_data_state.Opaque", MILES_LORA_CKPT_DATA_STATE_ACCEPT_NONE="true")
    staged = source.rollout_done(0)
    assert json.loads(staged.read_text())["data_state"]["state"] is None


def test_a_generation_without_data_state_resumes_with_a_warning_naming_what_it_lacks(tmp_path, caplog):
    args = _args(tmp_path)
    root = resume.save_root(load_config({}), args.save)
    _commit(root, 1)
    resume.write_megatron_tracker(args.save, 1)
    source = _source(_args(tmp_path, load=args.save))
    with caplog.at_level(logging.WARNING):
        source.load(1)
    assert "holds no rollout data state" in caplog.text and "buffered samples" in caplog.text
    assert source.inner.cursor == 0


def test_a_stock_pt_is_read_weights_only_or_refused_naming_it(tmp_path):
    args = _args(tmp_path)
    root = resume.save_root(load_config({}), args.save)
    _commit(root, 1)
    resume.write_megatron_tracker(args.save, 1)
    stock = tmp_path / "save" / "rollout" / "global_dataset_state_dict_1.pt"
    stock.parent.mkdir(parents=True)
    torch.save({"sample_offset": 12, "epoch_id": 0, "sample_group_index": 12, "sample_index": 24}, stock)
    path, state = stock, data_source.read_stock_state(stock)
    assert state["sample_offset"] == 12
    torch.save({"sample_offset": Counting}, stock)  # a pickled class: only an unpickler would build it
    with pytest.raises(
        train_side.DataStateRefused, match=rf"{path}: cannot be read with torch.load\(weights_only=True\)"
    ):
        data_source.read_stock_state(stock)


def test_a_rollout_function_class_is_refused(tmp_path):
    with pytest.raises(train_side.DataStateRefused, match="is a class"):
        _source(_args(tmp_path, rollout_function_path="test_data_state.Counting"))
