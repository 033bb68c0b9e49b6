"""PEFT export without megatron or PEFT: the format and self-check, the Bridge adapter, the phases
in one process (faults at each phase), `verify` of exports, `export-peft` of a committed export."""

from __future__ import annotations

import collections
import inspect
import json
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miles_lora_ckpt.core import faults, json_files
from miles_lora_ckpt.core.consensus import Consensus
from miles_lora_ckpt.core.errors import CheckpointError
from miles_lora_ckpt.core.layout import LEASE, MANIFEST, TRACKER, Topology
from miles_lora_ckpt.core.protocol import save_generation
from miles_lora_ckpt.megatron import bridge_export as bx
from miles_lora_ckpt.savers.peft_export import (
    CONFIG_NAME,
    FAULT_PHASES,
    LATEST,
    WEIGHTS_NAME,
    ExportedWeight,
    LoraSpec,
    StaticSource,
    check_peft_dir,
    export_peft,
)
from miles_lora_ckpt.savers.peft_export import format as fmt
from miles_lora_ckpt.savers.peft_export.convert import Coverage, PeftFiles, convert_and_check
from miles_lora_ckpt.tools.cli import main as cli

H, R = 8, 2
SHAPES = {"q_proj": 8, "k_proj": 4, "v_proj": 4, "o_proj": 8, "gate_proj": 12, "up_proj": 12, "down_proj": 8}
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


def weights(layers=(0, 1), modules=tuple(SHAPES), rank=R, seed=0) -> list[ExportedWeight]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in layers:
        for module in modules:
            base = f"model.layers.{layer}.{BLOCK.get(module, 'mlp')}.{module}"
            in_size = 12 if module == "down_proj" else H
            out.append(ExportedWeight(f"{base}.lora_A.weight", torch.randn(rank, in_size, generator=gen)))
            out.append(ExportedWeight(f"{base}.lora_B.weight", torch.randn(SHAPES[module], rank, generator=gen)))
    return out


LORA = LoraSpec(r=R, alpha=4.0)
FULL = Coverage(modules=8, layers=2, uniform=True, num_layers=2)  # 4 Megatron modules per layer


def convert(items, coverage=FULL, config=None):
    return convert_and_check(items, LORA, coverage, StaticSource(items), config)


# --------------------------------------------------------------------------- format and self-check


def test_names_and_peft_matching_rules():
    assert fmt.split_lora_name("model.layers.0.mlp.up_proj.lora_B.weight") == ("model.layers.0.mlp.up_proj", "B")
    with pytest.raises(ValueError, match="not a LoRA weight name"):
        fmt.split_lora_name("model.layers.0.mlp.up_proj.lora_A.default.weight")  # adapter name in the key
    assert fmt.unprefixed("base_model.model.model.x.lora_A.weight") == "model.x.lora_A.weight"
    assert fmt.module_kind("model.layers.12.self_attn.q_proj") == "model.layers.*.self_attn.q_proj"
    assert fmt.is_targeted("model.layers.0.self_attn.q_proj", ["q_proj"])
    assert not fmt.is_targeted("model.layers.0.self_attn.q_proj", ["proj"])  # suffix after a dot only
    assert fmt.is_targeted("model.layers.0.self_attn.q_proj", ["model.layers.0.self_attn.q_proj"])
    assert fmt.is_targeted("model.layers.0.self_attn.q_proj", r".*\.q_proj")  # a string is a full regex
    pattern = {"model.layers.1.self_attn.q_proj": 8, "q_proj": 6}
    assert fmt.rank_for("model.layers.1.self_attn.q_proj", 4, pattern) == 8  # the first match wins, as in PEFT
    assert fmt.rank_for("model.layers.0.self_attn.q_proj", 4, pattern) == 6
    assert fmt.rank_for("model.layers.11.self_attn.q_proj", 4, {"model.layers.1.self_attn.q_proj": 8}) == 4
    assert fmt.rank_for("model.layers.0.mlp.up_proj", 4, pattern) == 4


