"""Dataset loading for the ``data`` section: local files, ``datasets`` names, or a built-in task: ``arithmetic``
(SFT / GRPO / PPO), ``word_problems`` (chat messages, ``steadyrl.tasks.word_problems``) or ``arithmetic_preferences``
(the reward stage's pairs). ``data.builtin`` holds the generator's keyword arguments and goes to both splits.
"""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset, load_dataset

from steadyrl.config.loader import ConfigError
from steadyrl.config.schema import DataSection

BUILTIN_TASKS = ("arithmetic", "arithmetic_preferences", "word_problems")
_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _load_one(path: str, name: str | None, split: str, builtin: dict) -> Dataset:
    if path.startswith("builtin:"):
        task = path.removeprefix("builtin:")
        if task not in BUILTIN_TASKS:
            raise ConfigError(f"data.path: unknown built-in task {task!r}; valid: {list(BUILTIN_TASKS)}")
        if task == "arithmetic":
            from steadyrl.tasks.arithmetic import arithmetic_dataset as generate
        elif task == "word_problems":
            from steadyrl.tasks.word_problems import word_problem_dataset as generate
        else:
            from steadyrl.tasks.preferences import arithmetic_preferences as generate
        try:
            return generate(split, **builtin)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"data.builtin: {exc}") from exc
    local = Path(path)
    if local.suffix in _FILE_FORMATS:
        if not local.is_file():
            raise ConfigError(f"data file {path!r} does not exist")
        return load_dataset(_FILE_FORMATS[local.suffix], data_files=str(local), split="train")
    return load_dataset(path, name, split=split)


def load_datasets(data: DataSection) -> tuple[Dataset, Dataset | None]:
    """(train, eval or None). ``eval_path`` (a file) wins over ``eval_split`` (a split of ``path``)."""
    train = _load_one(data.path, data.name, data.split, data.builtin)
    evaluation = None
    if data.eval_path is not None:
        evaluation = _load_one(data.eval_path, data.name, "train", data.builtin)
    elif data.eval_split is not None:
        evaluation = _load_one(data.path, data.name, data.eval_split, data.builtin)
    for label, ds in (("train", train), ("eval", evaluation)):
        if ds is not None and data.prompt_column not in ds.column_names:
            raise ConfigError(f"data.prompt_column: the {label} data has no column {data.prompt_column!r} (columns: "
                              f"{ds.column_names}); set data.prompt_column to the prompt column's name")  # fmt: skip
    if data.prompt_column != "prompt":
        train = train.rename_column(data.prompt_column, "prompt")
        evaluation = evaluation.rename_column(data.prompt_column, "prompt") if evaluation is not None else None
    if data.max_samples is not None:
        train = train.select(range(min(data.max_samples, len(train))))
    return train, evaluation
