"""The parrot filter's noise on a healthy policy: completions sampled from SmolLM2-135M-Instruct as the shipped
``configs/small/grpo-lora.yaml`` starts it (its prompts, chat template, temperature, completion length, group size
and weighted rewards), scored by QUATRO's own ``parrot_shares`` and ``reinforced``. Per sampling seed: the rows a
parrot rule would drop (reinforced, share above ``max_overlap``) under the share alone (the rule before) and with
``PARROT_MIN_NGRAMS`` (the rule now), with the n-gram counts of every row above the share, and its text.

    OMP_NUM_THREADS=2 python scripts/parrot_noise.py --prompts 160 --seeds 0 1 --results docs/results/parrot_noise.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402

CONFIG = REPO / "configs" / "small" / "grpo-lora.yaml"


def sample(prompts: int, seed: int, batch: int = 8) -> list[dict]:
    """Every completion of ``prompts`` training prompts (``num_generations`` each), as the run would score them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from steadyrl.config import load_config
    from steadyrl.data import load_datasets
    from steadyrl.guards import rollout_filters as F
    from steadyrl.rewards import bind_reward, load_reward_fn
    from steadyrl.tasks.smollm2 import smollm2_folder

    cfg = load_config(CONFIG, [])
    t = cfg.trainer
    group, length, temperature = int(t["num_generations"]), int(t["max_completion_length"]), float(t["temperature"])
    train, _ = load_datasets(cfg.data)
    rewards = [(bind_reward(r.fn, load_reward_fn(r.fn), r.kwargs), r.weight) for r in cfg.rewards]
    folder = smollm2_folder()
    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    rows: list[dict] = []
    for start in range(0, prompts, batch):
        chunk = [train[i] for i in range(start, min(prompts, start + batch))]
        texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=length,
                num_return_sequences=group,
                pad_token_id=tok.pad_token_id,
            )
        for j, ids in enumerate(out[:, enc["input_ids"].shape[1] :].tolist()):
            if tok.eos_token_id in ids:  # TRL keeps the completion up to its first EOS, included
                ids = ids[: ids.index(tok.eos_token_id) + 1]
            row = chunk[j // group]
            rows.append(
                {
                    "prompt_ids": tok(texts[j // group], add_special_tokens=False)["input_ids"],
                    "ids": ids,
                    "text": tok.decode(ids, skip_special_tokens=True),
                    "row": row,
                }
            )
        print(f"seed {seed}: {min(prompts, start + batch)}/{prompts} prompts", file=sys.stderr)
    completions = [[{"role": "assistant", "content": r["text"]}] for r in rows]
    extra = {key: [r["row"][key] for r in rows] for key in ("answer", "problem")}
    total = torch.zeros(len(rows), dtype=torch.float64)
    for fn, weight in rewards:
        total += weight * torch.tensor(fn(prompts=[r["row"]["prompt"] for r in rows], completions=completions, **extra))
    shares = F.parrot_shares(batch_of([r["prompt_ids"] for r in rows]), batch_of([r["ids"] for r in rows]), F.PARROT_N)
    paid = F.reinforced(total, group)
    for r, share, reward, up in zip(rows, shares.tolist(), total.tolist(), paid.tolist(), strict=True):
        r.update(share=share, ngrams=max(len(r["ids"]) - F.PARROT_N + 1, 0), reward=reward, reinforced=up)
    return rows


def batch_of(lists: list[list[int]]):  # -> TokenBatch
    import torch

    from steadyrl.guards.rollout_filters import TokenBatch

    ids = torch.zeros(len(lists), max(map(len, lists)), dtype=torch.long)
    for i, row in enumerate(lists):
        ids[i, : len(row)] = torch.tensor(row)
    return TokenBatch(ids, torch.tensor([len(row) for row in lists]))


def summary(rows: list[dict], min_ngrams: int) -> dict:
    from steadyrl.guards.rollout_filters import ParrotConfig

    cut = ParrotConfig().max_overlap
    above = [r for r in rows if r["share"] > cut]
    dropped = [r for r in above if r["reinforced"] and r["ngrams"] >= min_ngrams]
    return {
        "rows": len(rows),
        "above_max_overlap": len(above),
        "dropped": len(dropped),
        "dropped_share": len(dropped) / len(rows),
        "ngrams_above": sorted(r["ngrams"] for r in above),
        "texts_above": [r["text"] for r in above],
        "accuracy": None,
    }


def main() -> None:
    from steadyrl.guards.rollout_filters import PARROT_MIN_NGRAMS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=160)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--results", default=None)
    ap.add_argument("--tag", default="", help="appended to the scenario name (e.g. -default for another kernel path)")
    args = ap.parse_args()
    sha = X.commit()
    runs = {seed: sample(args.prompts, seed) for seed in args.seeds}
    cells = []
    for variant, floor in (
        ("share alone (before)", 0),
        (f"share and >= {PARROT_MIN_NGRAMS} n-grams", PARROT_MIN_NGRAMS),
    ):
        per_seed = [summary(runs[s], floor) for s in args.seeds]
        for s, result in zip(args.seeds, per_seed, strict=True):
            print(
                f"{variant}, seed {s}: {result['dropped']} of {result['rows']} rows dropped; above the share: "
                f"n-grams {result['ngrams_above']}, {result['texts_above']}"
            )
        cells.append(X.cell("smollm2-start" + args.tag, variant, args.seeds, per_seed, list(per_seed[0])))
    if args.results:
        model = "smollm2-135m-instruct (configs/small/grpo-lora.yaml's sampling)"
        doc = X.results_doc(
            "parrot_noise", cells, command=X.script_command("parrot_noise.py"), sha=sha, model=model, steps=None
        )
        X.write_results(args.results, doc)


if __name__ == "__main__":
    main()
