"""soup-cli's reward-hacking signals over logged training histories; run by ``peer_signals.py`` under the python of a
virtualenv that has soup-cli (it pins TRL < 1.0, so never steadyrl's):

    python -m venv /tmp/soupvenv && /tmp/soupvenv/bin/pip install --no-deps soup-cli==0.77.0

Reads ``{"runs": {id: {"steps", "reward", "reward_std", "length"}}}`` on stdin (one value per logged training step);
writes ``{"soup_cli": version, "runs": {id: {signal: first step or None}}}``. Only soup-cli's own objects decide:

- ``info_rm_warn`` / ``info_rm_halt``: ``RewardHackCallback(detector="info_rm", halt_on_hack=True).on_log``, the path
  soup-cli takes when it reads TRL's logged ``reward``/``reward_std`` (PPO, or GRPO without its reward capture). The
  first step its verdict is WARN (separation 10 % below the first step's) and the first it stops training (HACK, 30 %).
- ``length_trip``: its kl_control controller (``BangBangPolicy`` at soup-cli's config defaults: trip 0.30, release
  0.10, dwell 2) voting on its ``length_trend`` alone, fed TRL's mean completion length in tokens (soup-cli counts
  whitespace words of the text; the runs kept no text): the first step the controller trips (raises beta).
- ``vote_trip``: the same controller on the mean of ``info_rm`` and ``length_trend`` (``combine_signals``).

Its ``repetition`` signal needs the completions' text and its ``rm_ensemble`` per-completion scores of two reward
models: neither is in a training log, so neither is replayed.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from types import SimpleNamespace
from typing import Any

from soup_cli.utils import reward_hack_control as C
from soup_cli.utils import reward_hacking as H

POLICY = {  # soup-cli 0.77's config defaults (reward_hack_*)
    "beta_floor": 0.02,
    "beta_ceil": 1.0,
    "trip_band": 0.30,
    "release_band": 0.10,
    "dwell_steps": 2,
    "release_patience": 3,
    "kl_gain": 1.5,
}


def controller(signals: tuple[str, ...]) -> Any:
    return C.RewardHackMitigationCallback(
        mode="kl_control",
        detector="info_rm",
        log_writer=None,
        signals=signals,
        bang_bang=C.BangBangPolicy(**POLICY),
    )


def judge(run: dict[str, list[float]]) -> dict[str, int | None]:
    found: dict[str, int | None] = dict.fromkeys(("info_rm_warn", "info_rm_halt", "length_trip", "vote_trip"))
    halt = H.RewardHackCallback(detector="info_rm", halt_on_hack=True)
    controllers = {"length_trip": controller(("length_trend",)), "vote_trip": controller(("info_rm", "length_trend"))}
    for step, reward, std, length in zip(run["steps"], run["reward"], run["reward_std"], run["length"], strict=True):
        state = SimpleNamespace(global_step=step, log_history=[])
        control = SimpleNamespace(should_training_stop=False)
        halt.on_log(None, state, control, logs={"reward": reward, "reward_std": std})
        report = halt.last_report()
        if report is not None and report.step == step and report.verdict != "OK" and found["info_rm_warn"] is None:
            found["info_rm_warn"] = step
        if control.should_training_stop and found["info_rm_halt"] is None:
            found["info_rm_halt"] = step
        for name, cb in controllers.items():
            cb._detector_cb.observe_signal(H.compute_separation_from_stats(reward, std), step)
            drop = cb._detector_cb.last_drop_pct()
            telemetry: dict[str, Any] = {}
            cb._run_bang_bang(telemetry, {"info_rm": drop, "length_trend": cb._length_trend(length)})
            if telemetry.get("tripped") and found[name] is None:
                found[name] = step
    return found


def main() -> None:
    runs = json.load(sys.stdin)["runs"]
    json.dump({"soup_cli": version("soup-cli"), "runs": {k: judge(v) for k, v in runs.items()}}, sys.stdout)


if __name__ == "__main__":
    main()