def test_our_helpers_and_exact_target_modules():
    items = weights()
    state, names, params = fmt.to_peft_state(items)
    assert params == [] and len(state) == len(items) == 28
    assert all(k.startswith("base_model.model.model.layers.") for k in state)
    assert fmt.infer_target_modules(names) == sorted(SHAPES)
    assert fmt.infer_rank_pattern(items, default_rank=R) == {}
    odd = [*items[:-2], *weights(layers=(1,), modules=("down_proj",), rank=3)]
    assert fmt.infer_rank_pattern(odd, default_rank=R) == {"model.layers.1.mlp.down_proj": 3}
    with pytest.raises(ValueError, match="inconsistent LoRA ranks"):
        fmt.infer_rank_pattern([items[0], ExportedWeight(items[1].param_name, torch.zeros(8, 5))], default_rank=R)
    modules = sorted({fmt.split_lora_name(n)[0] for n in names})
    assert not fmt.exact_target_modules_needed(modules, 2)
    assert fmt.exact_target_modules_needed(modules, 3)  # the base has a third layer the export lacks
    assert fmt.exact_target_modules_needed([m for m in modules if m != "model.layers.1.mlp.up_proj"], None)
    assert fmt.exact_target_modules_needed(["model.embed_tokens"], None)


def test_structure_problems_name_every_way_peft_would_load_wrongly():
    state, _, _ = fmt.to_peft_state(weights())
    shapes = {k: ("F32", list(v.shape)) for k, v in state.items()}
    config = fmt.build_config(LORA, sorted(SHAPES))
    assert fmt.structure_problems(shapes, config) == []
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = {
        "lora_B is missing": lambda s, c: s.pop(q_a.replace("lora_A", "lora_B")),
        "PEFT gives this module rank 2": lambda s, c: s.__setitem__(q_a, ("F32", [3, H])),
        "does not adapt this module": lambda s, c: c.__setitem__("target_modules", ["k_proj"]),
        "does not start with": lambda s, c: s.__setitem__("model.x.lora_A.weight", ("F32", [R, H])),
        "fused 3-D expert stack": lambda s, c: s.__setitem__(
            "base_model.model.model.layers.0.mlp.experts.gate_up_proj.lora_A.weight", ("F32", [4, R, H])
        ),
        "not a floating type": lambda s, c: s.__setitem__(q_a, ("I64", [R, H])),
        "DoRA magnitudes are not exported": lambda s, c: c.__setitem__("use_dora", True),
        "PEFT would adapt nothing": lambda s, c: c.__setitem__("target_modules", []),
        "peft_type": lambda s, c: c.__setitem__("peft_type", "IA3"),
        "r is": lambda s, c: c.__setitem__("r", 0),
    }
    for expected, damage in cases.items():
        s, c = dict(shapes), json.loads(json.dumps(config))
        damage(s, c)
        problems = fmt.structure_problems(s, c)
        assert any(expected in p for p in problems), (expected, problems)
    assert "holds no tensors" in fmt.structure_problems({}, config)[0]
    # rank_pattern: a module of another rank is fine once the pattern says so
    s = dict(shapes)
    s[q_a] = ("F32", [3, H])
    s[q_a.replace("lora_A", "lora_B")] = ("F32", [8, 3])
    assert fmt.structure_problems(s, dict(config, rank_pattern={"model.layers.0.self_attn.q_proj": 3})) == []
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        bad = dict(state)
        bad[q_a] = torch.full((R, H), float("nan"))
        fmt.check_state(bad, config)


