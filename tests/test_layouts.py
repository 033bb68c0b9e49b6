"""Parallel layouts without megatron: the harness's layout rules, the CP split, the demo's layout
flags (invalid combinations exit 2 before any worker starts) and how a layout change is named."""

from __future__ import annotations

import pytest

from miles_lora_ckpt.core.layout import Topology
from miles_lora_ckpt.tools.cli import main as cli
from miles_lora_ckpt_harness.sim.layout import check_layout, cp_positions, layers_for


@pytest.mark.parametrize(
    "layout",
    [
        dict(world_size=2),
        dict(world_size=4, cp=2),
        dict(world_size=2, cp=2),
        dict(world_size=4, cp=2, ep=2),
        dict(world_size=2, pp=2, vpp=2, num_layers=4),
        dict(world_size=4, tp=2, ep=2),
        dict(world_size=8, tp=2, cp=2, pp=2, vpp=2, num_layers=4),
        # an expert-TP other than TP (megatron's expert_tensor_parallel_size): above TP (its group
        # spans DP or CP replicas) and below it (each TP rank runs the experts on its part of the tokens)
        dict(world_size=2, etp=2),
        dict(world_size=2, cp=2, etp=2),
        dict(world_size=4, cp=2, etp=2),
        dict(world_size=2, tp=2, etp=1),
        dict(world_size=2, tp=2, etp=1, ep=2),
        dict(world_size=4, etp=2, ep=2),
        dict(world_size=4, etp=2, pp=2),
        dict(world_size=4, tp=2, etp=2),  # equal to TP: megatron's default
    ],
)
def test_layouts_the_harness_runs(layout):
    check_layout(**layout)


@pytest.mark.parametrize(
    "layout, words",
    [
        (dict(world_size=3, cp=2), "not divisible by tp*cp*pp"),
        (dict(world_size=2, vpp=2, num_layers=4), "needs pp >= 2"),
        (dict(world_size=2, pp=2, vpp=2, num_layers=2), "num_layers=2 is not divisible by pp*vpp"),
        (dict(world_size=4, tp=4), "tp must be 1 or 2"),
        (dict(world_size=2, ep=4), "not divisible by etp*ep = 1*4"),
        (dict(world_size=2, etp=2, ep=2), "not divisible by etp*ep = 2*2"),
        (dict(world_size=2, etp=4), "etp must be 1 or 2"),
        (dict(world_size=2, etp=0), "etp must be a positive integer"),
        (dict(world_size=2, tp=2, etp=1, ep=4), "not divisible by etp*ep = 1*4"),
        (dict(world_size=2, cp=2, etp=2, ep=2), "not divisible by etp*ep = 2*2"),
        (dict(world_size=4, cp=4, seq_length=4), "seq_length=4 is not divisible by 2*cp"),
        (dict(world_size=2, cp=0), "cp must be a positive integer"),
    ],
)
def test_invalid_layouts_are_named(layout, words):
    with pytest.raises(ValueError, match=words.replace("*", r"\*")):
        check_layout(**layout)


def test_cp_split_is_megatrons_load_balanced_split():
    assert cp_positions(4, 1, 0) == [0, 1, 2, 3]
    assert [cp_positions(4, 2, r) for r in range(2)] == [[0, 3], [1, 2]]
    parts = [cp_positions(16, 4, r) for r in range(4)]
    assert parts[0] == [0, 1, 14, 15] and parts[3] == [6, 7, 8, 9]
    assert sorted(p for part in parts for p in part) == list(range(16))


def test_layers_for_gives_every_chunk_the_same_number():
    assert [layers_for(1, 1), layers_for(2, 1), layers_for(2, 2), layers_for(4, 2)] == [2, 2, 4, 8]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--cp", "2", "--world-size", "3"], "world size 3 is not divisible by tp*cp*pp = 1*2*1"),
        (["--vpp", "2"], "vpp=2 needs pp >= 2"),
        (["--tp", "3", "--world-size", "3"], "tp must be 1 or 2"),
        (["--ep", "2", "--pp", "2"], "not divisible by etp*ep"),
        (["--pp", "0"], "pp must be a positive integer"),
        (["--etp", "2", "--tp", "2", "--ep", "2"], "not divisible by etp*ep = 2*2"),
    ],
)
def test_demo_refuses_invalid_layouts_with_exit_2(flags, words, tmp_path, capsys):
    assert cli(["demo", "--workdir", str(tmp_path / "w"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ERROR invalid layout: ") and words in err and "Traceback" not in err, err
    assert not (tmp_path / "w").exists()  # refused before anything was started or written


def test_a_layout_change_names_each_axis():
    saved = Topology(world=4, dp=2, cp=2)
    assert saved.model_parallel_differences(Topology(world=4, dp=4)) == ["cp: 2 -> 1 (context parallel)"]
    staged = Topology(world=2, pp=2, vpp=2)
    assert staged.model_parallel_differences(Topology(world=2, pp=2)) == ["vpp: 2 -> 1 (virtual pipeline chunks)"]
    assert Topology(world=2, dp=2).model_parallel_differences(Topology(world=4, dp=4)) == []  # DP alone may change


@pytest.mark.parametrize(
    "flags, layout, dp",
    [
        ([], dict(tp=1, pp=1, ep=1, cp=1, vpp=1, num_layers=2), 2),
        (["--cp", "2", "--world-size", "4"], dict(cp=2), 2),
        (["--vpp", "2", "--pp", "2"], dict(pp=2, vpp=2, num_layers=4), 1),
        (["--tp", "2", "--ep", "2", "--world-size", "4"], dict(tp=2, ep=2), 2),
        (["--pp", "2", "--ep", "2", "--world-size", "4"], dict(pp=2, ep=2), 2),
    ],
)
def test_demo_layout_flags_reach_the_workers_config(flags, layout, dp, tmp_path, monkeypatch, capsys):
    from miles_lora_ckpt_harness.demo import command as demo
    from miles_lora_ckpt_harness.sim.model import SimConfig

    seen = []
    monkeypatch.setattr(demo, "_phase_reference", lambda workdir, config, args: seen.append(config))
    assert cli(["demo", "--workdir", str(tmp_path), "--phase", "reference", *flags]) == 0
    (config,) = seen
    assert {k: config[k] for k in layout} == layout
    assert SimConfig.from_dict(config).dp == dp  # what every worker builds from it
    assert f"dp{dp}" in capsys.readouterr().out
