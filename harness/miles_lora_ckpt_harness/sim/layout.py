"""Which parallel layouts the CPU harness runs, checked without importing torch or megatron.

The demo's parent process (which never imports megatron) and ``SimConfig`` use the same check. So
an invalid combination of ``--tp/--pp/--ep/--etp/--cp/--vpp/--world-size`` is refused with one clear
sentence before any worker starts.

Megatron's rules, as the harness applies them:

* ``world = tp * cp * dp * pp`` (dense mesh, order tp-cp-ep-dp-pp) and ``world = etp * ep * edp * pp``
  (expert mesh, order etp-ep-dp-pp). The expert tensor parallel size ``etp`` defaults to ``tp``, as
  megatron's does; context parallel folds into the expert DP ``edp``.
* An expert-TP other than TP (``etp != tp``) may be 1 or 2. With ``etp > tp`` the expert-TP group
  spans data-parallel (or context-parallel) replicas, each with its own tokens. With ``etp < tp``
  the TP ranks hold the same tokens, and each runs the whole experts on its own part of them, as
  megatron's MoE token dispatcher does (``sim.model``).
* Virtual pipelines interleave chunks across pipeline stages, only when ``pp > 1`` as in megatron's
  ``get_model``. Each of the ``pp * vpp`` chunks holds ``num_layers / (pp * vpp)`` layers.
* Context parallelism splits the sequence into ``2 * cp`` pieces; CP rank r takes pieces r and
  ``2*cp-1-r`` (megatron's load-balanced split). So ``seq_length`` must divide by ``2 * cp``.
"""

from __future__ import annotations

SUPPORTED_TP = (1, 2)  # what the harness has verified on CPU (see docs/testing.md)


def check_layout(
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    vpp: int = 1,
    num_layers: int = 2,
    seq_length: int = 4,
    etp: int | None = None,
) -> None:
    """Raise ValueError naming the first rule a layout breaks; return None when the harness runs it.

    ``etp`` is the expert-tensor-parallel size; None means ``tp`` (megatron's default)."""
    etp = tp if etp is None else etp
    axes = (("world_size", world_size), ("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp), ("cp", cp), ("vpp", vpp))
    for name, value in axes:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if tp not in SUPPORTED_TP:
        raise ValueError(f"tp must be 1 or 2 (what the CPU harness runs), got tp={tp}")
    if world_size % (tp * cp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tp*cp*pp = {tp}*{cp}*{pp}")
    if etp not in SUPPORTED_TP:
        raise ValueError(f"etp must be 1 or 2 (what the CPU harness runs), got etp={etp}")
    if (world_size // pp) % (etp * ep):
        raise ValueError(f"world size / pp = {world_size // pp} is not divisible by etp*ep = {etp}*{ep} (expert mesh)")
    if vpp > 1 and pp < 2:
        raise ValueError(f"vpp={vpp} needs pp >= 2: megatron interleaves model chunks across pipeline stages")
    if num_layers % (pp * vpp):
        raise ValueError(f"num_layers={num_layers} is not divisible by pp*vpp = {pp}*{vpp} (layers per model chunk)")
    if cp > 1 and seq_length % (2 * cp):
        raise ValueError(f"seq_length={seq_length} is not divisible by 2*cp = {2 * cp} (load-balanced CP split)")


def layers_for(pp: int, vpp: int, minimum: int = 2) -> int:
    """The smallest layer count >= ``minimum`` that gives every model chunk the same number of layers."""
    chunks = max(1, pp * vpp)  # an invalid pp or vpp is reported by check_layout, not here
    return -(-minimum // chunks) * chunks


def cp_positions(seq_length: int, cp: int, cp_rank: int) -> list[int]:
    """Sequence positions CP rank ``cp_rank`` trains on: pieces ``cp_rank`` and ``2*cp-1-cp_rank``."""
    if cp == 1:
        return list(range(seq_length))
    piece = seq_length // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return [*range(first * piece, (first + 1) * piece), *range(second * piece, (second + 1) * piece)]