def test_convert_and_check_refuses_empty_partial_fused_and_dora():
    files = convert(weights())
    assert files.config["target_modules"] == sorted(SHAPES) and files.config["rank_pattern"] == {}
    assert files.provenance == {"source": "offline", "bridge_helpers": []}
    refusals = {
        "no adapter weights": [],
        "more than once": weights() + weights()[:1],
        "fused 3-D expert stack": [
            ExportedWeight("model.layers.0.mlp.experts.gate_up_proj.lora_A.weight", torch.zeros(4, R, H))
        ],
        "lora_B is missing": weights()[:-1],  # one factor lost: coverage still counts the module
        "partial adapter export": weights(layers=(0,)),  # a pipeline stage's layers lost
    }
    for expected, items in refusals.items():
        with pytest.raises(ValueError, match=expected):
            convert(items)
    with pytest.raises(ValueError, match="layer 1 lacks"):
        convert([w for w in weights() if "layers.1.mlp.down_proj" not in w.param_name])
    with pytest.raises(ValueError, match="DoRA"):
        convert_and_check(weights(), LoraSpec(r=R, alpha=1.0, use_dora=True), None, StaticSource([]))
    # a model whose adapters cover only some layers gets exact module paths in target_modules
    partial_model = Coverage(modules=4, layers=1, uniform=True, num_layers=2)
    exact = convert(weights(layers=(1,)), partial_model)
    assert exact.config["target_modules"][0] == "model.layers.1.mlp.down_proj"
    # names Bridge's fork prefixes itself are accepted
    prefixed = [ExportedWeight("base_model.model." + w.param_name, w.weight) for w in weights()]
    assert sorted(convert(prefixed).state) == sorted(files.state)


# --------------------------------------------------------------------------- the Bridge adapter


class NamedTuple2(tuple):
    param_name = property(lambda self: self[0])
    weight = property(lambda self: self[1])


def test_both_bridge_tuple_shapes_are_read_and_others_refused():
    t = torch.zeros(2, 3)
    assert bx.normalize_item(NamedTuple2(("a.lora_A.weight", t))) == ExportedWeight("a.lora_A.weight", t)
    assert bx.normalize_item(("a.lora_A.weight", t)).megatron_name is None
    assert bx.normalize_item(("a.lora_A.weight", t, "decoder.x")).megatron_name == "decoder.x"
    for bad in (("a",), ("a", t, "m", 4), "a.lora_A.weight", (t, "a"), ("a", t, 7), ("a", t, ("m", 1))):
        with pytest.raises(TypeError, match="Bridge's export yielded"):
            bx.normalize_item(bad)


HFSourcedWeightTuple = collections.namedtuple("HFSourcedWeightTuple", ["param_name", "weight", "megatron_param_names"])


def test_the_indexed_forks_tuple_of_megatron_names_is_read_as_names_not_as_one_string():
    t = torch.zeros(2, 3)
    fused = ("decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight", "decoder.x.linear_in.weight")
    for item in (
        HFSourcedWeightTuple("a.lora_A.weight", t, fused),
        ("a.lora_A.weight", t, fused),
        ("a.lora_A.weight", t, list(fused)),
    ):
        read = bx.normalize_item(item)
        assert read.megatron_param_names == fused and read.megatron_name is None, item
    single = bx.normalize_item(HFSourcedWeightTuple("a.lora_A.weight", t, (fused[0],)))
    assert single.megatron_param_names == (fused[0],) and single.megatron_name == fused[0]
    assert bx.normalize_item(("a.lora_A.weight", t, "decoder.x")).megatron_param_names == ("decoder.x",)
    assert bx.normalize_item(("a.lora_A.weight", t)).megatron_param_names == ()


class _Nvidia062:
    """The 0.6.2 signature (no expand_shared_outer)."""

    def export_adapter_weights(self, model, cpu=True, show_progress=True, exclude_adapter_base_prefixes=None):
        yield ("a.lora_A.weight", torch.zeros(1, 1))


class _Main(_Nvidia062):
    def export_adapter_weights(
        self, model, cpu=True, show_progress=True, exclude_adapter_base_prefixes=None, expand_shared_outer=False
    ):
        yield ("a.lora_A.weight", torch.zeros(1, 1))


class _Fork:
    def export_adapter_weights(self, model, cpu=True, show_progress=True):
        yield ("a.lora_A.weight", torch.zeros(1, 1), "decoder.a")


