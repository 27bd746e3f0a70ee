"""Strategies: `AdapterParallelStrategy` (``"adapter_parallel"``)."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_multilora.strategies.adapter_parallel import AdapterParallelStrategy, assign_adapters

if AdapterParallelStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(AdapterParallelStrategy.strategy_name, AdapterParallelStrategy,
                              description="adapters split across ranks, the frozen base sharded with FSDP2")

__all__ = ["AdapterParallelStrategy", "assign_adapters"]
