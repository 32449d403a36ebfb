"""OPEFO's second-moment floor on the tiny model: a half-zeroed tensor, and a clean SFT checkpoint.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_floor_fault.py --model runs/demo-sft/final \
        --results docs/results/opefo_floor.json                                     # about a minute

Training is the causal-LM loss on the built-in arithmetic task (``prompt + completion``, what ``steadyrl sft``
trains), AdamW (lr 3e-3, the tiny SFT config's; weight decay 0.01 on 2-D weights, 0 on the rest: two param
groups, as the Trainer builds them), batches of 64 rows, seeded.

1. **Clean checkpoint.** Two GRPO steps from the checkpoint (``steadyrl train configs/tiny/grpo.yaml``, guards
   off), then a floor check on the saved Adam state: the share of ``exp_avg_sq`` entries ``<= 1e-20`` per group
   (what the seed's rule counts), the share of those whose first moment is live (what steadyrl counts), and
   whether each rule would floor.
2. **Half-zeroed tensor.** After 20 warm-up steps the state is copied. Fault-free: one more step, the weight change
   of tensor T (the 2-D weight whose median ``exp_avg_sq`` sits furthest above its group's p10) recorded.
   Faulty: the same state with a seeded random half of T's
   ``exp_avg_sq`` set to 0 (an underflow), then one of: no floor, the seed's rule (the group's p10 over the
   entries above tiny, every entry below raised to it), steadyrl's per-tensor rule; the same next batch each
   time. Reported over the zeroed entries: the mean |dw| with the fault over the mean |dw| without it, and the
   99th percentile of the per-entry ratio. The must-show bound (issue 14): at most 10x.
"""

from __future__ import annotations

import argparse
import copy
import os
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


def _furthest_above_group(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, torch.Tensor]:
    """The 2-D weight whose median exp_avg_sq sits furthest above its param group's p10: where a group-wide floor is
    furthest from the tensor's own scale."""
    group = optimizer.param_groups[0]  # the 2-D weights
    all_v = torch.cat([optimizer.state[p]["exp_avg_sq"].reshape(-1) for p in group["params"]]).double()
    p10 = torch.quantile(all_v[all_v > TINY], 0.1).item()
    ids = {id(p) for p in group["params"]}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in ids]
    return max(named, key=lambda np_: optimizer.state[np_[1]]["exp_avg_sq"].double().median().item() / p10)


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


