"""PPO math for token-level RLHF: reward placement, KL estimators, GAE, whitening, clipped value loss.

``B`` = completions, ``T`` = completion tokens (``mask`` 1 on real tokens). As the PPO trainer uses them::

    kl        = kl_k1(logp, ref_logp)                         # or kl_k3, per token
    rewards   = place_rewards(seq_reward, mask, kl, beta)     # -beta*kl_t everywhere, + seq reward on the last token
    adv, ret  = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    adv       = whiten(adv, mask)                             # optionally soft_clip(adv, 3.0) afterwards
    vf_loss, clipfrac = clipped_value_loss(new_values, values, ret, mask, cliprange_value=0.2)

Masks may have holes (tool-output tokens). Arithmetic is in float32 (float64 stays float64).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 per-token KL estimate ``logp - ref_logp`` (unbiased, can be negative); any shape.
    Source: http://joschu.net/blog/kl-approx.html"""
    return logp - ref_logp


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 per-token KL estimate ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, always >= 0, lower variance).
    Source: http://joschu.net/blog/kl-approx.html"""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k3": kl_k3}


def get_kl_estimator(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The KL estimator called ``name`` (``"k1"`` or ``"k3"``); an unknown name raises with the valid names."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; valid: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[name]


def _work_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last real token of each row. mask: (B, T) of 0/1 -> (B,) long; rows with no real token -> -1."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1))
    return last.amax(dim=1) if mask.shape[1] else torch.full((mask.shape[0],), -1, device=mask.device)


def place_rewards(
    sequence_rewards: Tensor, completion_mask: Tensor, per_token_kl: Tensor | None = None, beta: float = 0.0
) -> Tensor:
    """Token-level rewards: ``-beta * kl_t`` on every real token, plus the sequence reward on the last real token.
    sequence_rewards: (B,), completion_mask: (B, T) 0/1, per_token_kl: (B, T) or None -> token_rewards: (B, T),
    exactly 0 on masked positions. Source: Ziegler et al. 2019, Ouyang et al. 2022.
    """
    if completion_mask.ndim != 2 or sequence_rewards.shape != completion_mask.shape[:1]:
        raise ValueError(
            f"expected sequence_rewards (B,) and completion_mask (B, T), got {tuple(sequence_rewards.shape)} "
            f"and {tuple(completion_mask.shape)}"
        )
    dtype = _work_dtype(sequence_rewards)
    mask = completion_mask.to(dtype)
    rewards = torch.zeros(completion_mask.shape, dtype=dtype, device=completion_mask.device)
    if per_token_kl is not None:
        if per_token_kl.shape != completion_mask.shape:
            raise ValueError(f"per_token_kl {tuple(per_token_kl.shape)} must match mask {tuple(mask.shape)}")
        # masked positions may hold garbage (even inf/nan) and must not leak: select, do not multiply
        rewards = torch.where(mask.bool(), -beta * per_token_kl.to(dtype), rewards)
    last = last_token_index(completion_mask)
    rows = torch.nonzero(last >= 0).squeeze(1)
    rewards[rows, last[rows]] += sequence_rewards.to(dtype)[rows]
    return rewards


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation by a reverse scan over the real tokens of each row.
    token_rewards, values, mask: (B, T) -> (advantages, returns): (B, T), both exactly 0 on masked positions.
    ``delta_t = r_t + gamma * V_next - V_t``; ``A_t = delta_t + gamma * lam * A_next``, "next" being the row's next
    *real* token (bootstrap 0 after the last). ``returns = advantages + values``. Source: arXiv:1506.02438, verl.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or mask.ndim != 2:
        raise ValueError(
            f"token_rewards, values and mask must share one (B, T) shape, got {tuple(token_rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    dtype = _work_dtype(values)
    real = mask.bool()
    zeros = torch.zeros_like(values, dtype=dtype)
    rewards = torch.where(real, token_rewards.to(dtype), zeros)
    vals = torch.where(real, values.to(dtype), zeros)
    next_value = torch.zeros(values.shape[0], dtype=dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    advantages = torch.zeros_like(vals)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam * next_adv
        # a masked position passes the running value and advantage through untouched
        next_adv = torch.where(real[:, t], adv_t, next_adv)
        next_value = torch.where(real[:, t], vals[:, t], next_value)
        advantages[:, t] = torch.where(real[:, t], adv_t, zeros[:, t])
    returns = advantages + vals
    return advantages, returns


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (any shapes that broadcast); 0 when nothing is real."""
    m = mask.to(_work_dtype(x))
    return (torch.where(m.bool(), x.to(m.dtype), 0.0)).sum() / m.sum().clamp(min=1.0)


def masked_mean_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> tuple[Tensor, Tensor]:
    """(mean, variance) of ``x`` over real positions; scalars. Unbiased divides by ``n - 1``; n < 2 gives var 0."""
    dtype = _work_dtype(x)
    real = mask.bool()
    n = real.sum().to(dtype)
    xs = torch.where(real, x.to(dtype), 0.0)
    mean = xs.sum() / n.clamp(min=1.0)
    sq = torch.where(real, (x.to(dtype) - mean) ** 2, 0.0).sum()
    denom = (n - 1.0) if unbiased else n
    var = torch.where(n >= 2, sq / denom.clamp(min=1.0), torch.zeros((), dtype=dtype, device=x.device))
    return mean, var


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, stats: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the real positions of the whole batch; masked positions stay exactly 0.
    x, mask: (B, T) -> same shape. ``stats``: precomputed (mean, var)."""
    mean, var = stats if stats is not None else masked_mean_var(x, mask, unbiased=True)
    dtype = _work_dtype(x)
    out = (x.to(dtype) - mean) * torch.rsqrt(var.to(dtype) + eps)
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def soft_clip(advantages: Tensor, clip_scale: float = 3.0) -> Tensor:
    """``clip_scale * tanh(advantages / clip_scale)`` (GEPO's soft clip); any shape -> same shape."""
    if clip_scale <= 0:
        raise ValueError(f"clip_scale must be > 0, got {clip_scale!r}")
    return clip_scale * torch.tanh(advantages / clip_scale)


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float = 0.2
) -> tuple[Tensor, Tensor]:
    """PPO clipped value loss ``0.5 * mean_masked(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))``.
    values (with grad), old_values, returns, mask: (B, T) -> (loss, clipfrac: share of real tokens where the clipped
    branch is strictly larger, detached). Source: the PPO2 baselines.
    """
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss_unclipped, loss_clipped), mask)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).to(loss.dtype), mask).detach()
    return loss, clipfrac
