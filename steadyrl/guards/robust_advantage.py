"""GEPO robust group advantages: TRL's mean/std advantage on every group without a far outlier, median/MAD
centring and scaling with tanh soft clipping on the groups with one (docs/DESIGN.md, "GEPO: robust advantages").

A group has a far outlier when its MAD is > 0 and some reward lies more than ``outlier_z`` x 1.4826 x MAD from its
median (``outlier_groups``). A group whose MAD is 0 (a majority shares one value: the sparse right answer) has none:
there the robust scale would blow every other value up to the clip and mute their differences. ``outlier_z: 0``
puts every group on the robust rule. On those groups, for the G rewards::

    centre = median(r)                      # the mean of the two middle values for an even count
    mad    = median(|r - centre|)
    scale  = mad_scale * mad + eps          # 1.4826 * MAD estimates sigma for normal data
    adv    = clip_scale * tanh(((r - centre) / scale) / clip_scale)

When MAD == 0 but the group is not constant, the group's unbiased std replaces ``mad_scale * mad`` (and with
``mad_zero_centre: mean`` the mean replaces the median). Unscorable rows (NaN, ±inf) leave the statistics and get
exactly 0, as do groups with fewer than 2 scorable rows or all-equal rewards. Arithmetic is float64, cast back to
the input dtype; ``|adv| < clip_scale`` always holds (clamped to the largest value of that dtype below it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from steadyrl.guards.advantages import group_normalized_advantages

OUTLIER_Z = 10.0  # a reward this many robust spreads from its group's median makes the group robust
CLIP_SCALE_RANGE = (2.5, 4.0)
MAD_ZERO_CENTRES = ("mean", "median")


def _validate(clip_scale: float, mad_zero_centre: str) -> None:
    low, high = CLIP_SCALE_RANGE
    if not low <= clip_scale <= high:
        raise ValueError(f"clip_scale must be in [{low}, {high}], got {clip_scale!r}")
    if mad_zero_centre not in MAD_ZERO_CENTRES:
        raise ValueError(f"mad_zero_centre must be one of {', '.join(MAD_ZERO_CENTRES)}, got {mad_zero_centre!r}")


def nan_median(values: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """True median along ``dim`` ignoring NaN: mean of the two middle values for an even count; all-NaN -> NaN."""
    return torch.nanquantile(values, 0.5, dim=dim, keepdim=keepdim, interpolation="linear")


def outlier_groups(
    grouped_rewards: torch.Tensor, outlier_z: float = OUTLIER_Z, mad_scale: float = 1.4826
) -> torch.Tensor:
    """(P,) bool: groups with MAD > 0 and a finite reward more than ``outlier_z`` x ``mad_scale`` x MAD from the
    median; every group with at least 2 finite rewards when ``outlier_z`` is 0. grouped_rewards: (P, G), NaN/inf =
    unscorable."""
    r = grouped_rewards.to(torch.float64)
    scorable = torch.isfinite(r)
    r = torch.where(scorable, r, torch.full_like(r, float("nan")))
    enough = scorable.sum(dim=1) >= 2
    if outlier_z == 0:
        return enough
    centre = nan_median(r, dim=1, keepdim=True)
    deviation = (r - centre).abs()
    mad = nan_median(deviation, dim=1, keepdim=True)
    far = (deviation > outlier_z * mad_scale * mad) & scorable
    return enough & (mad.squeeze(1) > 0) & far.any(dim=1)


def robust_group_advantages(
    grouped_rewards: torch.Tensor,
    clip_scale: float = 3.0,
    mad_scale: float = 1.4826,
    eps: float = 1e-8,
    mad_zero_centre: str = "median",
) -> torch.Tensor:
    """GEPO advantage: clip_scale * tanh((r - median) / (mad_scale * MAD + eps) / clip_scale), per group.

    grouped_rewards: (num_prompts, G), NaN = unscorable -> advantages: same shape and dtype, finite,
    ``|adv| < clip_scale``; zeros and the MAD == 0 fallback as in the module docstring.
    """
    _validate(clip_scale, mad_zero_centre)
    if grouped_rewards.ndim != 2:
        raise ValueError(f"grouped_rewards must have shape (num_prompts, G), got {tuple(grouped_rewards.shape)}")
    out_dtype = grouped_rewards.dtype if grouped_rewards.is_floating_point() else torch.float32
    if grouped_rewards.numel() == 0:
        return torch.zeros(grouped_rewards.shape, dtype=out_dtype, device=grouped_rewards.device)

    r = grouped_rewards.to(torch.float64)
    scorable = torch.isfinite(r)
    r = torch.where(scorable, r, torch.full_like(r, float("nan")))
    count = scorable.sum(dim=1, keepdim=True)

    centre = nan_median(r, dim=1, keepdim=True)
    mad = nan_median((r - centre).abs(), dim=1, keepdim=True)
    mean = torch.nanmean(r, dim=1, keepdim=True)
    std = torch.sqrt(torch.nansum((r - mean) ** 2, dim=1, keepdim=True) / (count - 1).clamp(min=0))  # unbiased
    spread = torch.where(mad > 0, mad_scale * mad, std)
    if mad_zero_centre == "mean":  # the std fallback's own centre (see the module docstring)
        centre = torch.where(mad > 0, centre, mean)
    scale = spread + eps

    hi = torch.where(scorable, r, torch.full_like(r, -torch.inf)).amax(dim=1, keepdim=True)
    lo = torch.where(scorable, r, torch.full_like(r, torch.inf)).amin(dim=1, keepdim=True)
    informative = (count >= 2) & (hi > lo)

    adv = clip_scale * torch.tanh((r - centre) / scale / clip_scale)
    adv = torch.where(scorable & informative, adv, torch.zeros_like(adv))
    adv = adv.to(out_dtype)
    # the largest value of out_dtype below clip_scale, as a Python number: clamp() takes it on any device
    bound = torch.nextafter(torch.tensor(clip_scale, dtype=out_dtype), torch.tensor(0.0, dtype=out_dtype)).item()
    return adv.clamp(-bound, bound)


@dataclass
class AdvantageConfig:
    """``guards.gepo.advantage``: the tanh soft-clip bound of the median/MAD advantages (checked by GEPOAdvantage)."""

    clip_scale: float = 3.0
    mad_zero_centre: str = "median"  # centre of a robust group whose MAD is 0 (only with outlier_z 0): mean | median
    outlier_z: float = OUTLIER_Z  # robust spreads that make a group robust; 0: every group (the design notes' rule)


@dataclass(eq=False)
class GEPOAdvantage:
    """``AdvantageFunction``: TRL's advantage (``scale_rewards``) on groups without a far outlier, the robust one on
    the others (module docstring). ``robust_groups``: how many groups of the last call took the robust rule."""

    clip_scale: float = 3.0
    mad_scale: float = 1.4826
    eps: float = 1e-8
    mad_zero_centre: str = "median"
    outlier_z: float = OUTLIER_Z
    scale_rewards: str = "group"  # TRL's GRPOConfig.scale_rewards, set by the advantage pipeline
    robust_groups: int = 0

    def __post_init__(self) -> None:
        _validate(self.clip_scale, self.mad_zero_centre)
        if self.mad_scale <= 0 or self.eps <= 0:
            raise ValueError(f"mad_scale and eps must be > 0, got mad_scale={self.mad_scale!r}, eps={self.eps!r}")
        if not (self.outlier_z == 0 or 1 <= self.outlier_z < float("inf")):
            raise ValueError(f"outlier_z must be 0 (every group robust) or finite and >= 1, got {self.outlier_z!r}")

    @classmethod
    def from_config(cls, config: AdvantageConfig) -> GEPOAdvantage:
        return cls(config.clip_scale, mad_zero_centre=config.mad_zero_centre, outlier_z=config.outlier_z)

    def __call__(self, grouped_rewards: torch.Tensor) -> torch.Tensor:
        """grouped_rewards: (num_prompts, G), NaN = unscorable -> advantages (num_prompts, G)."""
        robust = outlier_groups(grouped_rewards, self.outlier_z, self.mad_scale)
        self.robust_groups = int(robust.sum())
        trl = group_normalized_advantages(grouped_rewards, self.scale_rewards)
        if not self.robust_groups:
            return trl
        gepo = robust_group_advantages(grouped_rewards, self.clip_scale, self.mad_scale, self.eps, self.mad_zero_centre)
        return torch.where(robust[:, None].to(trl.device), gepo.to(trl.dtype), trl)
