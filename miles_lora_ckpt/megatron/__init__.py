"""Thin adapters to megatron-core: the only modules of the package that import megatron (lazily).

- `topology`: this rank's model-parallel coordinates and the run's `Topology`.
- `adapter_shards`: which parameters are adapters, one file per model-parallel coordinate.
- `optimizer_state`: fp32 masters and every moment of each DistributedOptimizer child.
- `scheduler`: OptimizerParamScheduler state as JSON.
- `bridge_export`: Megatron-Bridge's collective adapter export (`BridgeSource`), imported lazily.
"""
