"""``steadyrl`` command line: train, sft, validate.

    steadyrl train CONFIG [section.key=value ...]     GRPO (or whatever ``algorithm`` says)
    steadyrl sft CONFIG [overrides]                   supervised warm start (``algorithm: sft``)
    steadyrl validate CONFIG [overrides]              print the resolved config, or the errors (exit 1)

Under ``accelerate launch ... -m steadyrl train CONFIG`` every process runs the same command.
"""

from __future__ import annotations

import argparse
import logging
import sys

import yaml

from steadyrl.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="steadyrl", description="GRPO that does not crash, collapse or hack.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("train", "train with the config's algorithm (grpo by default)"),
        ("sft", "supervised fine-tuning warm start (config with algorithm: sft)"),
        ("validate", "check a config and print it fully resolved"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("config", help="YAML config file")
        p.add_argument("overrides", nargs="*", help="section.key=value overrides, YAML-typed")
    return parser


def _teardown() -> None:
    """Destroy the process group before interpreter exit.

    Leaving a gloo/nccl group to be torn down by the interpreter's atexit order aborts some ranks
    (SIGABRT, 'terminate called without an active exception') after all work is done.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "sft" and cfg.algorithm != "sft":
            raise ConfigError(f"`steadyrl sft` needs algorithm: sft in the config, got algorithm: {cfg.algorithm}")
        if args.command == "validate":
            print(yaml.safe_dump(cfg.to_tree(), sort_keys=False), end="")
            return 0
        from steadyrl.trainers.build import run

        result = run(cfg)
    except ConfigError as exc:
        print(f"steadyrl: config error: {exc}", file=sys.stderr)
        return 1
    if result is not None:
        phase = "SFT" if cfg.algorithm == "sft" else cfg.algorithm.upper()
        print(
            f"eval {result['metric']} after {phase}: {result['accuracy']:.3f} (mean length {result['mean_length']:.1f})"
        )
    _teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
