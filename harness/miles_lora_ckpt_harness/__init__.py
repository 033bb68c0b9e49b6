"""The miles-lora-ckpt harness: what drives and checks the plugin, never a part of it.

A separate distribution (`miles-lora-ckpt-harness`, the folder `harness/` of the source tree), so that
`pip install miles-lora-ckpt` ships only the plugin. The plugin's `miles-lora-ckpt demo` and
`miles-lora-ckpt bench` hand their arguments to `commands.run` here; the tests import it directly.

- ``sim``: the CPU harness for the real megatron-core (launchers, the tiny models, CPU interceptions).
- ``miles_standin``: stand-ins of Miles' module tree, one per supported shape (shipped as package data).
- ``realmiles``: the real-Miles tier's harness for the `miles-rl` wheel.
- ``bridge_double``: the Megatron-Bridge test double.
- ``demo``: the `demo` command (single-LoRA, multi-LoRA, resharding, through the Miles stand-in).
- ``bench``: the `bench` command and its sections.
- ``gpu_check``: `make gpu-check`, the GPU path on one GPU.
- ``commands``: the `demo` and `bench` command lines the plugin's CLI hands off to.
"""
