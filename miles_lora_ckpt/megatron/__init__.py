"""Thin adapters to megatron-core: the only modules of the package that import megatron (lazily).

- `topology`: this rank's model-parallel coordinates and the run's `Topology`.
- `adapter_shards`: which parameters are adapters, one file per model-parallel coordinate.
- `optimizer_children`: fp32 masters, every moment, steps and param groups of every optimizer child
  megatron builds for LoRA, one module per family (DistributedOptimizer, Float16/FP32, layer-wise).
- `scheduler`: OptimizerParamScheduler state as JSON.
- `bridge_export`: Megatron-Bridge's collective adapter export (`BridgeSource`), imported lazily.
"""
