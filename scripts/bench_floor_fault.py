"""OPEFO's second-moment floor on the tiny model: half-zeroed tensors, and a clean SFT checkpoint.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_floor_fault.py --model runs/tiny-sft/final \
        --results docs/results/opefo_floor.json                                     # about 5 minutes
    ATEN_CPU_CAPABILITY=default ... --tag -default --results F2    # another kernel path; scripts/merge_results.py

Training is the causal-LM loss on the built-in arithmetic task (``prompt + completion``, what ``steadyrl sft``
trains), AdamW (lr 3e-3, the tiny SFT config's; weight decay 0.01 on 2-D weights, 0 on the rest: two param
groups, as the Trainer builds them), batches of 64 rows, seeded.

1. **Clean checkpoint.** Two GRPO steps from the checkpoint (``steadyrl train configs/tiny/grpo.yaml``, guards
   off), then a floor check on the saved Adam state: the share of ``exp_avg_sq`` entries ``<= 1e-20`` per group
   (what the seed's rule counts), the share of those whose first moment is live (what steadyrl counts), and
   whether each rule would floor.
2. **Half-zeroed tensors.** After ``--warmup`` steps (1 and 20 by default: early, v is spread over many decades)
   the state is copied. For every 2-D weight T in turn: fault-free, one more step, T's weight change recorded;
   faulty, the same state with a seeded random half of T's ``exp_avg_sq`` set to 0 (an underflow), then one of: no
   floor, the seed's rule (the group's p10 over the entries above tiny, every entry below raised to it), the
   percentile rule steadyrl had before 2026-12-07 (each tensor's own p10), steadyrl's rule (the p10, and each
   underflowed entry to ``(|m| / s)^2``); the same next batch each time. Per tensor, over its zeroed entries: the
   mean |dw| with the fault over the mean |dw| without it. Reported per rule: the worst tensor and the median one.
   The must-show bound (issue 14): at most 10x.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402

from steadyrl.guards.moment_floor import FloorConfig, SecondMomentFloor  # noqa: E402

TINY = 1e-20


def batches(tokenizer: Any, size: int, seed: int):
    from steadyrl.tasks import arithmetic_dataset

    rows = arithmetic_dataset("train")
    g = torch.Generator().manual_seed(seed)
    while True:
        index = torch.randint(0, len(rows), (size,), generator=g).tolist()
        text = [rows[i]["prompt"] + rows[i]["completion"] + tokenizer.eos_token for i in index]
        enc = tokenizer(text, return_tensors="pt", padding=True)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        yield {**enc, "labels": labels}


def optimizer_for(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=lr)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    optimizer.step()


def seed_group_rule(optimizer: torch.optim.Optimizer, percentile: float = 10.0, trigger: float = 0.01) -> list[bool]:
    """The design notes' rule, for comparison: per param group, over every entry, trigger above 1 % <= tiny; raise
    every entry below the group's p10 (over the entries above tiny) to it."""
    floored = []
    for group in optimizer.param_groups:
        states = [optimizer.state[p]["exp_avg_sq"] for p in group["params"] if p in optimizer.state]
        values = torch.cat([v.reshape(-1) for v in states]).double()
        if (values <= TINY).double().mean().item() <= trigger:
            floored.append(False)
            continue
        q = torch.quantile(values[values > TINY], percentile / 100).item()
        for v in states:
            v.clamp_(min=q)
        floored.append(True)
    return floored


