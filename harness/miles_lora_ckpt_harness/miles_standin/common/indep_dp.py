"""Stand-in of the value Miles' train actors get about independent data-parallel cells (fault tolerance).

Miles (radixark/miles 31f1ca961a94) can run training as several independent data-parallel *cells*
that heal one another. Each train actor's `init` takes a keyword-only `indep_dp_info` saying which
cell it is, how many cells there are and which are alive. It passes it on to `initialize.init`,
which builds the cross-cell group from it (`None` there: one cell). The Ray train group passes the
one-cell value unless cells are configured. The stand-in runs one cell per launch, so its value
carries only what says so, and `initialize.init`'s stand-in refuses anything else rather than
pretend to heal.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class IndepDPInfo:
    """Where this training cell stands: its index, the number of cells, the indices of the alive ones."""

    cell_index: int = 0
    num_cells: int = 1
    alive_cell_indices: tuple[int, ...] = field(default=(0,))


def require_one_cell(store_addr: str | None, info: IndepDPInfo | None) -> None:
    """Raise unless this is a one-cell run (no cross-cell store; `info` None or the one cell)."""
    if store_addr is not None or (info is not None and info != IndepDPInfo()):
        raise NotImplementedError(
            f"the Miles stand-in runs one training cell; got indep_dp_store_addr={store_addr!r}, "
            f"indep_dp_info={info!r} (independent data-parallel cells need real Miles and torchft)"
        )