def test_bridge_source_passes_the_export_keywords_it_documents_and_refuses_missing_ones():
    from miles_lora_ckpt.megatron.bridge_export import BridgeSource

    def bound(bridge, **options):
        source = BridgeSource(bridge, **options)
        source.prepare()
        return source._kwargs

    plain = {"cpu": True, "show_progress": False}
    assert bound(_Fork()) == bound(_Nvidia062()) == bound(_Main()) == plain
    prefixes = {"exclude_adapter_base_prefixes": ["decoder.layers.1"]}
    assert bound(_Nvidia062(), exclude_adapter_base_prefixes=("decoder.layers.1",)) == plain | prefixes
    assert bound(_Main(), expand_shared_outer=True) == plain | {"expand_shared_outer": True}
    with pytest.raises(TypeError, match="has no parameter expand_shared_outer"):
        bound(_Nvidia062(), expand_shared_outer=False)
    with pytest.raises(TypeError, match="has no parameter exclude_adapter_base_prefixes"):
        bound(_Fork(), exclude_adapter_base_prefixes=["decoder.layers.1"])


def test_optional_parameters_are_checked_by_signature():
    def nvidia(model, cpu=True, show_progress=True, exclude_adapter_base_prefixes=None, expand_shared_outer=False):
        pass

    def fork(model, cpu=True, show_progress=True):
        pass

    def anything(model, **kwargs):
        pass

    options = {"cpu": True, "show_progress": False}
    assert bx.bind_options(fork, required={}, optional=options) == options
    assert bx.bind_options(nvidia, required={"exclude_adapter_base_prefixes": ["x"]}, optional={"cpu": True}) == {
        "exclude_adapter_base_prefixes": ["x"],
        "cpu": True,
    }
    with pytest.raises(TypeError, match="has no parameter exclude_adapter_base_prefixes"):
        bx.bind_options(fork, required={"exclude_adapter_base_prefixes": ["x"]}, optional={})
    assert bx.bind_options(anything, required={"expand_shared_outer": True}, optional={"zzz": 1}) == {
        "expand_shared_outer": True
    }


class FakeBridge:
    """Yields `items`; records how far a caller iterated (a real Bridge would hang peers that stop early)."""

    def __init__(self, items):
        self.items, self.consumed = items, 0

    def export_adapter_weights(self, model, cpu=True):
        for item in self.items:
            self.consumed += 1
            yield item


def test_bridge_source_drains_the_export_after_an_error():
    t = torch.zeros(2, 3)
    bridge = FakeBridge([("a.lora_A.weight", t), ("broken",), ("b.lora_A.weight", t), ("c.lora_A.weight", t)])
    source = bx.BridgeSource(bridge)
    with pytest.raises(RuntimeError, match="before prepare"):
        source.export(None)
    source.prepare()
    with pytest.raises(TypeError, match="1 items"):
        source.export(None)
    assert bridge.consumed == 4  # every item was pulled: this rank stayed in every collective
    seen = []

    def on_item(index, weight):
        seen.append(index)
        if index == 1:
            raise ValueError("boom on item 1")

    bridge = FakeBridge([("a.lora_A.weight", t)] * 3)
    source = bx.BridgeSource(bridge)
    source.prepare()
    with pytest.raises(ValueError, match="boom on item 1"):
        source.export(None, on_item)
    assert seen == [0, 1] and bridge.consumed == 3
    with pytest.raises(TypeError, match="has no export_adapter_weights"):
        bx.BridgeSource(object()).prepare()
    with pytest.raises(ValueError, match="needs a bridge or an hf_checkpoint"):
        bx.BridgeSource()


def test_without_bridge_our_helpers_are_used_and_the_reason_is_known():
    assert bx.import_error() is not None  # megatron.bridge does not import in this process
    assert bx.peft_helpers() == bx.PeftHelpers()
    with pytest.raises(ModuleNotFoundError):
        bx.BridgeSource(hf_checkpoint="/nowhere").prepare()