def clean_checkpoint(model_dir: str, seed: int, out: Path) -> dict[str, Any]:
    """Two GRPO steps of the tiny config from the checkpoint (``steadyrl train``, every guard off), then the floor
    check on the saved Adam state (checkpoint-2/optimizer.pt)."""
    cmd = X.train_command("configs/tiny/grpo.yaml", f"model.path={model_dir}",
           f"trainer.output_dir={out}", "trainer.max_steps=2", "trainer.save_steps=2", f"trainer.seed={seed}",
           "trainer.resume_from_checkpoint=null", "eval.enabled=false")  # fmt: skip
    run = X.launch(cmd, out, env=dict(os.environ))
    if run.status != "ok":
        raise SystemExit(f"run failed ({run.returncode}): {' '.join(cmd)}\n{run.log[-3000:]}")
    saved = torch.load(out / "checkpoint-2" / "optimizer.pt", weights_only=False)
    params: list[list[torch.nn.Parameter]] = []
    for group in saved["param_groups"]:
        params.append([torch.nn.Parameter(torch.zeros_like(saved["state"][i]["exp_avg_sq"])) for i in group["params"]
                       if i in saved["state"]])  # fmt: skip
    optimizer = torch.optim.AdamW([{"params": ps} for ps in params if ps])
    for group, ps in zip(saved["param_groups"], params, strict=True):
        for i, p in zip([i for i in group["params"] if i in saved["state"]], ps, strict=True):
            optimizer.state[p] = {k: v for k, v in saved["state"][i].items()}
    result: dict[str, Any] = {"groups": []}
    for group in optimizer.param_groups:
        v = torch.cat([optimizer.state[p]["exp_avg_sq"].reshape(-1) for p in group["params"]])
        m = torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for p in group["params"]])
        result["groups"].append(
            {"entries": v.numel(), "tiny_share": (v <= TINY).double().mean().item(),
             "tiny_and_live_share": ((v <= TINY) & (m != 0)).double().mean().item()}
        )  # fmt: skip
    result["seed_rule_triggers"] = any(g["tiny_share"] > 0.01 for g in result["groups"])
    metrics = SecondMomentFloor(FloorConfig(interval=1)).maybe_apply(optimizer, 1, apply=False)
    result["steadyrl_rule_triggers"] = metrics["opefo/floor_triggered"] > 0
    return result


def percentile_rule(optimizer: torch.optim.Optimizer, percentile: float = 10.0, trigger: float = 0.01) -> None:
    """steadyrl's rule before 2026-12-07, for comparison: per tensor with more than ``trigger`` of its entries
    underflowed (``|m| > C (sqrt(v) + eps)``), every live entry below the tensor's p10 (over the entries above tiny)
    raised to it."""
    from steadyrl.guards.moment_floor import consistency_bound

    bound = consistency_bound(0.9, 0.999) * (1.0 + 1e-3)
    for group in optimizer.param_groups:
        for p in group["params"]:
            v, m = optimizer.state[p]["exp_avg_sq"], optimizer.state[p]["exp_avg"]
            if (m.abs() > bound * (v.sqrt() + group["eps"])).sum() <= trigger * v.numel():
                continue
            q = torch.quantile(v[v > TINY].double(), percentile / 100).item()
            v.masked_fill_((v < q) & (m != 0), q)


RULES = ("none", "seed", "percentile", "steadyrl")


