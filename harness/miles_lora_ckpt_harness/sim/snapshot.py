"""Capture, digest and compare every local tensor that defines a run's training state on one rank.

Snapshot names (``child`` is the leaf index of the optimizer chain, ``leaf_children``: a LayerWise
chain's per-slot children counted in order; ``name`` is a parameter name of the unwrapped model,
e.g. ``layers.0.linear_qkv.lora_A.weight``; with several model chunks (virtual pipeline) it
carries the chunk, ``chunk1.layers.0.linear_qkv.lora_A.weight``, so every chunk's adapter, masters
and moments are in the snapshot):

* ``param/{name}``: the trainable (adapter) parameter, full local tensor, model dtype.
* ``opt{child}/master/{name}``: this rank's fp32 master of that parameter: a 1-D shard for a
  DistributedOptimizer (only where this rank's DP shard is non-empty), the whole parameter for
  Float16/FP32 children (under a LayerWise optimizer: only on the rank that owns it). For fp32
  models it is the parameter (or a view of it); for bf16 a separate fp32 tensor.
* ``opt{child}/state/{name}/{key}``: each tensor the inner torch optimizer holds for that master
  (``exp_avg``, ``exp_avg_sq``, ``step`` for AdamW; ``momentum_buffer`` for Muon), whatever keys it
  really has.
* ``opt{child}/param_groups``: the inner optimizer's param-group hyperparameters as JSON (not a
  group-level ``step``, which megatron's DistributedOptimizer adds on load).
* ``opt{child}/grad_scaler/{key}``: grad-scaler tensors, when there is a grad scaler.
* ``scheduler``: the scheduler's state_dict as JSON in a uint8 tensor.

Stub children (``is_stub_optimizer``) hold no state and contribute nothing.
"""

from __future__ import annotations

import hashlib
import json

import torch

from miles_lora_ckpt.megatron.optimizer_children import leaf_children
from miles_lora_ckpt.megatron.optimizer_children.chain import param_states


def snapshot(run) -> dict[str, torch.Tensor]:
    """Detached CPU copies of every training-state tensor of this rank, keyed by stable names."""
    named = list(run.named_parameters())
    names = {param: name for name, param in named}
    snap = {f"param/{name}": _copy(p) for name, p in named if p.requires_grad}
    for child in leaf_children(run.optimizer):
        if not child.is_stub:
            snap.update(_child_state(f"opt{child.index}", child, names))
    snap["scheduler"] = _json_tensor(run.scheduler.state_dict())
    return snap


def _child_state(prefix: str, leaf, names: dict) -> dict[str, torch.Tensor]:
    snap, child = {}, leaf.optimizer
    for model_param, master, state in param_states(leaf):
        name = names[model_param]
        snap[f"{prefix}/master/{name}"] = _copy(master)
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                snap[f"{prefix}/state/{name}/{key}"] = _copy(value)
    # Not a group's `step`: DistributedOptimizer.load_state_dict leaves the saved step in every group
    # (where TE's FusedAdam counts); torch's optimizers count per parameter (compared under state/).
    groups = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in child.optimizer.param_groups]
    snap[f"{prefix}/param_groups"] = _json_tensor(groups)
    if getattr(child, "grad_scaler", None) is not None:
        for key, value in child.grad_scaler.state_dict().items():
            if isinstance(value, torch.Tensor):
                snap[f"{prefix}/grad_scaler/{key}"] = _copy(value)
    return snap


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _json_tensor(value) -> torch.Tensor:
    encoded = json.dumps(value, sort_keys=True, default=repr).encode()
    return torch.frombuffer(bytearray(encoded), dtype=torch.uint8)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of a tensor's values (NaN-safe: compares bit patterns, not numbers)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 hex of dtype, shape and bytes."""
    digest = hashlib.sha256(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    digest.update(tensor_bytes(tensor))
    return digest.hexdigest()


def snapshot_digests(snap: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{name: tensor_digest}`` for a snapshot: JSON-able, for job results."""
    return {name: tensor_digest(tensor) for name, tensor in sorted(snap.items())}


def compare_snapshots(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    """The first name (sorted) whose tensor differs bitwise, or is in only one snapshot; else None."""
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            return name
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape or tensor_bytes(x) != tensor_bytes(y):
            return name
    return None


def compare_digests(a: dict[str, str], b: dict[str, str]) -> str | None:
    """Like ``compare_snapshots`` for two ``snapshot_digests`` results."""
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            return name
    return None
