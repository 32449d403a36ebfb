"""``steadyrl`` command line: train, sft, validate, report, doctor, compare, preflight.

    steadyrl train CONFIG [section.key=value ...]     GRPO (or whatever ``algorithm`` says)
    steadyrl sft CONFIG [overrides]                   supervised warm start (``algorithm: sft``)
    steadyrl reward CONFIG [overrides]                reward model + calibration report (``algorithm: reward``)
    steadyrl validate CONFIG [overrides]              print the resolved config, or the errors (exit 1)
    steadyrl report RUN_DIR                           plots + RUN_DIR/report/report.md from the run's logs
    steadyrl doctor RUN_DIR                           name the failure mode under way: exit 0 healthy,
                                                      1 a warning or problem found, 2 no logs found
    steadyrl compare RUN_A RUN_B ... [--out DIR]      several runs overlaid: PNG per metric + compare.md
    steadyrl preflight CONFIG [overrides] [--out DIR] calibrate the guards on this model (observe-mode baseline),
                                                      then drill a NaN loss and an inf in Adam's state; writes a
                                                      config that extends CONFIG with the calibrated values

``report`` and ``doctor`` read ``RUN_DIR/metrics.jsonl`` (the MetricsLog callback), else the newest
``checkpoint-*/trainer_state.json``; they need no config.

Under ``accelerate launch ... -m steadyrl train CONFIG`` every process runs the same command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import yaml

from steadyrl.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="steadyrl", description="GRPO that does not crash, collapse or hack.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("train", "train with the config's algorithm (grpo by default)"),
        ("sft", "supervised fine-tuning warm start (config with algorithm: sft)"),
        ("reward", "train a reward model and write its calibration report (config with algorithm: reward)"),
        ("validate", "check a config and print it fully resolved"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("config", help="YAML config file")
        p.add_argument("overrides", nargs="*", help="section.key=value overrides, YAML-typed")
        if name == "validate":
            p.add_argument("--accelerate-config", help="the accelerate config the run will be launched with "
                           "(checks that DeepSpeed is installed when it names DeepSpeed)")  # fmt: skip
    for name, text in (
        ("report", "plot a run's logged metrics into RUN_DIR/report/ (PNGs and report.md)"),
        ("doctor", "name a run's failure mode from its logs (exit 0 healthy, 1 found one, 2 no logs)"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("run_dir", help="the run's trainer.output_dir (holding metrics.jsonl or checkpoint-*/)")
    text = "calibrate the guard layers on this config's model, drill two faults, write a calibrated config"
    p = sub.add_parser("preflight", help=text, description=text)
    p.add_argument("config", help="YAML config file (the run you are about to launch)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, YAML-typed")
    p.add_argument("--out", default="preflight", help="output folder (default: ./preflight)")
    p.add_argument("--steps", type=int, default=20, help="baseline steps in observe mode (default 20)")
    p.add_argument("--drill-steps", type=int, default=6, help="steps of each fault drill (default 6; fault at 3)")
    text = "overlay several runs' metrics (one PNG per metric) and tabulate their final values"
    p = sub.add_parser("compare", help=text, description=text)
    p.add_argument("run_dirs", nargs="+", help="two or more runs' trainer.output_dir")
    p.add_argument("--out", default="compare", help="output folder (default: ./compare)")
    return parser


def _compare(run_dirs: list[str], out: str) -> int:
    """``compare``: exit 0 written, 2 a run has no logs or fewer than two runs."""
    from steadyrl.evidence import HistoryNotFoundError
    from steadyrl.evidence.compare import write_comparison

    try:
        print(write_comparison(run_dirs, out))
    except (HistoryNotFoundError, ValueError) as exc:
        print(f"steadyrl: {exc}", file=sys.stderr)
        return 2
    return 0


def _evidence(command: str, run_dir: str) -> int:
    """``report`` / ``doctor``: exit 0 done and healthy, 1 doctor found something, 2 no logs in RUN_DIR."""
    from steadyrl.evidence import HistoryNotFoundError, diagnose, format_findings, load_history

    try:
        if command == "report":
            from steadyrl.evidence.report import write_report

            print(write_report(run_dir))
            return 0
        history = load_history(run_dir)
    except HistoryNotFoundError as exc:
        print(f"steadyrl: {exc}", file=sys.stderr)
        return 2
    from steadyrl.evidence.doctor import doctor_config_for
    from steadyrl.evidence.observe import format_observe_summary

    findings = diagnose(history, doctor_config_for(run_dir))
    print(format_findings(findings, history), end="")
    observed = format_observe_summary(history, run_dir)  # layers in mode: observe, what they would have done
    if observed:
        print("\n" + observed, end="")
    return 1 if findings else 0


def _teardown() -> None:
    """Destroy the process group before interpreter exit.

    Leaving a gloo/nccl group to be torn down by the interpreter's atexit order aborts some ranks
    (SIGABRT, 'terminate called without an active exception') after all work is done.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _reward(cfg) -> int:
    """The reward-model stage; prints the held-out pairwise accuracy (exit 0 even below the 60% warning)."""
    from steadyrl.trainers.build import run_reward

    report = run_reward(cfg)
    if report:
        out = cfg.trainer["output_dir"]
        print(
            f"reward model held-out pairwise accuracy: {report['accuracy']:.3f} on {report['n_pairs']} pairs "
            f"(score mean {report['mean']:.3f}, std {report['std']:.3f}); report in {out}/calibration.json"
        )
    _teardown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("report", "doctor"):
        return _evidence(args.command, args.run_dir)
    if args.command == "compare":
        return _compare(args.run_dirs, args.out)
    if args.command == "preflight":
        from steadyrl.preflight import main as preflight

        try:
            return preflight(args.config, args.overrides, args.out, args.steps, args.drill_steps)
        except ConfigError as exc:
            print(f"steadyrl: config error: {exc}", file=sys.stderr)
            return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from steadyrl.callbacks.preemption import Preempted, resume_hint
    from steadyrl.rewards.guarded import RewardError
    from steadyrl.trainers.checkpoints import CheckpointSaveError

    try:
        cfg = load_config(args.config, args.overrides)
        for command in ("sft", "reward"):
            if args.command == command and cfg.algorithm != command:
                raise ConfigError(
                    f"`steadyrl {command}` needs algorithm: {command} in the config, got algorithm: {cfg.algorithm}"
                )
        if args.command == "validate":
            if args.accelerate_config:
                from steadyrl.config.requirements import check_requirements

                check_requirements(cfg, args.accelerate_config)
            print(yaml.safe_dump(cfg.to_tree(), sort_keys=False), end="")
            return 0
        if cfg.algorithm == "reward":
            return _reward(cfg)
        from steadyrl.trainers.build import run

        result = run(cfg)
    except ConfigError as exc:
        print(f"steadyrl: config error: {exc}", file=sys.stderr)
        return 1
    except (RewardError, CheckpointSaveError) as exc:  # a reward's policy gave up, a checkpoint save failed
        # (README "When things go wrong"): the message names the cause and the last complete checkpoint
        print(f"steadyrl: stopped: {exc}", file=sys.stderr)
        return 1
    except Preempted as exc:  # a signal stopped the run after a checkpoint (config `preemption`)
        if os.environ.get("RANK", "0") == "0":  # one line per run, not per rank
            print(f"steadyrl: {exc}. Resume with the same launch and: {resume_hint(args.config, args.overrides)}",
                  file=sys.stderr)  # fmt: skip
        _teardown()
        return exc.exit_code
    if result is not None:
        phase = "SFT" if cfg.algorithm == "sft" else cfg.algorithm.upper()
        print(
            f"eval {result['metric']} after {phase}: {result['accuracy']:.3f} (mean length {result['mean_length']:.1f})"
        )
    _teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
