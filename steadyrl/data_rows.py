"""Bad data rows, found before training (``data.on_bad_row: error | skip``).

A row is bad when its prompt is empty or whitespace, a column a reward needs is ``None``, or the prompt plus
``trainer.max_completion_length`` tokens do not fit the model's context (TRL does not truncate prompts). ``error``
names the source, row and column; ``skip`` drops such rows and logs how many, per reason.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from steadyrl.config.loader import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BadRow:
    index: int
    column: str
    kind: str  # what the skip counts are keyed by: "empty prompt", "empty 'answer'", "prompt too long"
    reason: str


def prompt_text(prompt: Any) -> str:
    """The text of a prompt: itself, or a chat prompt's message contents joined (non-text parts count as text)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        contents = [message.get("content") if isinstance(message, Mapping) else message for message in prompt]
        return "".join(c if isinstance(c, str) else "<non-text>" if c else "" for c in contents)
    return "" if prompt is None else str(prompt)


def find_bad_rows(columns: Mapping[str, Sequence[Any]], needs: Mapping[str, Sequence[str]],
                  prompt_lengths: Sequence[int] | None = None, max_prompt_tokens: int | None = None,
                  limit_why: str = "") -> list[BadRow]:  # fmt: skip
    """Bad rows of ``{column: values}``, first reason per row. ``needs``: column -> the rewards that read it;
    ``prompt_lengths``: tokens per prompt (None: no length check); ``limit_why``: where the limit comes from."""
    bad = []
    for i, prompt in enumerate(columns["prompt"]):
        if not prompt_text(prompt).strip():
            bad.append(BadRow(i, "prompt", "empty prompt", f"empty prompt ({prompt!r})"))
            continue
        if (missing := next((c for c in sorted(needs) if columns[c][i] is None), None)) is not None:
            readers = ", ".join(repr(n) for n in needs[missing])
            bad.append(BadRow(i, missing, f"empty {missing!r}", f"empty (None), and reward {readers} needs it"))
            continue
        if prompt_lengths is not None and max_prompt_tokens is not None and prompt_lengths[i] > max_prompt_tokens:
            reason = f"prompt of {prompt_lengths[i]} tokens, over the {max_prompt_tokens} that fit{limit_why}"
            bad.append(BadRow(i, "prompt", "prompt too long", reason))
    return bad


def handle_bad_rows(ds: Any, bad: list[BadRow], source: str, on_bad_row: str) -> Any:
    """``ds`` itself (no bad rows), ``ds`` without them (``skip``, logged), or a ConfigError naming the first."""
    if not bad:
        return ds
    first = bad[0]
    where = f"{source}: row {first.index}, column {first.column!r}: {first.reason}"
    if on_bad_row == "error":
        more = f" ({len(bad)} bad rows in all)" if len(bad) > 1 else ""
        raise ConfigError(f"{where}{more}. Fix the data, or set data.on_bad_row: skip to drop such rows at load")
    counts = Counter(row.kind for row in bad)
    logger.warning("data.on_bad_row=skip: dropped %d of %d rows of %s (%s); first: row %d, %s", len(bad), len(ds),
                   source, ", ".join(f"{k}: {n}" for k, n in counts.items()), first.index, first.reason)  # fmt: skip
    dropped = {row.index for row in bad}
    return ds.select([i for i in range(len(ds)) if i not in dropped])


def prompt_token_counts(prompts: Sequence[Any], tokenizer: Any) -> list[int]:
    """Tokens per prompt as TRL feeds it: chat prompts through the chat template (with the generation prompt)."""
    texts = [p if isinstance(p, str) else tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
             for p in prompts]  # fmt: skip
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def check_rows(ds: Any, source: str, on_bad_row: str, needs: Mapping[str, Sequence[str]], tokenizer: Any = None,
               context: int | None = None, max_completion_length: int | None = None,
               count_tokens: Callable[[Sequence[Any], Any], list[int]] = prompt_token_counts) -> Any:  # fmt: skip
    """``find_bad_rows`` + ``handle_bad_rows`` on a ``datasets.Dataset``; the length check needs all three of
    ``tokenizer``, ``context`` (the model's ``max_position_embeddings``) and ``max_completion_length``."""
    columns = {"prompt": ds["prompt"], **{c: ds[c] for c in needs if c in ds.column_names}}
    needs = {c: names for c, names in needs.items() if c in columns}
    lengths, limit, why = None, None, ""
    if tokenizer is not None and context is not None and max_completion_length is not None:
        limit = context - max_completion_length
        lengths = count_tokens(columns["prompt"], tokenizer)
        why = f" (context {context} - trainer.max_completion_length {max_completion_length})"
    return handle_bad_rows(ds, find_bad_rows(columns, needs, lengths, limit, why), source, on_bad_row)