def test_bridge_helpers_are_used_where_present_and_checked_by_signature(monkeypatch):
    calls = []

    def convert(adapter_weights):
        calls.append("convert")
        return fmt.to_peft_state(adapter_weights)

    def build_old(peft_config, target_modules, base_model_name_or_path=None):  # no rank_pattern parameter
        calls.append("build")
        return fmt.build_config(LoraSpec(r=peft_config.dim, alpha=peft_config.alpha), target_modules)

    module = SimpleNamespace(
        convert_adapter_weights_to_peft_state=convert,
        infer_target_modules_from_adapter_weights=lambda wrong_name: [],  # signature not recognised
        build_adapter_config_dict=build_old,
    )
    monkeypatch.setattr(bx.importlib, "import_module", lambda name: module)
    helpers = bx.peft_helpers()
    assert helpers.convert is convert and helpers.target_modules is None and helpers.rank_pattern is None
    assert helpers.build_config_options == ("base_model_name_or_path",)
    source = SimpleNamespace(kind="megatron-bridge", conversion_helpers=lambda: helpers)
    files = convert_and_check(weights(), LORA, FULL, source)
    assert calls == ["convert", "build"] and files.provenance["bridge_helpers"] == ["convert", "build_config"]
    # a rank pattern the old builder cannot carry: our builder is used instead
    odd = [*weights()[:-2], *weights(layers=(1,), modules=("down_proj",), rank=3)]
    files = convert_and_check(odd, LORA, FULL, source)
    assert files.config["rank_pattern"] == {"model.layers.1.mlp.down_proj": 3}
    assert "build_config" not in files.provenance["bridge_helpers"]


# --------------------------------------------------------------------------- the phases, one process


def export(root, items=None, iteration=1, **kwargs) -> Path:
    items = weights(seed=iteration) if items is None else items
    return export_peft(
        None,
        root,
        source=StaticSource(items),
        lora=LORA,
        iteration=iteration,
        consensus=Consensus.single_process(),
        **kwargs,
    )


def test_export_root_publishes_readable_files_and_latest(tmp_path):
    root = tmp_path / "exports"
    umask = os.umask(0o022)  # the usual umask: a server running as another user can read the adapter
    try:
        first = export(root, iteration=1)
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(1)}, str(tmp_path / "library.safetensors"))
    finally:
        os.umask(umask)
    assert (tmp_path / "library.safetensors").stat().st_mode & 0o777 == 0o600  # what we must not do
    assert sorted(os.listdir(first)) == sorted([CONFIG_NAME, MANIFEST, WEIGHTS_NAME])
    assert (root / LATEST).resolve() == first.resolve() and os.readlink(root / LATEST) == first.name
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        assert (first / name).stat().st_mode & 0o777 == 0o644, name
    from safetensors import safe_open

    manifest = json.loads((first / MANIFEST).read_text())
    with safe_open(str(first / WEIGHTS_NAME), "pt") as handle:  # PEFT's `format: pt`, and the protocol's stamp
        assert handle.metadata() == {
            "format": "pt",
            "generation": manifest["generation"],
            "file": WEIGHTS_NAME,
            **fmt.WEIGHTS_BINDING,
        }
        assert len(list(handle.keys())) == 28
    # an export root is a save root under the format v2 rules: sequence, bindings, tracker, lease
    assert manifest["format_version"] == 3 and manifest["sequence"] == 1 and manifest["saver"] == "peft-export"
    assert manifest["files"][WEIGHTS_NAME]["binding"] == fmt.WEIGHTS_BINDING
    assert manifest["files"][CONFIG_NAME]["binding"] == fmt.CONFIG_BINDING
    assert check_peft_dir(first) == []
    second = export(root, iteration=2, keep=1)
    assert os.readlink(root / LATEST) == second.name and not first.exists()
    tracker = json.loads((root / TRACKER).read_text())
    assert tracker["generation_dir"] == second.name and tracker["sequence"] == 2
    assert json.loads((root / LEASE).read_text())["holder"]["pid"] == os.getpid()
    assert cli(["verify", str(root)]) == 0 and cli(["verify", str(root / LATEST)]) == 0
    (root / "escape").symlink_to(tmp_path)  # a symlink elsewhere is not followed
    os.replace(root / "escape", root / LATEST)
    assert cli(["verify", str(root / LATEST)]) != 0


def entries(root: Path) -> dict[str, int]:
    """The root's entries and mtimes, without the writer lease (renewed in the background)."""
    return {p.name: p.lstat().st_mtime_ns for p in root.iterdir() if not p.name.startswith(LEASE)}


