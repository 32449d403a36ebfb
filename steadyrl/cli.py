"""``steadyrl`` command line (``steadyrl -h``): train, sft, reward, validate, report, doctor, compare, preflight.

``train``/``sft``/``reward``/``validate``/``preflight`` take ``CONFIG [section.key=value ...]`` (a config error:
exit 1). ``report``, ``doctor`` and ``compare`` read run folders (``metrics.jsonl``, else the newest
``checkpoint-*/trainer_state.json``) and need no config; no logs: exit 2; ``doctor`` exits 1 when it finds a
failure mode. Under ``accelerate launch ... -m steadyrl train CONFIG`` every process runs the same command.
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


def _evidence(args: argparse.Namespace) -> int:
    """``report`` / ``doctor`` / ``compare``: exit 0 done and healthy, 1 doctor found something, 2 no logs (or
    ``compare`` given fewer than two runs)."""
    from steadyrl.evidence import HistoryNotFoundError, diagnose, format_findings, load_history

    errors = (HistoryNotFoundError, ValueError) if args.command == "compare" else HistoryNotFoundError
    try:
        if args.command == "compare":
            from steadyrl.evidence.compare import write_comparison

            print(write_comparison(args.run_dirs, args.out))
            return 0
        if args.command == "report":
            from steadyrl.evidence.report import write_report

            print(write_report(args.run_dir))
            return 0
        history = load_history(args.run_dir)
    except errors as exc:
        print(f"steadyrl: {exc}", file=sys.stderr)
        return 2
    from steadyrl.evidence.doctor import doctor_config_for
    from steadyrl.evidence.observe import format_observe_summary

    findings = diagnose(history, doctor_config_for(args.run_dir))
    print(format_findings(findings, history), end="")
    from steadyrl.evidence.interventions import format_table, load_summary

    if ledger := load_summary(args.run_dir, history):  # what the guard layers changed, per kind
        print("\n" + format_table(ledger))
    if observed := format_observe_summary(history, args.run_dir):  # layers in mode: observe, what they would do
        print("\n" + observed, end="")
    return 1 if findings else 0


def _teardown() -> None:
    """Destroy the process group before interpreter exit (left to atexit, some ranks abort with SIGABRT)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("report", "doctor", "compare"):
        return _evidence(args)
    if args.command == "preflight":
        from steadyrl.preflight import main as preflight

        try:
            return preflight(args.config, args.overrides, args.out, args.steps, args.drill_steps)
        except ConfigError as exc:
            print(f"steadyrl: config error: {exc}", file=sys.stderr)
            return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # the config first: a bad one fails in seconds, before transformers and TRL load
        cfg = load_config(args.config, args.overrides)
        if args.command in ("sft", "reward") and cfg.algorithm != args.command:
            need = f"`steadyrl {args.command}` needs algorithm: {args.command} in the config"
            raise ConfigError(f"{need}, got algorithm: {cfg.algorithm}")
        if args.command == "validate":
            if args.accelerate_config:
                from steadyrl.config.requirements import check_requirements

                check_requirements(cfg, args.accelerate_config)
            print(yaml.safe_dump(cfg.to_tree(), sort_keys=False), end="")
            return 0
    except ConfigError as exc:
        print(f"steadyrl: config error: {exc}", file=sys.stderr)
        return 1
    from steadyrl.callbacks.preemption import Preempted, resume_hint
    from steadyrl.rewards.guarded import RewardError
    from steadyrl.storage import StorageError
    from steadyrl.trainers.checkpoints import CheckpointSaveError

    try:
        from steadyrl.trainers.build import run, run_reward

        result = (run_reward if cfg.algorithm == "reward" else run)(cfg)
    except ConfigError as exc:
        print(f"steadyrl: config error: {exc}", file=sys.stderr)
        return 1
    except (RewardError, CheckpointSaveError, StorageError) as exc:  # the message names the cause and the fix
        print(f"steadyrl: stopped: {exc}", file=sys.stderr)
        return 1
    except Preempted as exc:  # a signal stopped the run after a checkpoint (config `preemption`)
        if os.environ.get("RANK", "0") == "0":  # one line per run, not per rank
            print(f"steadyrl: {exc}. Resume with the same launch and: {resume_hint(args.config, args.overrides)}",
                  file=sys.stderr)  # fmt: skip
        _teardown()
        return exc.exit_code
    if cfg.algorithm == "reward" and result:  # held-out pairwise accuracy (exit 0 even below the 60% warning)
        print(
            f"reward model held-out pairwise accuracy: {result['accuracy']:.3f} on {result['n_pairs']} pairs "
            f"(score mean {result['mean']:.3f}, std {result['std']:.3f}); report in "
            f"{cfg.trainer['output_dir']}/calibration.json"
        )
    elif cfg.algorithm != "reward" and result is not None:
        phase = "SFT" if cfg.algorithm == "sft" else cfg.algorithm.upper()
        print(
            f"eval {result['metric']} after {phase}: {result['accuracy']:.3f} (mean length {result['mean_length']:.1f})"
        )
    _teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
