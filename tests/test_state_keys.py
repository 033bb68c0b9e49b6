"""Which tensor state keys each optimizer child keeps: Adam, AdamW, Lion, Muon + its scalar optimizer.

The children here are stand-ins (`FakeChild`) holding a real torch optimizer's state, because the
real megatron children cannot be built without a process group; the end-to-end tests in
test_single_lora.py and test_optimizer_children.py use the real ones. The 0.19 cases use megatron's
own `optimizer_state_keys` property and emerging-optimizers' real Lion and Muon where the installed
tier has them (tier 2), and are skipped on 0.16.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles_lora_ckpt.megatron.optimizer_children import optimizer_kind, resolve_state_keys
from miles_lora_ckpt_harness.sim.lion import Lion

ADAM = ("exp_avg", "exp_avg_sq")
LION = ("exp_avg",)


class FakeChild:
    """The attributes of a DistributedOptimizer child that key resolution reads (0.16: no property)."""

    def __init__(self, inner, optimizer="adam", muon_scalar_optimizer=None):
        self.optimizer = inner
        self.config = SimpleNamespace(optimizer=optimizer)
        if muon_scalar_optimizer is not None:
            self.config.muon_scalar_optimizer = muon_scalar_optimizer


def stepped(optimizer_class, **kwargs):
    param = torch.nn.Parameter(torch.ones(4))
    inner = optimizer_class([param], lr=0.1, **kwargs)
    param.grad = torch.ones(4)
    inner.step()
    return inner


def fresh(optimizer_class):
    return optimizer_class([torch.nn.Parameter(torch.ones(4))], lr=0.1)


@pytest.mark.parametrize(
    "inner, name, scalar, expected",
    [
        (stepped(torch.optim.Adam), "adam", None, ADAM),
        (stepped(torch.optim.AdamW), "adam", None, ADAM),
        (stepped(Lion), "lion", None, LION),
        (fresh(torch.optim.AdamW), "adam", None, ADAM),  # not stepped yet: from the config
        (fresh(Lion), "lion", None, LION),
        (fresh(torch.optim.AdamW), "muon", "adam", ADAM),  # Muon's scalar child keeps its scalar optimizer's keys
        (fresh(Lion), "muon", "lion", LION),
        (stepped(Lion), "muon", "lion", LION),
        (stepped(torch.optim.AdamW, amsgrad=True), "adam", None, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    ],
    ids=[
        "adam",
        "adamw",
        "lion",
        "adamw-fresh",
        "lion-fresh",
        "muon+adam",
        "muon+lion",
        "muon+lion-stepped",
        "adamw-amsgrad",
    ],
)
def test_fallback_resolution_016(inner, name, scalar, expected):
    assert set(resolve_state_keys(FakeChild(inner, name, scalar))) == set(expected)


def _megatron_property():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    prop = getattr(DistributedOptimizer, "optimizer_state_keys", None)
    if not isinstance(prop, property):
        pytest.skip("this megatron-core has no DistributedOptimizer.optimizer_state_keys (0.16); tier 2 runs it")
    return prop


@pytest.mark.megatron
@pytest.mark.parametrize(
    "inner, name, scalar, expected",
    [
        (stepped(torch.optim.Adam), "adam", None, ADAM),
        (stepped(torch.optim.AdamW), "adam", None, ADAM),
        (stepped(Lion), "lion", None, LION),
        (fresh(torch.optim.AdamW), "muon", "adam", ADAM),
        (fresh(Lion), "muon", "lion", LION),
    ],
    ids=["adam", "adamw", "lion", "muon+adam", "muon+lion"],
)
def test_megatron_property_019(inner, name, scalar, expected):
    child_class = type("ChildWithMegatronProperty", (FakeChild,), {"optimizer_state_keys": _megatron_property()})
    child = child_class(inner, name, scalar if scalar else "adam")
    assert tuple(resolve_state_keys(child)) == expected


@pytest.mark.megatron
def test_property_that_disagrees_with_the_real_state_is_refused():
    child_class = type("ChildWithMegatronProperty", (FakeChild,), {"optimizer_state_keys": _megatron_property()})
    child = child_class(stepped(torch.optim.AdamW), "lion")  # says Lion, holds Adam's two moments
    with pytest.raises(ValueError, match="refusing to checkpoint a subset"):
        resolve_state_keys(child)


def _emerging():
    return pytest.importorskip("emerging_optimizers", reason="emerging-optimizers is on the 0.19.2 tier only")


@pytest.mark.megatron
def test_emerging_lion_and_muon_keys_and_kinds():
    """The real Lion and Muon megatron 0.19 builds: kinds, keys before and after a step."""
    _emerging()
    from emerging_optimizers.orthogonalized_optimizers import Muon
    from emerging_optimizers.scalar_optimizers import Lion as EmergingLion

    for cls, kind, keys in ((EmergingLion, "lion", LION), (Muon, "muon", ("momentum_buffer",))):
        param = torch.nn.Parameter(torch.ones(4, 4))
        inner = cls([param], lr=0.1)
        child = FakeChild(inner, "muon" if kind == "muon" else kind, "adam")
        assert optimizer_kind(child) == kind
        assert tuple(resolve_state_keys(child)) == keys  # before any step: from the kind
        param.grad = torch.ones(4, 4)
        with torch._dynamo.config.patch(disable=True):  # its Lion update is torch.compile'd: seconds on CPU
            inner.step()
        assert tuple(resolve_state_keys(child)) == keys  # after: what it really holds