@pytest.mark.parametrize("phase", FAULT_PHASES)
def test_a_fault_at_each_phase_leaves_the_previous_export_intact(phase, tmp_path):
    root = tmp_path / "exports"
    first = export(root, iteration=1)
    before = entries(root)
    faults.arm(phase, 0)
    try:
        with pytest.raises(CheckpointError, match=f"injected fault at phase '{phase}' on rank 0"):
            export(root, iteration=2)
    finally:
        faults.disarm()
    after = entries(root)
    if phase == "after-publish":  # fires after the coordinator published: complete, and named by latest
        (added,) = set(after) - set(before)
        assert added.startswith("gen-000000002-") and os.readlink(root / LATEST) == added
        assert sorted(n for n in before if before[n] != after[n]) == sorted([LATEST, TRACKER])
    else:
        assert after == before  # no staging left, nothing new, tracker and latest untouched
        assert os.readlink(root / LATEST) == first.name
    assert cli(["verify", str(root), "--all"]) == 0


def test_an_empty_or_refused_export_leaves_no_staging_and_no_generation(tmp_path):
    with pytest.raises(CheckpointError, match="no adapter weights"):
        export(tmp_path / "empty", items=[])
    assert list(entries(tmp_path / "empty")) == []  # the staging directory was removed (the lease stays ours)
    root = tmp_path / "fused"
    export(root, iteration=1)
    stack = [ExportedWeight("model.layers.0.mlp.experts.gate_up_proj.lora_A.weight", torch.zeros(4, R, H))]
    with pytest.raises(CheckpointError, match="fused 3-D expert stack"):
        export(root, items=stack, iteration=2)
    assert sorted(n for n in entries(root) if n.startswith(".")) == []


def test_verify_refuses_a_config_whose_patterns_are_not_regular_expressions(tmp_path, capsys):
    """PEFT reads a string `target_modules` and every `rank_pattern` key as regular expressions: one
    that does not compile is a clear refusal of that file (exit 1), never a crash of verify."""
    for field, value in (("target_modules", "(q_proj"), ("rank_pattern", {"q_proj[": 3})):
        gen = export(tmp_path / field, iteration=1)
        config = json.loads((gen / CONFIG_NAME).read_text())
        config[field] = value
        reseal(gen, CONFIG_NAME, json.dumps(config).encode())
        capsys.readouterr()
        assert cli(["verify", str(gen)]) == 1, field
        out = capsys.readouterr()
        assert f"ERROR {CONFIG_NAME}: {field} " in out.out and "not a valid regular expression" in out.out, out
        assert "INTERNAL ERROR" not in out.err, out
        problems = fmt.structure_problems({}, config)
        assert any("not a valid regular expression" in p for p in problems), problems


def test_verify_checks_exports_and_a_checkpoints_peft_dir(tmp_path, capsys):
    root = tmp_path / "exports"
    gen = export(root, iteration=1)
    # a PEFT problem that digests cannot see: the config no longer adapts the modules (resealed manifest)
    config = json.loads((gen / CONFIG_NAME).read_text())
    config["target_modules"] = ["q_proj"]
    reseal(gen, CONFIG_NAME, json.dumps(config).encode())
    assert cli(["verify", str(gen)]) == 1
    assert "does not adapt this module" in capsys.readouterr().out
    # a checkpoint generation holding peft/ (written by any saver through the protocol)
    files = convert(weights())
    ckpt = save_generation(
        Consensus.single_process(),
        tmp_path / "ckpt",
        iteration=3,
        saver="test",
        topology=Topology(),
        write_files=lambda w: files.write(w, "peft/"),
    )
    assert cli(["verify", str(ckpt)]) == 0
    reseal(ckpt, "peft/" + CONFIG_NAME, None)
    assert cli(["verify", str(ckpt)]) == 1
    assert "peft/adapter_config.json: missing: a PEFT adapter needs both files" in capsys.readouterr().out


