"""What `demo --via miles` launches Miles with: the init hook, the plugin config files it writes, and the
phases a stock-Miles crash is injected at (shared by the single- and multi-LoRA Miles demos)."""

from __future__ import annotations

INIT_HOOK = "miles_lora_ckpt.hooks.megatron_init"
DATA_SOURCE_HOOK = "miles_lora_ckpt.hooks.CheckpointedDataSource"  # integration.data_state.HOOK
STOCK_PHASES = ("before-write", "mid-write", "after-write")

CONFIG_TEXT = """\
# miles-lora-ckpt config written by `miles-lora-ckpt demo --via miles` (see configs/ for commented examples)
[save]
layout = "subdir"   # generations in <--save>/lora
keep = 3            # keep the newest 3 intact generations
[consensus]
timeout_s = 60      # a dead peer turns into an error on every rank within a minute
[resume]
strict = true
"""
DATA_STATE_CONFIG_TEXT = """\
[data_state]
source = "{source}"   # the data source the plugin's --data-source-path wraps
"""
PEFT_CONFIG_TEXT = """\
[export]
peft = true         # every committed generation also holds peft/, an HF PEFT adapter
"""
