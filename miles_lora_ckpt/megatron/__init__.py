"""Thin adapters to megatron-core.

These are the only modules of the package that import megatron, and they import it lazily.

- `topology`: this rank's model-parallel coordinates and the run's `Topology`.
- `adapter_shards`: which parameters are adapters, one file per model-parallel coordinate.
- `optimizer_children`: fp32 masters, every moment, steps and param groups of every optimizer child
  megatron builds for LoRA, one module per family (DistributedOptimizer, Float16/FP32, layer-wise).
- `scheduler`: OptimizerParamScheduler state as JSON.
- `param_blocks`: where each adapter parameter's local tensor sits in the saved global tensor.
- `native_adapter`: this rank's adapter weights from a stock Miles `torch_dist` checkpoint.
- `reshard`: a checkpoint saved at another topology, loaded here.
- `undo`: a byte-exact record of what a load may change, to roll back a late failure.
- `rng_tracker`: megatron's tensor-parallel RNG tracker states.
- `bridge_export`: Megatron-Bridge's collective adapter export (`BridgeSource`), imported lazily.
"""
