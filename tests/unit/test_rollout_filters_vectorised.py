"""QUATRO's rollout filters as tensor code against the per-row Python reference (``reference_rollout_filters``):
identical keep masks, reason counts, zero-variance groups, warnings, length history and shares, on random batches
built to hit every filter, and on hand-computed cases."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from fake_context import FakeContext, Quatro
from reference_rollout_filters import ReferenceRolloutFilter, reference_shares

from steadyrl.guards import rollout_filters
from steadyrl.guards.quatro import QuatroConfig
from steadyrl.guards.rollout_filters import (
    FILTER_REASONS,
    NO_GRAM,
    FilterConfig,
    LengthConfig,
    LengthHistory,
    ParrotConfig,
    RepetitionConfig,
    RolloutFilter,
    TokenBatch,
    ZeroVarianceConfig,
    ZScoreConfig,
    _can_repeat_over,
    ngram_codes,
    no_signal_groups,
    parrot_shares,
    repeat_shares,
)
from steadyrl.trainers.context import RuntimeContext
from steadyrl.trainers.rollout import gather_token_batches

NAN = math.nan


# ------------------------------------------------------------------------------------------- random batches


def _completion(rng: random.Random, prompt: list[int], group: list[list[int]], vocab: int, width: int) -> list[int]:
    kind = rng.choice(("random", "repeat", "parrot", "parrot_part", "duplicate", "near", "empty", "short", "mixed"))
    length = rng.randint(0, width)
    if kind == "repeat":  # a short pattern over and over
        pattern = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        return (pattern * (length // len(pattern) + 1))[:length]
    if kind == "parrot" and prompt:
        start = rng.randrange(len(prompt))
        return prompt[start : start + length]
    if kind == "parrot_part" and prompt:  # part copied, part new
        start = rng.randrange(len(prompt))
        return prompt[start : start + length // 2] + [rng.randrange(vocab) for _ in range(length - length // 2)]
    if kind == "duplicate" and group:
        return list(rng.choice(group))
    if kind == "near" and group:  # an earlier row with one id changed, added or removed
        row = list(rng.choice(group))
        edit = rng.choice(("change", "add", "drop"))
        if edit == "change" and row:
            row[rng.randrange(len(row))] = rng.randrange(vocab)
        elif edit == "add":
            row.insert(rng.randint(0, len(row)), rng.randrange(vocab))
        elif row:
            row.pop(rng.randrange(len(row)))
        return row
    if kind == "empty":
        return []
    if kind == "short":  # shorter than most n
        return [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
    if kind == "mixed" and group:
        return list(rng.choice(group))[: length // 2] + [rng.randrange(vocab) for _ in range(length // 2)]
    return [rng.randrange(vocab) for _ in range(length)]


def random_batch(
    rng: random.Random, groups: int, group_size: int, vocab: int, prompt_width: int = 20, completion_width: int = 32
) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
    prompts, completions = [], []
    for _ in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, prompt_width))]
        group: list[list[int]] = []
        for _ in range(group_size):
            group.append(_completion(rng, prompt, group, vocab, completion_width))
        prompts += [prompt] * group_size
        completions += group
    kind = rng.choice(("continuous", "pass_fail", "few_values", "constant"))
    rewards = []
    for _ in range(groups * group_size):
        if kind == "continuous":
            value = rng.gauss(0.0, 1.0) * (25.0 if rng.random() < 0.03 else 1.0)  # a few outliers
        elif kind == "pass_fail":
            value = float(rng.random() < 0.3)
        elif kind == "few_values":
            value = rng.choice((0.0, 0.5, 1.0, 1.0))
        else:
            value = 1.0
        roll = rng.random()
        rewards.append(NAN if roll < 0.05 else math.inf if roll < 0.07 else -math.inf if roll < 0.08 else value)
    return torch.tensor(rewards, dtype=torch.float32), prompts, completions


def random_config(rng: random.Random, monkeypatch: pytest.MonkeyPatch) -> FilterConfig:
    """Every filter on, thresholds on and around the shares' exact values; the module constants (the parrot
    filter's n, the z-score filter's distinct values, the length filter's rolling range) patched at random too."""
    shares = (0.0, 0.25, 1 / 3, 0.5, 2 / 3, 0.75, 0.8, 0.9, 1.0, rng.random())
    low = rng.choice((1.0, 10.0, 25.0))
    monkeypatch.setattr(rollout_filters, "MIN_DISTINCT", rng.randint(1, 4))
    monkeypatch.setattr(rollout_filters, "LENGTH_PERCENTILES", (low, rng.choice((75.0, 90.0, 99.0, 99.99999999))))
    monkeypatch.setattr(rollout_filters, "LENGTH_FENCE", rng.choice((0.0, 0.5, 3.0)))
    monkeypatch.setattr(rollout_filters, "LENGTH_HISTORY", rng.choice((64, 200)))
    monkeypatch.setattr(rollout_filters, "LENGTH_MIN_HISTORY", rng.choice((8, 40)))
    monkeypatch.setattr(rollout_filters, "PARROT_N", rng.randint(1, 5))
    return FilterConfig(
        zscore=ZScoreConfig(enabled=rng.random() < 0.8, max_abs_z=rng.choice((0.5, 1.0, 2.0, 3.5))),
        length=LengthConfig(
            min_tokens=rng.randint(0, 3),
            max_tokens=rng.choice((None, 20, 30)),
            rolling=rng.random() < 0.8,
        ),
        parrot=ParrotConfig(max_overlap=rng.choice(shares)),
        repetition=RepetitionConfig(n=rng.randint(1, 5), max_repeat_share=rng.choice(shares)),
        zero_variance=ZeroVarianceConfig(enabled=rng.random() < 0.8),
        max_drop_share=rng.choice((0.0, 0.5, 1.0)),
    )


