"""A small, correct Lion (Chen et al. 2023) to run inside megatron's DistributedOptimizer on CPU.

megatron cannot build its own Lion here (`emerging-optimizers` is not installable), so the harness
builds the optimizer as Adam and then swaps each DistributedOptimizer child's inner optimizer for
this one over the very same param groups, and sets `config.optimizer = "lion"` so that megatron
(0.19's `optimizer_state_keys`) and this project see a single-moment optimizer. State per param:
`exp_avg` and a `step` (megatron's fallback-path `state_dict()` needs one).
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
                    init_lion_state(self, param)
                state["step"] += 1
                exp_avg = state["exp_avg"]
                update = (exp_avg * beta1 + param.grad * (1 - beta1)).sign_()
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(param.grad, alpha=1 - beta2)


def init_lion_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    optimizer.state[param]["exp_avg"] = torch.zeros_like(param)
    optimizer.state[param]["step"] = torch.tensor(0.0)


def swap_in_lion(chained_optimizer) -> None:
    """Replace every non-stub child's inner optimizer with a Lion over the same param groups."""
    for child in chained_optimizer.chained_optimizers:
        if getattr(child, "is_stub_optimizer", False):
            continue
        lion = Lion([torch.zeros(1, requires_grad=True)])  # the constructor rejects megatron's fp32 views
        for group in child.optimizer.param_groups:
            group["betas"] = LION_BETAS
        lion.param_groups = child.optimizer.param_groups
        lion.state = defaultdict(dict)
        child.optimizer = lion
        child.init_state_fn = init_lion_state
        child.config.optimizer = "lion"
