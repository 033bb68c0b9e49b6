"""Every function of the Miles stand-ins (all three shapes) has the real 2026-08 Miles signature (issue 19 item 6).

The facts are `miles_standin/source_signatures.py` (read from radixark/miles 31f1ca961a94 with
`scripts/check_standin_signatures.py`, which re-checks them against a mirror of the repository); the
stand-ins' signatures are read with `inspect.signature`, default values included. The real miles-rl
wheel is compared in tests/test_real_miles.py (tier `realmiles`).
"""

from __future__ import annotations

import pytest

from miles_lora_ckpt_harness.miles_standin.signature_collect import standin_signatures
from miles_lora_ckpt_harness.miles_standin.source_signatures import (
    NOT_DEFINED_IN_SOURCE,
    SIGNATURES_2026_08,
    SOURCE_MODULES,
    drift,
)

# what issue 19 item 6 named, present in every shape
NAMED = (
    "miles.backends.megatron_utils.ft.in_memory_checkpoint.save_to_memory",
    "miles.backends.megatron_utils.actor.MegatronTrainRayActor.init",
    "miles.backends.megatron_utils.actor.MegatronTrainRayActor.save_model",
    "miles.backends.megatron_utils.initialize.init",
    "miles.backends.megatron_utils.hf_export.save_hf_model",
    "miles.utils.misc.should_run_periodic_action",
)


@pytest.fixture(scope="module")
def found() -> dict[str, dict[str, str]]:
    """Per shape: the stand-in functions in modules the 2026-08 source has, with their signatures."""
    return {
        shape: {name: signature for name, (module, signature) in names.items() if module in SOURCE_MODULES}
        for shape, names in standin_signatures().items()
    }


def test_every_stand_in_function_has_the_2026_08_signature(found):
    assert set(found) == {"lora-utils-2026-08", "lora-package-2026-09", "positional-args-pr"}
    for shape, signatures in found.items():
        assert not drift(signatures), (shape, drift(signatures))
        for name in NAMED:
            assert name in signatures, (shape, name)
    assert found["lora-utils-2026-08"]["miles.backends.megatron_utils.actor.MegatronTrainRayActor.init"] == (
        "(self, args, role, *, with_ref=False, with_opd_teacher=False, recv_ckpt_src_rank=None, indep_dp_info)"
    )
    # no stale fact: every recorded name is defined by some shape
    defined = set().union(*found.values())
    assert set(SIGNATURES_2026_08) | set(NOT_DEFINED_IN_SOURCE) <= defined, (
        set(SIGNATURES_2026_08) | set(NOT_DEFINED_IN_SOURCE)
    ) - defined


def test_a_drifted_or_unrecorded_signature_is_reported(found):
    """Negative control: the stand-in as it was before (save_to_memory's order, init without
    indep_dp_info), a changed default, and a new function nobody checked against the source."""
    before = dict(found["lora-utils-2026-08"])
    before["miles.backends.megatron_utils.ft.in_memory_checkpoint.save_to_memory"] = (
        "(model, optimizer, opt_param_scheduler, iteration)"
    )
    before["miles.backends.megatron_utils.actor.MegatronTrainRayActor.init"] = (
        "(self, args, role, *, with_ref=False, with_opd_teacher=False, recv_ckpt_src_rank=None)"
    )
    before["miles.utils.misc.should_run_periodic_action"] = (
        "(rollout_id, interval, num_rollout_per_epoch=0, num_rollout=None)"
    )
    before["miles.backends.megatron_utils.model.train_one_step"] = "(args, model)"
    problems = drift(before)
    assert set(problems) == {
        "miles.backends.megatron_utils.ft.in_memory_checkpoint.save_to_memory",
        "miles.backends.megatron_utils.actor.MegatronTrainRayActor.init",
        "miles.utils.misc.should_run_periodic_action",
        "miles.backends.megatron_utils.model.train_one_step",
    }, problems
    assert (
        "in_memory_checkpoint.py:42" in problems["miles.backends.megatron_utils.ft.in_memory_checkpoint.save_to_memory"]
    )
    assert "not in the table" in problems["miles.backends.megatron_utils.model.train_one_step"]


def test_the_stand_in_runs_one_independent_data_parallel_cell():
    """`indep_dp_info` is a value the stand-in uses: one cell passes, anything else is refused by name."""
    from miles_lora_ckpt_harness.miles_standin.common.indep_dp import IndepDPInfo, require_one_cell

    require_one_cell(None, None)
    require_one_cell(None, IndepDPInfo())
    with pytest.raises(NotImplementedError, match="one training cell.*num_cells=2"):
        require_one_cell(None, IndepDPInfo(cell_index=1, num_cells=2, alive_cell_indices=(0, 1)))
    with pytest.raises(NotImplementedError, match="indep_dp_store_addr='tcp://h:1'"):
        require_one_cell("tcp://h:1", IndepDPInfo())
