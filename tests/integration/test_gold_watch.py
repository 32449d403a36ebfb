"""The reward-hacking watch on real tiny GRPO runs built from the config: the best policy by the eval metric is kept on
disk; a confirmed divergence restores it exactly (every trainable tensor and the optimizer state), lowers the
learning rate and trains on, or restores it and stops; the ledger counts the rollback."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from steadyrl.callbacks.gold_watch import BEST_DIR, GoldWatch
from steadyrl.guards.rollback import cpu_copy
from steadyrl.trainers.build import build_trainer
from tests.integration.helpers import QUIET_TRAINER, assert_same_weights, per_step, write_config

pytestmark = pytest.mark.slow

SCRIPT = {2: 0.5, 4: 0.9, 6: 0.2, 8: 0.95}  # the gold metric at each eval step: best at 4, a fall at 6
# the launch tests' scripts (a launch cannot monkeypatch SCRIPT): best at 2, kept before the checkpoint at 4 (whose
# eval is no new best and no fall), a fall at 6, no new best at 8; and best at 4, a fall at 8
LAUNCH_SCRIPTS = {"best_at_2": {2: 0.9, 4: 0.88, 6: 0.2, 8: 0.87}, "best_at_4": {2: 0.5, 4: 0.9, 6: 0.88, 8: 0.2}}


def _gold_at(script: dict[int, float], completions: list[str], trainer_state: Any) -> list[float]:
    step = trainer_state.global_step if trainer_state is not None else 0
    return [script.get(step, 0.0)] * len(completions)


def scripted_gold(completions: list[str], trainer_state: Any = None, **_: Any) -> list[float]:
    """The eval metric of these tests: SCRIPT's value at the current step for every completion (weight 0 in
    training, so only the evals read it)."""
    return _gold_at(SCRIPT, completions, trainer_state)


def gold_best_at_2(completions: list[str], trainer_state: Any = None, **_: Any) -> list[float]:
    return _gold_at(LAUNCH_SCRIPTS["best_at_2"], completions, trainer_state)


def gold_best_at_4(completions: list[str], trainer_state: Any = None, **_: Any) -> list[float]:
    return _gold_at(LAUNCH_SCRIPTS["best_at_4"], completions, trainer_state)


def gold_watch_overrides(reward: str) -> tuple[str, ...]:
    """Launch overrides: the gold watch on ``reward`` (one of the scripts above), an eval every 2 steps, one fall
    confirms, the training reward always holds."""
    return (
        "rewards=[{fn: 'tests.integration.helpers:byte_mean'}, "
        f"{{fn: 'tests.integration.test_gold_watch:{reward}', weight: 0.0, name: gold}}]",
        "eval.every=2",
        "eval.metric=gold",
        "guards.quatro.enabled=true",
        "guards.quatro.gold.confirm=1",
        "guards.quatro.gold.reward_slack=100.0",
    )


def gold_rollbacks(out) -> list[tuple[int, int]]:
    """(step, the best's step) of each gold-watch rollback in the run's metrics, the end-of-run return included."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(e["step"], e["snapshot_step"]) for e in rows if e.get("event") == "gold_rollback"]


def _script(monkeypatch, **golds: float) -> None:
    """Change SCRIPT for one test, in the module the config loads the reward from (pytest may import this file under
    another name)."""
    script = importlib.import_module("tests.integration.test_gold_watch").SCRIPT
    for step, gold in golds.items():
        monkeypatch.setitem(script, int(step.removeprefix("s")), gold)


def _config(
    tmp_path,
    model_dir,
    gold: dict[str, Any],
    every: int = 2,
    quatro: dict | None = None,
    algorithm: str = "grpo",
    **trainer: Any,
):
    cfg = {
        "algorithm": algorithm,
        "model": {"path": str(model_dir)},
        "data": {"path": "builtin:arithmetic", "eval_split": "eval", "builtin": {"max_operand": 9, "eval_size": 8}},
        "rewards": [
            {"fn": "tests.integration.helpers:byte_mean", "weight": 1.0},
            {"fn": "tests.integration.test_gold_watch:scripted_gold", "weight": 0.0, "name": "gold"},
        ],
        "eval": {"every": every, "metric": "gold", "max_samples": 8},
        "guards": {
            "quatro": {"enabled": True, "gold": {"confirm": 1, "reward_slack": 100.0, **gold}, **(quatro or {})}
        },
        "trainer": {
            "output_dir": str(tmp_path / "run"),
            "max_steps": 8,
            "per_device_train_batch_size": 8,
            "num_generations": 4,
            "max_completion_length": 4,
            "learning_rate": 1e-2,
            "lr_scheduler_type": "constant",
            **QUIET_TRAINER,
            **trainer,
        },
    }
    return write_config(tmp_path, cfg)


def _trainable(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _spy_restore(monkeypatch) -> list[dict[str, Any]]:
    """Record, at each restore, the live tensors after it and the kept files it restored from."""
    seen: list[dict[str, Any]] = []
    original = GoldWatch._restore

    def restore(self):
        original(self)
        from safetensors.torch import load_file

        # the weights once (the model save_model wrote), the optimizer state once (one process: not partitioned)
        kept = torch.load(self.best_dir / "gold_state.pt", weights_only=False)
        kept["params"] = load_file(self.best_dir / "model.safetensors")
        meta = json.loads((self.best_dir / "gold.json").read_text())
        optimizer = cpu_copy(self.trainer.optimizer.state_dict())
        step = self.trainer.state.global_step
        seen.append(
            {"live": _trainable(self.trainer), "kept": kept, "meta": meta, "step": step, "optimizer": optimizer}
        )

    monkeypatch.setattr(GoldWatch, "_restore", restore)
    return seen


def test_a_divergence_restores_the_best_policy_exactly_and_training_goes_on(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import Trainer

    seen = _spy_restore(monkeypatch)
    # with push_to_hub set, every new best's save_model uploaded the whole output_dir (the other ranks waiting)
    pushes: list[str] = []
    monkeypatch.setattr(Trainer, "init_hf_repo", lambda self, *a, **k: None)  # no Hub here
    monkeypatch.setattr(Trainer, "push_to_hub", lambda self, *a, **k: pushes.append(k.get("commit_message", "")))
    import steadyrl.callbacks.gold_watch as runtime

    dropped: list[int] = []  # the rollouts TRL buffered from the policy left behind go with it
    drop = runtime.drop_buffered_rollouts
    monkeypatch.setattr(runtime, "drop_buffered_rollouts", lambda t: (dropped.append(t.state.global_step), drop(t)))
    trainer = build_trainer(_config(tmp_path, tiny_model_dir, {}, push_to_hub=True, hub_model_id="user/run"))
    (watch,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, GoldWatch)]
    assert trainer.guard_state.stateful["gold"] is watch
    lr0 = trainer.args.learning_rate
    trainer.train()

    assert trainer.state.global_step == 8
    (rollback,) = seen
    assert rollback["step"] == 6 and rollback["meta"]["step"] == 4 and rollback["meta"]["gold"] == pytest.approx(0.9)
    for name, tensor in rollback["live"].items():  # every trainable tensor is the kept one, bit for bit
        assert torch.equal(tensor, rollback["kept"]["params"][name]), name
    kept_state = rollback["kept"]["optimizer"]["state"]
    live_state = rollback["optimizer"]["state"]
    assert kept_state.keys() == live_state.keys()
    for key, entry in kept_state.items():
        assert torch.equal(entry["exp_avg_sq"], live_state[key]["exp_avg_sq"].cpu())
    after = _trainable(trainer)  # steps 7 and 8 trained from the restored policy
    assert any(not torch.equal(after[n], rollback["live"][n]) for n in after)
    # one writer of the learning rate: the schedule runs on untouched, the watch's factor is written over it at every
    # step end (a DeepSpeed scheduler block rewrites the groups every step), and the ledger counts every such step
    assert trainer.lr_scheduler.base_lrs == [pytest.approx(lr0)] * len(trainer.optimizer.param_groups)
    assert all(group["lr"] == pytest.approx(lr0 * 0.5) for group in trainer.optimizer.param_groups)
    assert trainer.lr_factors == {"gold": 0.5} and watch.station.tightenings == 1
    assert dropped == [6]
    assert per_step(history := trainer.state.log_history, "quatro/gold_lr_factor") == [0.5, 0.5]  # steps 7, 8

    assert per_step(history, "quatro/gold_rollbacks")[-1] == 1.0
    assert per_step(history, "quatro/gold_best")[-1] == pytest.approx(0.95)
    best = json.loads((tmp_path / "run" / BEST_DIR / "gold.json").read_text())
    assert best["step"] == 8 and best["gold"] == pytest.approx(
        0.95
    )  # the new best after the rollback replaced the old one
    best_dir = tmp_path / "run" / BEST_DIR
    assert not (tmp_path / "run" / ".staging" / BEST_DIR).exists()
    # the weights once: no per-rank copies of the trainable tensors beside the model save_model wrote
    assert sorted(f.name for f in best_dir.glob("gold_state*")) == ["gold_state.pt"]
    assert set(torch.load(best_dir / "gold_state.pt", weights_only=False)) == {"optimizer"}
    ledger = json.loads((tmp_path / "run" / "interventions.json").read_text())
    assert ledger["kinds"]["gold_rollback"]["steps"] == 1 and ledger["kinds"]["gold_rollback"]["layer"] == "quatro"
    assert ledger["kinds"]["gold_tightened"]["steps"] == 2
    assert pushes == []  # three new bests kept (steps 2, 4, 8), none pushed


def test_a_ppo_rollback_restores_the_policy_and_its_critic_exactly(tiny_model_dir, tmp_path, monkeypatch):
    # PPO's kept policy is the policy, the critic and their one optimizer (before, the watch ran under GRPO only: a
    # rollback would have paired the best policy with the gamed run's value estimates)
    from safetensors.torch import load_file

    from steadyrl.trainers.ppo import CRITIC_FILE, SteadyPPOTrainer

    seen: list[dict[str, Any]] = []
    original = GoldWatch._restore

    def restore(self):
        original(self)
        seen.append({"live": _trainable(self.trainer), "step": self.trainer.state.global_step,
                     "policy": load_file(self.best_dir / "model.safetensors"),
                     "critic": load_file(self.best_dir / CRITIC_FILE),
                     "kept": torch.load(self.best_dir / "gold_state.pt", weights_only=False)["optimizer"]["state"],
                     "optimizer": cpu_copy(self.trainer.optimizer.state_dict())["state"]})  # fmt: skip

    monkeypatch.setattr(GoldWatch, "_restore", restore)
    quatro = {"filters": {"zero_variance": {"enabled": False}}}  # a GRPO notion (steadyrl refuses it under PPO)
    path = _config(tmp_path, tiny_model_dir, {}, quatro=quatro, algorithm="ppo", num_generations=1, beta=0.02)
    trainer = build_trainer(path)
    assert isinstance(trainer, SteadyPPOTrainer)
    (watch,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, GoldWatch)]
    trainer.train()
    (rollback,) = seen
    assert rollback["step"] == 6
    critic_names = [n for n in rollback["live"] if n.startswith("critic.")]
    assert critic_names and len(critic_names) == len(rollback["critic"])
    for name, tensor in rollback["live"].items():  # policy and critic, bit for bit the kept ones
        kept = rollback["critic"][name.removeprefix("critic.")] if name.startswith("critic.") else None
        kept = rollback["policy"][name.removeprefix("policy.")] if kept is None else kept
        assert torch.equal(tensor, kept), name
    assert rollback["kept"].keys() == rollback["optimizer"].keys()  # the critic's Adam state too
    for key, entry in rollback["kept"].items():
        assert torch.equal(entry["exp_avg"], rollback["optimizer"][key]["exp_avg"]), key
    assert watch.station.tightenings == 1


def test_trls_default_logging_steps_does_not_silence_the_watch(tiny_model_dir, tmp_path, monkeypatch):
    # logging_steps 10 (TRL's default) against eval.every 5: the evals at 15 and 25 have no reward row of their own.
    # They were judged with no reward level, which reset the streak (regression off): the fall was never confirmed
    _script(monkeypatch, s5=0.5, s10=0.9, s15=0.2, s20=0.2)
    seen = _spy_restore(monkeypatch)
    gold = {"confirm": 2, "regression": False}
    trainer = build_trainer(_config(tmp_path, tiny_model_dir, gold, every=5, logging_steps=10, max_steps=22))
    trainer.train()
    rollback, _end = seen  # the rollback, then the end of the run on the best policy (its last eval, 0.2, is below)
    assert rollback["step"] == 20 and rollback["meta"]["step"] == 10  # back to the policy of step 10
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (event,) = [e for e in events if e.get("event") == "gold_rollback" and e.get("verdict")]
    assert event["verdict"] == "diverged" and "fell from 0.9 at step 10 to 0.2 at step 20" in event["cause"]


def test_save_best_false_never_restores_a_best_policy_left_by_an_earlier_run(tiny_model_dir, tmp_path, monkeypatch):
    seen = _spy_restore(monkeypatch)
    stale = tmp_path / "run" / BEST_DIR
    stale.mkdir(parents=True)
    (stale / "gold.json").write_text(json.dumps({"step": 4, "gold": 0.99, "ranks": 1}))
    trainer = build_trainer(_config(tmp_path, tiny_model_dir, {"save_best": False}))
    trainer.train()  # the fall at step 6 is confirmed: it warns, and nothing is restored
    assert seen == [] and trainer.state.global_step == 8
    assert per_step(trainer.state.log_history, "quatro/gold_rollbacks")[-1] == 1.0
    assert trainer.lr_factors == {}  # nothing restored, nothing tightened


def test_action_stop_restores_the_best_policy_and_ends_the_run(tiny_model_dir, tmp_path, monkeypatch):
    seen = _spy_restore(monkeypatch)
    trainer = build_trainer(_config(tmp_path, tiny_model_dir, {"action": "stop"}))
    trainer.train()
    assert trainer.state.global_step == 7  # the eval of step 6 comes at step 7's start: that step still runs
    (rollback,) = seen
    assert rollback["step"] == 7 and rollback["meta"]["step"] == 4
    final = _trainable(trainer)
    assert all(torch.equal(final[n], rollback["kept"]["params"][n]) for n in final)
    assert set(trainer.lr_scheduler.base_lrs) == {trainer.args.learning_rate}  # nothing tightened


def test_a_run_the_watch_acted_on_ends_on_the_best_policy(tiny_model_dir, tmp_path, monkeypatch):
    _script(monkeypatch, s8=0.88)  # after the rollback at 6, the last eval is below the best but within drop
    seen = _spy_restore(monkeypatch)
    trainer = build_trainer(_config(tmp_path, tiny_model_dir, {}))
    trainer.train()
    assert trainer.state.global_step == 8
    rollback, end = seen
    assert rollback["step"] == 6 and end["step"] == 8 and end["meta"]["step"] == 4
    final = _trainable(trainer)  # what the run saves and evaluates: the step-4 policy, bit for bit
    assert all(torch.equal(final[n], end["kept"]["params"][n]) for n in final)
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    acted = [e for e in events if e.get("event") == "gold_rollback"]
    assert [e["step"] for e in acted] == [6, 8] and "the run ends with the eval metric" in acted[1]["cause"]
    # the swap comes before the run summary is written: interventions.json names the policy the run ended on
    ledger = json.loads((tmp_path / "run" / "interventions.json").read_text())
    assert ledger["ended_on"] == {"guard": "gold", "policy_step": 4, "gold": pytest.approx(0.9),
                                  "last_gold": pytest.approx(0.88)}  # fmt: skip


def test_a_run_the_watch_never_acted_on_ends_as_it_is(tiny_model_dir, tmp_path, monkeypatch):
    _script(monkeypatch, s6=0.87, s8=0.86)  # below the best, never more than drop below it: no action
    seen = _spy_restore(monkeypatch)
    trainer = build_trainer(_config(tmp_path, tiny_model_dir, {}))
    trainer.train()
    assert seen == [] and trainer.state.global_step == 8


def test_observe_mode_counts_the_divergence_and_restores_nothing(tiny_model_dir, tmp_path, monkeypatch):
    seen = _spy_restore(monkeypatch)
    cfg = _config(tmp_path, tiny_model_dir, {})
    cfg.guards.quatro.mode = "observe"
    trainer = build_trainer(cfg)
    trainer.train()
    assert seen == [] and trainer.state.global_step == 8
    history = trainer.state.log_history
    assert per_step(history, "quatro/would_gold_rollbacks")[-1] == 1.0
    assert not (tmp_path / "run" / BEST_DIR).exists()  # observe mode keeps no policy


def test_with_the_kl_controller_off_the_watchs_beta_factor_is_logged_and_counted(tiny_model_dir, tmp_path, monkeypatch):
    # beta 0.04, no KL controller to log quatro/beta: the watch's beta x 2 from the rollback at 6 on is still visible
    trainer = build_trainer(_config(tmp_path, tiny_model_dir, {}, quatro={"kl": {"enabled": False}}, beta=0.04))
    assert trainer.step_end.kl is None
    trainer.train()
    assert trainer.beta_factors == {"gold": 2.0} and trainer.beta == pytest.approx(0.08)
    assert per_step(trainer.state.log_history, "quatro/beta") == [pytest.approx(0.08)] * 2  # steps 7, 8
    ledger = json.loads((tmp_path / "run" / "interventions.json").read_text())
    assert ledger["kinds"]["beta_moved"]["steps"] == 2 and ledger["kinds"]["gold_tightened"]["steps"] == 2


def test_a_full_disk_while_keeping_a_new_best_stops_the_run_and_keeps_the_last_best_whole(
    tiny_model_dir, tmp_path, monkeypatch
):
    import errno

    import steadyrl.trainers.best_policy as best_policy
    from steadyrl.trainers.checkpoints import CheckpointSaveError

    save = torch.save

    def full_at_step_4(obj, path, *args, **kwargs):
        if "gold_state" in str(path) and trainer.state.global_step == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(best_policy.torch, "save", full_at_step_4)
    trainer = build_trainer(_config(tmp_path, tiny_model_dir, {}))
    with pytest.raises(CheckpointSaveError, match=r"best-gold was not saved: OSError: \[Errno 28\] No space left"):
        trainer.train()
    best = tmp_path / "run" / BEST_DIR
    assert json.loads((best / "gold.json").read_text())["step"] == 2  # the previous best, whole
    assert (best / "gold_state.pt").is_file() and (best / "model.safetensors").is_file()
    assert not (tmp_path / "run" / ".staging" / BEST_DIR).exists()  # the partial copy removed


def test_a_zero2_resume_on_two_processes_rolls_back_to_a_best_one_process_kept_before_the_checkpoint(
    tiny_model_dir, tmp_path
):
    """ZeRO-2: 1 process keeps the best at step 2 (its Adam state partitioned for 1 rank) and checkpoints at 4; the
    checkpoint is converted to DeepSpeed's universal format as the world-size refusal says, and the run resumes on 2
    processes; the eval falls at 6. Both ranks restore the step-2 weights with the live moments (the kept partition is
    for another layout: warned), ZeRO's fp32 master copy refreshed from them, so step 7 moves on from the best policy,
    not from the step-6 weights the master still held."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from tests.integration.test_launch import REPO, launch

    out = tmp_path / "resize"
    gold = (
        *gold_watch_overrides("gold_best_at_2"),
        "trainer.save_steps=4",
        "trainer.learning_rate=1e-2",
        "trainer.lr_scheduler_type=constant",
        "trainer.resume_from_checkpoint=auto",
    )
    launch("zero2.yaml", tiny_model_dir, out, *gold, "trainer.max_steps=4", num_processes=1, timeout=200)
    kept = json.loads((out / BEST_DIR / "gold.json").read_text())
    assert (kept["step"], kept["ranks"], kept["partitioned"]) == (2, 1, True)
    checkpoint = out / "checkpoint-4"
    tag = (checkpoint / "latest").read_text().strip()
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state",
         "--input_folder", str(checkpoint / tag), "--output_folder", str(checkpoint / f"{tag}_universal")],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    (checkpoint / "latest_universal").write_text(f"{tag}_universal")
    ds_config = json.loads((REPO / "configs" / "deepspeed" / "zero2.json").read_text())
    ds_config["checkpoint"] = {"load_universal": True}
    (ds_file := tmp_path / "zero2_universal.json").write_text(json.dumps(ds_config))
    two, proc = launch(
        "zero2.yaml", tiny_model_dir, out, *gold, "trainer.max_steps=8",
        accelerate_args=("--deepspeed_config_file", str(ds_file)), timeout=300,
    )  # fmt: skip
    assert gold_rollbacks(out) == [(6, 2), (8, 2)], proc.stderr[-3000:]  # the fall, then the run's end on the best
    warning = "kept with its optimizer state partitioned over 1 ranks; this run has 2 process(es) under ZeRO"
    assert proc.stderr.count(warning) == 4  # each rank, at the fall and at the end of the run
    best = load_file(out / BEST_DIR / "model.safetensors")  # still step 2's: no new best after it
    assert json.loads((out / BEST_DIR / "gold.json").read_text())["step"] == 2
    for dump in two:
        steps = {s["step"]: s["weights"] for s in dump["per_step"]}
        w6, w7 = steps[6], steps[7]  # before the rollback at 6's eval, and one step after it

        def distance(a, b):
            return sum(float((a[k].float() - b[k].float()).norm() ** 2) for k in best) ** 0.5

        # from the restored policy one Adam step at half the learning rate, not from where step 6 had gone
        assert distance(w7, best) < 0.5 * distance(w7, w6), (distance(w7, best), distance(w7, w6))
    assert_same_weights(two[0]["weights"], two[1]["weights"])
    assert all(torch.isfinite(v).all() for v in two[0]["weights"].values())


def test_the_python_api_runs_the_watch_on_trls_own_eval(tiny_model_dir, tmp_path, monkeypatch):
    """``SteadyGRPOTrainer(guards="all")`` with TRL's ``eval_strategy``: the watch reads ``eval_rewards/<the weight-0
    reward>/mean``, with TRL's default ``logging_steps`` (10) against an eval every 2 steps, and rolls back on the fall
    at 6 (before, the Python API never built it). Without a weight-0 reward it says why it is off."""
    from transformers import AutoTokenizer

    from steadyrl.trainers.grpo import SteadyGRPOTrainer
    from tests.integration.helpers import byte_mean, grpo_args, small_dataset

    seen = _spy_restore(monkeypatch)
    data = small_dataset()

    def trainer_with(weights: list[float], out: str) -> SteadyGRPOTrainer:
        args = grpo_args(tmp_path / out, max_steps=8, eval_strategy="steps", eval_steps=2, logging_steps=10,
                         reward_weights=weights, per_device_eval_batch_size=8, learning_rate=1e-2)  # fmt: skip
        return SteadyGRPOTrainer(
            model=str(tiny_model_dir), reward_funcs=[byte_mean, scripted_gold], args=args,
            train_dataset=data, eval_dataset=data.select(range(8)),
            processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
            guards={"quatro": {"enabled": True, "gold": {"confirm": 1, "reward_slack": 100.0}}},
        )  # fmt: skip

    trainer = trainer_with([1.0, 0.0], "api")
    watch = trainer.gold_watch
    assert isinstance(watch, GoldWatch) and watch.metric == "eval_rewards/scripted_gold/mean"
    assert trainer.guard_state.stateful["gold"] is watch and watch.eval_prompts == 8
    trainer.train()
    (rollback, *_) = seen
    assert rollback["step"] == 6 and rollback["meta"]["step"] == 4 and rollback["meta"]["gold"] == pytest.approx(0.9)
    assert rollback["meta"]["metric"] == "eval_rewards/scripted_gold/mean"
    assert trainer.lr_factors == {"gold": 0.5}
    with pytest.MonkeyPatch.context() as m:
        warnings: list[str] = []
        m.setattr("steadyrl.trainers.grpo.quatro_logger.warning", lambda msg, *a: warnings.append(msg % a))
        assert trainer_with([1.0, 1.0], "no-gold").gold_watch is None
    assert "pass one reward function with weight 0 (args.reward_weights; found none)" in warnings[0]