def padded(rows: list[list[int]], rng: random.Random, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) with garbage in the padding (negative, huge, in-vocabulary) and extra padding columns."""
    width = max((len(r) for r in rows), default=0) + rng.randint(0, 3)
    garbage = rng.choice(((0,), (0, 3), (-7, 0, 3, 2**40)))  # a pad id, in-range values, or a range that won't fit
    ids = torch.tensor([[rng.choice(garbage) for _ in range(width)] for _ in rows], dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, cols] = torch.tensor(row, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def assert_same(new, ref) -> None:
    assert new.keep.tolist() == ref.keep.tolist()
    assert new.keep.dtype == ref.keep.dtype == torch.bool and new.keep.device == ref.keep.device
    assert new.reasons == ref.reasons and list(new.reasons) == list(FILTER_REASONS)
    assert all(type(v) is int for v in new.reasons.values())
    assert new.zero_variance_groups.tolist() == ref.zero_variance_groups.tolist()
    assert new.warning == ref.warning
    assert new.metrics() == ref.metrics()


def assert_shares_equal(
    prompts: list[list[int]], completions: list[list[int]], cfg: FilterConfig, group_size: int, batches
) -> None:
    prompt_batch, completion_batch = batches
    parrot, repeat = reference_shares(prompts, completions, rollout_filters.PARROT_N, cfg.repetition.n)
    new_parrot = parrot_shares(prompt_batch, completion_batch, rollout_filters.PARROT_N)
    new_repeat = repeat_shares(completion_batch, cfg.repetition.n)
    assert new_parrot.dtype == new_repeat.dtype == torch.float64
    assert new_parrot.tolist() == parrot and new_repeat.tolist() == repeat  # bit for bit (so also to 1e-12)


@pytest.mark.parametrize("pairs", ["broadcast", "sorted"])
@pytest.mark.parametrize("seed", range(12))
def test_tensor_filters_match_the_reference_row_by_row(seed: int, pairs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pairs``: parrot_shares' membership test, every pair compared at once or a binary search in sorted n-grams
    (the random rows are short enough for the first; a bound of -1 forces the second)."""
    if pairs == "sorted":
        monkeypatch.setattr(rollout_filters, "BROADCAST_PAIRS", -1)
    rng = random.Random(seed)
    cfg = random_config(rng, monkeypatch)
    group_size = rng.choice((1, 2, 4, 8, 16))
    new, ref = RolloutFilter(cfg), ReferenceRolloutFilter(cfg)
    for _ in range(8):  # successive calls: the rolling length range comes into play, from each one's own history
        groups = rng.choice((1, 3, 8, 16)) if group_size < 16 else rng.choice((1, 4, 8))
        vocab = rng.choice((3, 6, 50, 50_000))
        rewards, prompts, completions = random_batch(rng, groups, group_size, vocab)
        p_ids, p_mask = padded(prompts, rng, left=True)
        c_ids, c_mask = padded(completions, rng)
        batches = (TokenBatch.from_mask(p_ids, p_mask), TokenBatch(c_ids, c_mask.sum(dim=1)))
        assert batches[0].to_lists() == prompts and batches[1].to_lists() == completions
        assert_shares_equal(prompts, completions, cfg, group_size, batches)
        got, expected = new(rewards, *batches, group_size), ref(rewards, prompts, completions, group_size)
        assert_same(got, expected)
        assert new.state_dict() == ref.state_dict()
        assert new.length_range() == ref.length_range()
    restored = RolloutFilter(cfg)  # a resume: the reference's state in a fresh tensor filter
    restored.load_state_dict(ref.state_dict())
    assert restored.state_dict() == ref.state_dict() and restored.length_range() == ref.length_range()
    rewards, prompts, completions = random_batch(rng, 2, group_size, 6)
    assert_same(restored(rewards, prompts, completions, group_size), ref(rewards, prompts, completions, group_size))


