"""LAMB, the optimizer ALBERT-large was pre-trained with (torch has none built in).

You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes" (2019).
Each tensor takes Adam's step, plus decoupled weight decay, rescaled by a *trust ratio*
||w|| / ||step||, so every layer moves by about `lr` times its own size whatever the scale of its
gradients. That is what lets a swarm use the very large batches it accumulates (4096 samples for
ALBERT-large) without the first steps blowing up.

    optimizer = Lamb(parameter_groups(model, weight_decay=0.01), lr=1.76e-3, clamp_value=10000, debias=True)

`clamp_value` caps ||w|| in the ratio (a huge tensor would otherwise take huge steps), and
`debias` applies Adam's bias correction (the paper leaves it out; BERT and ALBERT's recipes use it).
A tensor whose norm or step norm is zero takes the plain Adam step (ratio 1).
"""

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clamp_value: float = 10.0,
        debias: bool = False,
    ):
        if lr <= 0 or eps < 0 or weight_decay < 0 or clamp_value <= 0:
            raise ValueError(
                f"Lamb needs lr > 0, eps >= 0, weight_decay >= 0 and clamp_value > 0; got lr={lr}, "
                f"eps={eps}, weight_decay={weight_decay}, clamp_value={clamp_value}"
            )
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Lamb's betas must lie in [0, 1); got {betas}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            clamp_value=clamp_value,
            debias=debias,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(param.grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                first, second = exp_avg, exp_avg_sq
                if group["debias"]:
                    first = exp_avg / (1 - beta1 ** state["step"])
                    second = exp_avg_sq / (1 - beta2 ** state["step"])
                update = first / (second.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(param, alpha=group["weight_decay"])
                weight_norm = param.norm().clamp(max=group["clamp_value"])
                update_norm = update.norm()
                # a tensor-valued ratio: no .item(), so no host-device sync on a GPU
                trust_ratio = torch.where(
                    (weight_norm > 0) & (update_norm > 0),
                    weight_norm / update_norm,
                    torch.ones_like(weight_norm),
                )
                param.sub_(update * (group["lr"] * trust_ratio))
        return loss
