"""A small, correct Lion (Chen et al. 2023) for megatron-core 0.16, which has no Lion at all.

Only there (megatron-core 0.19 builds its own Lion, see sim/optimizers.py) the harness builds the
optimizer as Adam. It then swaps every child's inner optimizer for this one over the very same param
groups, for every child class alike. It also sets `config.optimizer = "lion"`, so that megatron and
this project see a single-moment optimizer. State per param: `exp_avg` and a `step` (megatron's
fallback-path `DistributedOptimizer.state_dict()` needs one).
"""

from __future__ import annotations

from collections import defaultdict

import torch

LION_BETAS = (0.9, 0.99)


class Lion(torch.optim.Optimizer):
    """update = sign(b1*m + (1-b1)*g); p -= lr*(update + wd*p); m = b2*m + (1-b2)*g."""

    def __init__(self, params, lr: float = 1e-4, betas=LION_BETAS, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    _init_param_state(self, param)
                state["step"] += 1
                exp_avg = state["exp_avg"]
                update = (exp_avg * beta1 + param.grad * (1 - beta1)).sign_()
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(param.grad, alpha=1 - beta2)


def _init_param_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    optimizer.state[param]["exp_avg"] = torch.zeros_like(param)
    optimizer.state[param]["step"] = torch.tensor(0.0)


def init_lion_state(optimizer: torch.optim.Optimizer, config=None) -> None:
    """megatron's `init_state_fn(opt, config)`: zero state for every parameter that has none."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                _init_param_state(optimizer, param)


def swap_in_lion(optimizer) -> None:
    """Replace every non-stub leaf child's inner optimizer with a Lion over the same param groups."""
    from miles_lora_ckpt.megatron.optimizer_children import leaf_children

    for leaf in leaf_children(optimizer):
        child = leaf.optimizer
        if leaf.is_stub:
            continue
        lion = Lion([torch.zeros(1, requires_grad=True)])  # the constructor rejects megatron's fp32 views
        for group in child.optimizer.param_groups:
            group["betas"] = LION_BETAS
        lion.param_groups = child.optimizer.param_groups
        lion.state = defaultdict(dict)
        child.optimizer = lion
        child.init_state_fn = init_lion_state
        child.config.optimizer = "lion"