@pytest.mark.parametrize("vocab", [2**20, 2**40, 2**62])
def test_tensor_filters_match_the_reference_when_ngrams_do_not_fit_one_int64(
    vocab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ids spread over a range whose n-th power passes 2**63 (and one whose range passes 2**63 itself): the codes
    are dense ranks of the n-grams, still exact."""
    rng = random.Random(vocab)
    monkeypatch.setattr(rollout_filters, "MIN_DISTINCT", 1)
    for n in (2, 3, 4, 5):
        monkeypatch.setattr(rollout_filters, "PARROT_N", n)
        cfg = FilterConfig(
            length=LengthConfig(rolling=False),
            parrot=ParrotConfig(max_overlap=0.3),
            repetition=RepetitionConfig(n=n, max_repeat_share=0.2),
        )
        # a few "tokens" far apart, plus their neighbours: a lossy packing would confuse them
        alphabet = [0, 1, vocab - 1, vocab - 2, vocab // 2, vocab // 2 + 1]
        if vocab == 2**62:
            alphabet += [-(2**62), -(2**62) + 1]  # the ids span more than 2**63
        rewards, prompts, completions = random_batch(rng, 6, 4, len(alphabet))
        prompts = [[alphabet[i] for i in row] for row in prompts]
        completions = [[alphabet[i] for i in row] for row in completions]
        batches = (TokenBatch.from_lists(prompts), TokenBatch.from_lists(completions))
        assert_shares_equal(prompts, completions, cfg, 4, batches)
        assert_same(
            RolloutFilter(cfg)(rewards, *batches, 4), ReferenceRolloutFilter(cfg)(rewards, prompts, completions, 4)
        )


def test_list_and_tensor_inputs_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(7)
    cfg = random_config(rng, monkeypatch)
    rewards, prompts, completions = random_batch(rng, 4, 4, 10)
    as_lists = RolloutFilter(cfg)(rewards, prompts, completions, 4)
    as_tensors = RolloutFilter(cfg)(
        rewards, [torch.tensor(p) for p in prompts], [torch.tensor(c) for c in completions], 4
    )
    batches = TokenBatch.from_lists(prompts), TokenBatch.from_lists(completions)
    assert_same(as_lists, as_tensors)
    assert_same(as_lists, RolloutFilter(cfg)(rewards, *batches, 4))
    assert_same(as_lists, ReferenceRolloutFilter(cfg)(rewards, *batches, 4))


def test_empty_batch_and_empty_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = random_config(random.Random(3), monkeypatch)
    empty = RolloutFilter(cfg)(torch.zeros(0), [], [], 4)
    assert empty.keep.tolist() == [] and empty.zero_variance_groups.tolist() == [] and empty.warning is None
    rewards = torch.tensor([0.0, 1.0, 2.0, 3.0])
    new = RolloutFilter(cfg)(rewards, [[]] * 4, [[]] * 4, 2)  # no ids at all: (4, 0) tensors
    assert_same(new, ReferenceRolloutFilter(cfg)(rewards, [[]] * 4, [[]] * 4, 2))


# ----------------------------------------------------------------------------------------- hand-computed cases


def test_ngram_codes_pack_exactly_or_rank() -> None:
    batch = TokenBatch(torch.tensor([[1, 2, 3, 99], [3, 1, 0, 0]]), torch.tensor([3, 2]))
    ((codes, grams),) = ngram_codes([batch], 2)
    # the range of the whole tensor, padding included, fits: base 100, (1 2) -> 1*100+2, (2 3) -> 203, (3 1) -> 301
    assert grams.tolist() == [[True, True, False], [True, False, False]]
    assert codes.tolist() == [[102, 203, NO_GRAM], [301, NO_GRAM, NO_GRAM]]
    batch = TokenBatch(torch.tensor([[1, 2, 3, 2**62], [3, 1, -(2**62), 0]]), torch.tensor([3, 2]))
    ((codes, grams),) = ngram_codes([batch], 2)
    # the range of the whole tensor, padding included, does not fit: the codes are the ranks of the n-grams,
    # (1 2) -> 0, (2 3) -> 1, (3 1) -> 2
    assert codes.tolist() == [[0, 1, NO_GRAM], [2, NO_GRAM, NO_GRAM]]
    batch = TokenBatch(torch.tensor([[-1, 0, 1], [1, -1, 5]]), torch.tensor([3, 2]))
    ((codes, grams),) = ngram_codes([batch], 2)  # a negative id: shifted, base 5 - (-1) + 1 = 7, digits id + 1
    assert codes.tolist() == [[0 * 7 + 1, 1 * 7 + 2], [2 * 7 + 0, NO_GRAM]]
    big = 2**40  # base 2**40 + 1: two ids do not fit one int64, so the codes are ranks of the n-grams
    batch = TokenBatch(torch.tensor([[big, 1, big, 1, 7]]), torch.tensor([4]))
    ((codes, grams),) = ngram_codes([batch], 2)
    a, b, c = codes[0].tolist()[:3]
    assert a == c != b and codes[0, 3] == NO_GRAM and grams[0].tolist() == [True, True, True, False]
    ((short, grams),) = ngram_codes([batch], 6)  # longer than the row: no n-grams
    assert short.shape == (1, 0) and grams.shape == (1, 0)


def test_repeat_and_parrot_shares_by_hand() -> None:
    rows = [[7, 7, 7, 7, 7], [1, 2, 3, 1, 2, 3], [1, 2], []]
    assert repeat_shares(TokenBatch.from_lists(rows), 3).tolist() == [1 - 1 / 3, 1 - 3 / 4, 0.0, 0.0]
    assert repeat_shares(TokenBatch.from_lists(rows), 1).tolist() == [1 - 1 / 5, 1 - 3 / 6, 0.0, 0.0]
    prompts = TokenBatch.from_lists([[1, 2, 3, 4, 5, 6]] * 3 + [[1, 2]])
    completions = TokenBatch.from_lists([[2, 3, 4, 5, 6, 9], [1, 2, 3, 4, 5, 6], [1, 2], [1, 2, 1, 2, 1]])
    # (2345) (3456) in the prompt, (4569) not; all; no 4-gram; a prompt shorter than n has none
    assert parrot_shares(prompts, completions, 4).tolist() == [2 / 3, 1.0, 0.0, 0.0]
    assert parrot_shares(prompts, completions, 2).tolist() == [4 / 5, 1.0, 1.0, 2 / 4]  # (1 2) in, (2 1) not


def test_repetition_pass_is_skipped_only_when_no_row_can_be_dropped() -> None:
    """A row of t n-grams repeats at most 1 - 1/t of them. The bound must be the share's own rounding: 7 7 7 7 7
    has 3 trigrams, 1 distinct, share 1 - 1/3 = 0.6666666666666667, which is above the float 2/3
    (0.6666666666666666); a bound of (t - 1) / t = 2/3 would skip the pass and keep the row."""
    only_repetition = FilterConfig(
        zscore=ZScoreConfig(enabled=False),
        length=LengthConfig(enabled=False),
        parrot=ParrotConfig(enabled=False),
        repetition=RepetitionConfig(n=3, max_repeat_share=2 / 3),
        zero_variance=ZeroVarianceConfig(enabled=False),
    )
    rows = [[7, 7, 7, 7, 7], [1, 2, 3, 4, 5]]
    result = RolloutFilter(only_repetition)(torch.tensor([1.0, 0.0]), [[9]] * 2, rows, 2)  # row 0 paid
    assert result.keep.tolist() == [False, True] and result.reasons["repetition"] == 1
    rng = random.Random(3)
    for _ in range(300):  # wherever the pass is skipped, it would have dropped nothing
        width, n = rng.randint(0, 6), rng.randint(1, 4)
        batch = TokenBatch.from_lists(
            [[rng.randrange(3) for _ in range(rng.randint(0, width))] for _ in range(rng.randint(1, 6))]
        )
        share = rng.choice((0.0, 0.25, 0.5, 1 / 3, 2 / 3, 0.75, 0.8, rng.random()))
        if not _can_repeat_over(batch.lengths, n, share):
            assert not (repeat_shares(batch, n) > share).any()


def test_length_quantiles_are_torch_quantile_bit_for_bit() -> None:
    rng = random.Random(8)
    for _ in range(400):
        history = LengthHistory(rng.choice((1, 2, 5, 17, 256)))
        for _ in range(rng.randint(1, 4)):
            values = [rng.choice((rng.randint(0, 40), rng.randint(0, 5000))) for _ in range(rng.randint(1, 300))]
            history.extend(torch.tensor(values))
        qs = (rng.choice((0.0, 0.01, rng.random())), rng.choice((0.99, 1.0, rng.random())))
        q = torch.tensor(qs, dtype=torch.float64)
        expected = torch.quantile(history.values().double(), q, interpolation="linear")
        assert history.quantiles(qs) == expected.tolist()
    with pytest.raises(ValueError, match="no lengths"):
        LengthHistory(4).quantiles((0.5,))


def test_zscore_length_and_no_signal_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    values = torch.tensor([1, 1, 0, 1, NAN, 1, 2, 2, 0, 5, 3, math.inf], dtype=torch.float64)
    kept = torch.tensor([True] * 9 + [False, True, True])
    # [1 1] equal; [0 1]; [NaN 1] one finite; [2 2] equal; [0 (5 dropped)] one left; [3 inf] one finite
    assert no_signal_groups(values, kept, 2).tolist() == [True, False, True, True, True, True]

    # the length range is a float a float32 comparison would round: 1 + 2 * 0.9999999999 = 2.9999999998
    monkeypatch.setattr(rollout_filters, "LENGTH_PERCENTILES", (0.0, 99.99999999))
    monkeypatch.setattr(rollout_filters, "LENGTH_FENCE", 0.0)
    monkeypatch.setattr(rollout_filters, "LENGTH_HISTORY", 8)
    monkeypatch.setattr(rollout_filters, "LENGTH_MIN_HISTORY", 2)
    cfg = FilterConfig(
        zscore=ZScoreConfig(enabled=False),
        length=LengthConfig(rolling=True),
        parrot=ParrotConfig(enabled=False),
        repetition=RepetitionConfig(enabled=False),
        zero_variance=ZeroVarianceConfig(enabled=False),
    )
    new, ref = RolloutFilter(cfg), ReferenceRolloutFilter(cfg)
    first = [[1], [1, 1, 1]]
    assert_same(new(torch.tensor([0.0, 1.0]), [[0]] * 2, first, 2), ref(torch.tensor([0.0, 1.0]), [[0]] * 2, first, 2))
    low, high = new.length_range()
    assert low == 1.0 and 2.9999999 < high < 3.0 and torch.tensor(high, dtype=torch.float32).item() == 3.0
    second = [[1, 1, 1], [1, 1]]  # 3 tokens: above 2.9999999998, dropped
    got = new(torch.tensor([0.0, 1.0]), [[0]] * 2, second, 2)
    assert got.keep.tolist() == [False, True]
    assert_same(got, ref(torch.tensor([0.0, 1.0]), [[0]] * 2, second, 2))

    rewards = torch.tensor([0.0, 1.0, 0.5, 0.0] * 4 + [0.0, 1.0, 0.5, 40.0] + [NAN, 0.0, 1.0, 0.5])
    n = rewards.numel()
    only_z = FilterConfig(
        zscore=ZScoreConfig(enabled=True),
        length=LengthConfig(enabled=False),
        parrot=ParrotConfig(enabled=False),
        repetition=RepetitionConfig(enabled=False),
        zero_variance=ZeroVarianceConfig(enabled=False),
    )
    result = RolloutFilter(only_z)(rewards, [[100]] * n, [[i] for i in range(n)], 4)
    assert result.keep.tolist() == [i != 19 for i in range(n)] and result.reasons["zscore"] == 1


def test_token_batch_from_mask_and_checks() -> None:
    ids = torch.tensor([[0, 0, 5, 6], [7, 0, 8, 0], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])
    batch = TokenBatch.from_mask(ids, mask)
    assert batch.to_lists() == [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    assert batch.to_lists() == [[5, 6], [7, 8], []]
    with pytest.raises(ValueError, match="integer tensor"):
        TokenBatch(torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 3\]"):
        TokenBatch(torch.zeros(2, 3, dtype=torch.long), torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="one of each per row"):
        RolloutFilter()(torch.tensor([1.0, 2.0]), TokenBatch.from_lists([[1]]), [[1], [2]], 1)


# ------------------------------------------------------------------------------------ the runtime's gathering


def test_runtime_gathers_padded_ids_over_ranks_and_filters_like_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks (the fake context repeats this rank's rows): the gathered batch is every rank's rows in rank
    order, prompts left-padded with their mask, completions cut at TRL's lengths, not at ``completion_mask``."""
    rng = random.Random(11)
    cfg = random_config(rng, monkeypatch)
    rewards, prompts, completions = random_batch(rng, 2, 4, 8)
    p_ids, p_mask = padded(prompts, rng, left=True)
    c_ids, c_mask = padded(completions, rng)
    lengths = c_mask.sum(dim=1)
    output = {"prompt_ids": p_ids, "prompt_mask": p_mask, "completion_ids": c_ids, "completion_mask": 0 * c_mask}
    ctx = FakeContext(world=2)
    gathered = gather_token_batches(ctx, p_ids, p_mask, c_ids, lengths)
    assert gathered[0].to_lists() == prompts * 2 and gathered[1].to_lists() == completions * 2
    keep = Quatro(QuatroConfig(filters=cfg), ctx=ctx).rollout.filter_generation(
        output, rewards.repeat(2), lengths, num_generations=4
    )
    expected = ReferenceRolloutFilter(cfg)(rewards.repeat(2), prompts * 2, completions * 2, 4)
    assert keep.tolist() == expected.keep.tolist()


def test_one_process_skips_the_packing_and_gets_the_same_batches() -> None:
    """On one process the rows are taken as they are, without the widths collective and the packed tensor; the
    batches equal what the packing path makes of the same rows (a context that claims two ranks, gathering one)."""
    rng = random.Random(5)
    _, prompts, completions = random_batch(rng, 3, 4, 8)
    p_ids, p_mask = padded(prompts, rng, left=True)
    c_ids, c_mask = padded(completions, rng)
    lengths = c_mask.sum(dim=1)
    calls: list[torch.Tensor] = []
    packing = RuntimeContext(gather=lambda t: calls.append(t) or t, processes=2)
    direct = gather_token_batches(RuntimeContext(gather=lambda t: calls.append(t) or t), p_ids, p_mask, c_ids, lengths)
    assert calls == []  # no collective on one process
    packed = gather_token_batches(packing, p_ids, p_mask, c_ids, lengths)
    assert len(calls) == 2
    for a, b in zip(direct, packed, strict=True):
        assert a.to_lists() == b.to_lists() and torch.equal(a.lengths, b.lengths)
    assert direct[0].to_lists() == prompts and direct[1].to_lists() == completions


# ------------------------------------------------------------------------------------------ recorded batches

RECORDED = Path(__file__).parent / "data" / "recorded_filter_batches.pt"


@pytest.mark.parametrize("filters", ["defaults", "every filter, tight"])
def test_tensor_filters_match_the_reference_on_recorded_training_batches(
    filters: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve generation batches QUATRO's filters saw in a real tiny GRPO run (every layer on, steps 1-12: 64 rows,
    6-token prompts, 4-token completions, the gathered weighted rewards), fed in order to the tensor filter and to
    the per-row reference: the same keep masks, reasons, warnings and state after every call. The tight config
    sets every threshold where these rows hit it."""
    recorded = torch.load(RECORDED, weights_only=True)["batches"]
    cfg = FilterConfig()
    if filters != "defaults":
        monkeypatch.setattr(rollout_filters, "LENGTH_MIN_HISTORY", 64)
        monkeypatch.setattr(rollout_filters, "PARROT_N", 1)
        monkeypatch.setattr(rollout_filters, "PARROT_MIN_NGRAMS", 1)  # 4-token completions
        cfg = FilterConfig(
            zscore=ZScoreConfig(enabled=True),
            length=LengthConfig(max_tokens=3, rolling=True),
            parrot=ParrotConfig(max_overlap=0.5),
            repetition=RepetitionConfig(n=1, max_repeat_share=0.3),
        )
    new, ref = RolloutFilter(cfg), ReferenceRolloutFilter(cfg)
    dropped = dict.fromkeys(FILTER_REASONS, 0)
    for batch in recorded:
        prompts = TokenBatch(batch["prompt_ids"].long(), batch["prompt_lengths"].long())
        completions = TokenBatch(batch["completion_ids"].long(), batch["completion_lengths"].long())
        rewards, group = batch["rewards"], batch["num_generations"]
        got = new(rewards, prompts, completions, group)
        assert_same(got, ref(rewards, prompts.to_lists(), completions.to_lists(), group))
        assert new.state_dict() == ref.state_dict()
        for reason, count in got.reasons.items():
            dropped[reason] += count
    assert len(recorded) == 12 and dropped["zero_variance"] > 0
    firing = [r for r in ("length", "parrot", "repetition") if dropped[r]]
    assert firing == ([] if filters == "defaults" else ["length", "parrot", "repetition"])