def half_zeroed(model_dir: str, lr: float, seed: int, warmup: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = optimizer_for(model, lr)
    data = batches(tok, 64, seed)
    for _ in range(warmup):
        step(model, optimizer, next(data))
    name, target = _furthest_above_group(model, optimizer)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(optimizer.state_dict())  # state_dict() shares the live tensors
    batch = next(data)
    zeroed = torch.rand(target.shape, generator=torch.Generator().manual_seed(seed + 1)) < 0.5

    def one_step(fault: bool, rule: str) -> torch.Tensor:
        model.load_state_dict(saved_model)
        optimizer.load_state_dict(copy.deepcopy(saved_opt))
        v = optimizer.state[target]["exp_avg_sq"]
        if fault:
            v[zeroed] = 0.0
        if rule == "seed":
            out["seed_rule_triggered"] = any(seed_group_rule(optimizer))
        elif rule == "steadyrl":
            SecondMomentFloor(FloorConfig(interval=1)).maybe_apply(optimizer, 1)
        before = target.detach().clone()
        step(model, optimizer, batch)
        return (target.detach() - before).abs()

    out: dict[str, Any] = {"tensor": name, "entries": target.numel(), "zeroed": int(zeroed.sum())}
    clean = one_step(False, "none")[zeroed].double()
    for rule in ("none", "seed", "steadyrl"):
        moved = one_step(True, rule)[zeroed].double()
        ratio = moved / clean.clamp(min=1e-30)
        out[rule] = {"mean_ratio": (moved.mean() / clean.mean()).item(), "median_ratio": ratio.median().item(),
                     "p99_ratio": ratio.quantile(0.99).item()}  # fmt: skip
    model.load_state_dict(saved_model)
    optimizer.load_state_dict(copy.deepcopy(saved_opt))
    v = optimizer.state[target]["exp_avg_sq"]
    healthy = v[zeroed].double()
    v[zeroed] = 0.0
    group = next(g for g in optimizer.param_groups if any(p is target for p in g["params"]))
    all_v = torch.cat([optimizer.state[p]["exp_avg_sq"].reshape(-1) for p in group["params"]]).double()
    out["tensor_median_v_before"] = healthy.median().item()
    out["seed_floor"] = torch.quantile(all_v[all_v > TINY], 0.1).item()
    live = v[v > TINY].double()
    out["steadyrl_floor"] = torch.quantile(live, 0.1).item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/demo-sft/final", help="a tiny SFT checkpoint folder")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", default="runs/bench-floor", help="the 2-step GRPO run of the clean-checkpoint check")
    parser.add_argument("--results", default=None, help="write the figures here (shared RESULTS.md format)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    clean = clean_checkpoint(args.model, args.seed, Path(args.out))
    fault = half_zeroed(args.model, args.lr, args.seed, args.warmup)
    print(f"clean checkpoint {args.model}, after 2 GRPO steps (configs/tiny/grpo.yaml):")
    for i, g in enumerate(clean["groups"]):
        print(f"  group {i}: {g['entries']} entries, <= 1e-20: {100 * g['tiny_share']:.2f}%, "
              f"of which live (m != 0): {100 * g['tiny_and_live_share']:.2f}%")  # fmt: skip
    print(f"  seed's group rule triggers: {clean['seed_rule_triggers']}; "
          f"steadyrl's per-tensor rule triggers: {clean['steadyrl_rule_triggers']}")  # fmt: skip
    print(f"half of {fault['tensor']} zeroed ({fault['zeroed']} of {fault['entries']} entries), after "
          f"{args.warmup} steps: its median v {fault['tensor_median_v_before']:.3g}, group p10 "
          f"{fault['seed_floor']:.3g}, tensor p10 {fault['steadyrl_floor']:.3g}; the seed's group rule "
          f"{'triggered' if fault['seed_rule_triggered'] else 'did not trigger (under 1% of the group)'}")  # fmt: skip
    for rule in ("none", "seed", "steadyrl"):
        r = fault[rule]
        print(f"  floor {rule:9s}: zeroed entries move {r['mean_ratio']:.1f}x (mean |dw|) their fault-free step; "
              f"per entry: median {r['median_ratio']:.1f}x, p99 {r['p99_ratio']:.1f}x")  # fmt: skip
    if args.results:
        cells = [
            {"scenario": "half_zeroed", "variant": rule, "seeds": [args.seed], "died": [False],
             "accuracy": [None], "metrics": {k: [fault[rule][k]] for k in ("mean_ratio", "median_ratio", "p99_ratio")}}
            for rule in ("none", "seed", "steadyrl")
        ]  # fmt: skip
        cells.append(
            {"scenario": "clean_checkpoint", "variant": "steadyrl", "seeds": [args.seed], "died": [False],
             "accuracy": [None], "metrics": {"triggers": [float(clean["steadyrl_rule_triggers"])],
                                              "seed_rule_triggers": [float(clean["seed_rule_triggers"])]}}
        )  # fmt: skip
        results = X.results_doc(
            "opefo_floor", cells, command="python scripts/bench_floor_fault.py " + " ".join(sys.argv[1:]),
            sha=X.commit(), model=args.model, steps=args.warmup + 1,
            details={"clean_checkpoint": clean, "half_zeroed": fault},
        )  # fmt: skip
        path = REPO / args.results
        X.write_results(path, results, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