def half_zeroed(model_dir: str, lr: float, seed: int, warmup: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = optimizer_for(model, lr)
    data = batches(tok, 64, seed)
    for _ in range(warmup):
        step(model, optimizer, next(data))
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(optimizer.state_dict())  # state_dict() shares the live tensors
    batch = next(data)

    def one_step(target: torch.nn.Parameter, zeroed: torch.Tensor | None, rule: str) -> torch.Tensor:
        model.load_state_dict(saved_model)
        optimizer.load_state_dict(copy.deepcopy(saved_opt))
        if zeroed is not None:
            optimizer.state[target]["exp_avg_sq"][zeroed] = 0.0
        if rule == "seed":
            seed_group_rule(optimizer)
        elif rule == "percentile":
            percentile_rule(optimizer)
        elif rule == "steadyrl":
            SecondMomentFloor(FloorConfig(interval=1)).maybe_apply(optimizer, 1)
        before = target.detach().clone()
        step(model, optimizer, batch)
        return (target.detach() - before).abs()

    tensors: dict[str, dict[str, float]] = {}
    for i, (name, target) in enumerate((n, p) for n, p in model.named_parameters() if p.ndim >= 2):
        zeroed = torch.rand(target.shape, generator=torch.Generator().manual_seed(seed + 1 + i)) < 0.5
        clean = one_step(target, None, "none")[zeroed].double().mean()
        v = optimizer.state[target]["exp_avg_sq"][zeroed].double()  # the fault-free state (reloaded by one_step)
        tensors[name] = {"median_v_over_p10": (v.median() / v[v > TINY].quantile(0.1)).item()}
        for rule in RULES:
            tensors[name][rule] = (one_step(target, zeroed, rule)[zeroed].double().mean() / clean).item()
    ratios = {rule: [t[rule] for t in tensors.values()] for rule in RULES}
    summary = {rule: {"worst_ratio": max(r), "median_ratio": statistics.median(r)} for rule, r in ratios.items()}
    return {"warmup": warmup, "tensors": tensors, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/tiny-sft/final", help="a tiny SFT checkpoint folder")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, nargs="+", default=[1, 20])
    parser.add_argument("--out", default="runs/bench-floor", help="the 2-step GRPO run of the clean-checkpoint check")
    parser.add_argument("--tag", default="", help="a suffix for every scenario name (-default: another kernel path)")
    parser.add_argument("--results", default=None, help="write the figures here (shared RESULTS.md format)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    clean = clean_checkpoint(args.model, args.seed, Path(args.out))
    print(f"clean checkpoint {args.model}, after 2 GRPO steps (configs/tiny/grpo.yaml):")
    for i, g in enumerate(clean["groups"]):
        print(f"  group {i}: {g['entries']} entries, <= 1e-20: {100 * g['tiny_share']:.2f}%, "
              f"of which live (m != 0): {100 * g['tiny_and_live_share']:.2f}%")  # fmt: skip
    print(f"  seed's group rule triggers: {clean['seed_rule_triggers']}; "
          f"steadyrl's per-tensor rule triggers: {clean['steadyrl_rule_triggers']}")  # fmt: skip
    faults = [half_zeroed(args.model, args.lr, args.seed, w) for w in args.warmup]
    for fault in faults:
        spread = [t["median_v_over_p10"] for t in fault["tensors"].values()]
        print(
            f"half of each of {len(spread)} 2-D weights zeroed after {fault['warmup']} steps (their median v is "
            f"{min(spread):.0f}-{max(spread):.0f}x their p10); zeroed entries' mean |dw| / the fault-free step:"
        )
        for rule, r in fault["summary"].items():
            print(f"  floor {rule:10s}: worst tensor {r['worst_ratio']:8.2f}x, median tensor {r['median_ratio']:7.2f}x")
    if args.results:
        cells = [
            {"scenario": f"half_zeroed_after_{f['warmup']}{args.tag}", "variant": rule, "seeds": [args.seed],
             "died": [False], "accuracy": [None],
             "metrics": {k: [f["summary"][rule][k]] for k in ("worst_ratio", "median_ratio")}}
            for f in faults for rule in RULES
        ]  # fmt: skip
        cells.append(
            {"scenario": f"clean_checkpoint{args.tag}", "variant": "steadyrl", "seeds": [args.seed], "died": [False],
             "accuracy": [None], "metrics": {"triggers": [float(clean["steadyrl_rule_triggers"])],
                                              "seed_rule_triggers": [float(clean["seed_rule_triggers"])]}}
        )  # fmt: skip
        results = X.results_doc(
            "opefo_floor", cells, command="python scripts/bench_floor_fault.py " + " ".join(sys.argv[1:]),
            sha=X.commit(), model=args.model, steps=max(args.warmup) + 1,
            details={"clean_checkpoint": clean, "half_zeroed": faults},
        )  # fmt: skip
        path = REPO / args.results
        X.write_results(path, results, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
