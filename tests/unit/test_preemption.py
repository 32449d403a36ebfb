"""The preemption callback's logic without a run: the handler, the relay window, the agreed stop, the config."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import TrainerControl

from steadyrl.callbacks import preemption
from steadyrl.callbacks.preemption import PreemptionCallback, resume_hint
from steadyrl.config import load_config
from steadyrl.config.loader import ConfigError

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny" / "grpo.yaml")


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: now[0])
    return now


def test_first_signal_only_records_and_the_step_end_stops_with_a_checkpoint(clock):
    callback = PreemptionCallback(["SIGTERM"], relay_window_s=3.0)
    control, state = TrainerControl(), SimpleNamespace(global_step=7)
    callback.on_step_end(None, state, control)
    assert not control.should_save and not control.should_training_stop and callback.stopped_at is None
    callback.handle(signal.SIGTERM)
    assert callback.received.signum == signal.SIGTERM and callback.signal_name == "SIGTERM"
    assert not control.should_save  # nothing happens until the step ends
    callback.on_step_end(None, state, control)
    assert control.should_save and control.should_training_stop and callback.stopped_at == 7
    state.global_step = 8  # a later step end keeps the first stop step
    callback.on_step_end(None, state, control)
    assert callback.stopped_at == 7


def test_a_copy_inside_the_relay_window_is_ignored_a_later_one_exits_at_once(clock, monkeypatch):
    exits = []
    monkeypatch.setattr(preemption.os, "_exit", exits.append)
    callback = PreemptionCallback(["SIGTERM", "SIGINT"], relay_window_s=3.0)
    callback.handle(signal.SIGTERM)
    clock[0] += 2.9
    callback.handle(signal.SIGINT)  # within 3 s: the launcher's relayed copy (or the terminal's Ctrl-C twin)
    assert exits == [] and callback.received.signum == signal.SIGTERM and callback.received.at == 100.0
    clock[0] += 0.2  # 3.1 s after the first
    callback.handle(signal.SIGINT)
    assert exits == [128 + signal.SIGINT]


def test_handlers_are_installed_for_train_and_restored_after(clock):
    before = signal.getsignal(signal.SIGUSR1)
    callback = PreemptionCallback(["SIGUSR1"])
    callback.on_train_begin(None, None, None)
    try:
        assert signal.getsignal(signal.SIGUSR1) == callback.handle
    finally:
        callback.on_train_end(None, None, None)
    assert signal.getsignal(signal.SIGUSR1) == before


def test_resume_hint_replaces_the_resume_override_and_quotes():
    hint = resume_hint("cfg.yaml", ["trainer.max_steps=9", "trainer.resume_from_checkpoint=null", "rewards=[{fn: x}]"])
    assert hint == "steadyrl train cfg.yaml trainer.max_steps=9 'rewards=[{fn: x}]' trainer.resume_from_checkpoint=auto"


def test_config_defaults_and_refusals():
    cfg = load_config(TINY)
    assert cfg.preemption.enabled and cfg.preemption.signals == ["SIGTERM", "SIGINT"]
    assert cfg.preemption.exit_code == 75 and cfg.preemption.relay_window_s == 3.0
    with pytest.raises(
        ConfigError, match=r"signals\[0\] \(set in command line\): must be one of \['SIGTERM', .*got 'SIGTREM'"
    ):
        load_config(TINY, ["preemption.signals=[SIGTREM]"])
    with pytest.raises(ConfigError, match=r"preemption.exit_code.*1..125"):
        load_config(TINY, ["preemption.exit_code=143"])