def test_both_placements_follow_the_v2_rules_lease_signature_and_stamps(tmp_path, capsys):
    """What the export gets from the protocol: one writer per root, optional signing, stamped files."""
    import shutil

    from miles_lora_ckpt.core import lease, settings

    root = tmp_path / "exports"
    key = "peft-signing-key-0123456789abcdef"
    with settings.overridden(hmac_key=key):
        first = export(root, iteration=1)
        capsys.readouterr()
        assert cli(["verify", str(root / LATEST)]) == 0 and "signed (verified)" in capsys.readouterr().out
    assert cli(["--hmac-key-file", str(tmp_path / "missing.key"), "verify", str(root)]) == 2
    # another live writer holds the export root: refused at prepare, before the export runs
    lease.release(root)
    holder = {"host": "other-host", "pid": 4242, "run": "b", "token": "00ff00ff00ff00ff", "boot_id": "x"}
    (root / LEASE).write_text(json.dumps({"format": "miles-lora-ckpt-lease", "holder": holder, "timeout_s": 60.0}))
    before = entries(root)
    exported = []
    source = StaticSource(weights(seed=2))
    source.export = lambda model, on_item=None: exported.append(1) or []
    with pytest.raises(CheckpointError, match="(?s)phase 'prepare'.*has another writer.*other-host pid 4242"):
        export_peft(None, root, source=source, lora=LORA, iteration=2, consensus=Consensus.single_process())
    assert entries(root) == before and exported == []
    (root / LEASE).unlink()
    # a checkpoint's peft/ weights swapped for an export's (same bytes in the manifest's eyes): the stamp says so
    files = convert(weights(seed=1))
    ckpt = save_generation(
        Consensus.single_process(),
        tmp_path / "ckpt",
        iteration=3,
        saver="test",
        topology=Topology(),
        write_files=lambda w: files.write(w, "peft/"),
    )
    shutil.copy(first / WEIGHTS_NAME, tmp_path / "stolen")
    reseal(ckpt, "peft/" + WEIGHTS_NAME, (tmp_path / "stolen").read_bytes())
    capsys.readouterr()
    assert cli(["verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert "peft/adapter_model.safetensors" in out and "copied from another generation" in out


def reseal(gen: Path, rel: str, content: bytes | None) -> None:
    """Rewrite (or drop) one file and re-seal the manifest, as a careless tool would."""
    from miles_lora_ckpt.core.atomic_files import write_file_atomic
    from miles_lora_ckpt.core.layout import FileRecord, Manifest

    manifest = Manifest.from_json_bytes((gen / MANIFEST).read_bytes())
    (gen / rel).unlink()
    if content is None:
        del manifest.files[rel]
    else:
        record = write_file_atomic(gen / rel, [content])
        manifest.files[rel] = FileRecord(record.bytes, record.digest)
    (gen / MANIFEST).write_bytes(manifest.to_json_bytes())


def test_export_peft_republishes_a_checkpoints_export_offline(tmp_path, capsys):
    files = convert(weights())
    ckpt_root = tmp_path / "ckpt"
    save_generation(
        Consensus.single_process(),
        ckpt_root,
        iteration=7,
        saver="test",
        topology=Topology(),
        write_files=lambda w: (files.write(w, "peft/"), w.write_json("other.json", {})),
    )
    out = tmp_path / "serve"
    assert cli(["export-peft", str(ckpt_root), "--out", str(out)]) == 0
    published = (out / LATEST).resolve()
    assert published.name.startswith("gen-000000007-")
    assert (published / CONFIG_NAME).read_bytes() == (next(ckpt_root.glob("gen-*")) / "peft" / CONFIG_NAME).read_bytes()
    from miles_lora_ckpt.core.checked_reads import load_tensors

    got, _ = load_tensors(published / WEIGHTS_NAME)
    assert sorted(got) == sorted(files.state) and all(torch.equal(got[k], files.state[k]) for k in got)
    capsys.readouterr()
    # no peft/ and no --base: the shards cannot be mapped without the model's config
    plain = save_generation(
        Consensus.single_process(),
        tmp_path / "plain",
        iteration=1,
        saver="test",
        topology=Topology(),
        write_files=lambda w: w.write_json("x.json", {}),
    )
    assert cli(["export-peft", str(plain), "--out", str(tmp_path / "o2")]) == 1
    assert "pass --base HF_MODEL_DIR" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()
    assert cli(["export-peft", str(tmp_path / "nothing"), "--out", str(tmp_path / "o3")]) == 2


def test_peft_files_write_weights_before_the_config(tmp_path):
    files = PeftFiles(state=fmt.to_peft_state(weights())[0], config=fmt.build_config(LORA, sorted(SHAPES)))
    order = []
    writer = SimpleNamespace(
        rank=0,
        write_tensors=lambda rel, *a, **k: order.append(rel),
        write_bytes=lambda rel, data, **k: order.append(rel),
    )
    files.write(writer, "peft/")
    assert order == ["peft/" + WEIGHTS_NAME, "peft/" + CONFIG_NAME]
    # the protocol's mid-write fires after a rank's first file: here between the weights and the config
    assert set(FAULT_PHASES) <= set(faults.PHASES) and set(faults.PEFT_PHASES) < set(FAULT_PHASES)
    assert FAULT_PHASES.index("after-prepare") < FAULT_PHASES.index("peft-export") < FAULT_PHASES.index("mid-write")
    assert "exclude_adapter_base_prefixes" not in inspect.signature(bx.BridgeSource.export).parameters


def test_a_slot_export_slices_each_weight_to_the_slot_rank_through_the_source():
    """What multi-LoRA does per slot: padded factors cut to the slot's rank, errors after draining."""
    padded = []
    for w in weights():
        pad = [4, w.weight.shape[1]] if "lora_A" in w.param_name else [w.weight.shape[0], 4]
        grown = torch.zeros(pad)
        grown[: w.weight.shape[0], : w.weight.shape[1]] = w.weight
        padded.append((w.param_name, grown))
    cut = lambda w: ExportedWeight(w.param_name, fmt.slice_to_rank(w.param_name, w.weight, R))  # noqa: E731
    bridge = FakeBridge(padded)
    source = bx.BridgeSource(bridge, transform=cut)
    source.prepare()
    sliced = source.export(None)
    assert [w.weight.shape for w in sliced] == [w.weight.shape for w in weights()]
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(sliced, weights(), strict=True))
    assert convert(sliced).config["r"] == R
    padded[3] = (padded[3][0], padded[3][1] + 1.0)  # a slot whose padding is not zero
    bridge = FakeBridge(padded)
    source = bx.BridgeSource(bridge, transform=cut)
    source.prepare()
    with pytest.raises(ValueError, match="non-zero values beyond rank 2"):
        source.export(None)
    assert bridge.consumed == len(padded)


def test_the_config_is_written_in_bridges_own_bytes_whoever_built_it(tmp_path):
    """`adapter_config.json` is written as Bridge's `save_hf_adapter` writes it (`json.dump(config,
    f, indent=2)`, the builder's key order), whether our `build_config` or Bridge's
    `build_adapter_config_dict` built it (here the double's copy of it; the real 0.6.2's bytes are
    compared in tests/test_bridge_real.py); a non-finite number is refused."""
    from miles_lora_ckpt_harness.bridge_double import peft_bridge as double_helpers

    targets = sorted(fmt.infer_target_modules([w.param_name for w in weights()]))
    ours = fmt.build_config(replace(LORA, base_model_name_or_path="/base"), targets)
    bridge_config = SimpleNamespace(dim=LORA.r, alpha=LORA.alpha, dropout=LORA.dropout)
    theirs = double_helpers.build_adapter_config_dict(bridge_config, targets, base_model_name_or_path="/base")
    assert fmt.config_bytes(ours) == json.dumps(theirs, indent=2).encode() == fmt.config_bytes(theirs)
    assert not fmt.config_bytes(ours).endswith(b"\n") and fmt.config_bytes(ours).startswith(b'{\n  "peft_type"')
    # republished: parsed (order kept) and written again gives the same bytes
    assert fmt.config_bytes(json_files.parse_json(fmt.config_bytes(ours))) == fmt.config_bytes(ours)
    with pytest.raises(ValueError):
        fmt.config_bytes({**ours, "lora_alpha": float("nan")})
