"""Stand-in of miles/rollout/multi_lora/data_source.py: the class both multi-LoRA shapes share,
kept in `common/multi_lora_data_source.py`."""

from miles_lora_ckpt_harness.miles_standin.common.multi_lora_data_source import (  # noqa: F401
    AdapterRef,
    MultiLoRAAsyncDataSource,
    fetch_snapshot,
    sampleable,
)
