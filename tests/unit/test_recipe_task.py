"""The recipe's pure parts: reward, prompts, advantages, group building, sampling parameters."""

from __future__ import annotations

import math

import pytest

from rlfleet.fleet.data.dispatch import FleetResult
from rlfleet.recipe.config import RecipeConfig
from rlfleet.recipe.grpo import Group, Sample, build_group, group_advantages
from rlfleet.recipe.task import FIRST_ORDINARY_ID, AllowedTokensTask, PromptGenerator
from rlfleet.fleet.types import Completion, GenerationResult


# -- reward ------------------------------------------------------------------------------
def test_allowed_set_is_seeded_distinct_and_never_special():
    a, b, c = AllowedTokensTask(seed=0), AllowedTokensTask(seed=0), AllowedTokensTask(seed=1)
    assert a.allowed == b.allowed and a.allowed != c.allowed
    assert len(a.allowed) == 32
    assert all(FIRST_ORDINARY_ID <= t < 512 for t in a.allowed)
    assert a.chance_reward == pytest.approx(32 / 512)


def test_reward_is_fraction_of_allowed_tokens():
    task = AllowedTokensTask()
    good = sorted(task.allowed)
    bad = [t for t in range(FIRST_ORDINARY_ID, 512) if t not in task.allowed]
    assert task.reward([1, 5], good[:4]) == 1.0
    assert task.reward([1, 5], bad[:4]) == 0.0
    assert task.reward([1, 5], [good[0], bad[0], good[1], bad[1]]) == 0.5
    assert task.reward([1, 5], [good[0]] + bad[:5]) == pytest.approx(1 / 6)
    assert task.reward([1, 5], []) == 0.0


def test_reward_ignores_the_prompt():
    task = AllowedTokensTask()
    comp = sorted(task.allowed)[:3] + [3]
    assert task.reward([1], comp) == task.reward([1, 2, 3, 4, 5, 6], comp) == 0.75


def test_bad_allowed_size_is_rejected():
    with pytest.raises(ValueError, match="num_allowed"):
        AllowedTokensTask(num_allowed=0)
    with pytest.raises(ValueError, match="num_allowed"):
        AllowedTokensTask(vocab_size=16, num_allowed=13)


# -- prompts -----------------------------------------------------------------------------
def test_prompts_are_a_pure_function_of_seed_step_index():
    g = PromptGenerator(seed=3)
    first = g.batch(5, 8)
    assert PromptGenerator(seed=3).batch(5, 8) == first  # a fresh generator, same prompts
    assert g.batch(5, 8) == first  # asking twice changes nothing
    assert g.batch(5, 4) == first[:4]
    assert g.batch(6, 8) != first
    assert PromptGenerator(seed=4).batch(5, 8) != first
    assert len({tuple(p) for p in first}) == 8


def test_prompt_shape():
    g = PromptGenerator(seed=0, min_len=6, max_len=10)
    prompts = [p for step in range(20) for p in g.batch(step, 8)]
    assert all(p[0] == 1 for p in prompts)
    assert all(6 <= len(p) <= 10 for p in prompts)
    assert all(FIRST_ORDINARY_ID <= t < 512 for p in prompts for t in p[1:])
    assert {len(p) for p in prompts} == set(range(6, 11))
    with pytest.raises(ValueError):
        PromptGenerator(min_len=5, max_len=4)


# -- advantages --------------------------------------------------------------------------
def test_advantages_are_group_normalised():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5])
    mean, std = 0.5, math.sqrt(0.125)
    assert adv == pytest.approx([(r - mean) / (std + 1e-6) for r in (1.0, 0.0, 0.5, 0.5)])
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)
    assert math.fsum(a * a for a in adv) / 4 == pytest.approx(1.0, rel=1e-4)  # unit population variance


def test_advantages_are_invariant_to_reward_shift_and_scale():
    base = [0.1, 0.4, 0.4, 0.9, 0.0]
    assert group_advantages([3 * r + 7 for r in base]) == pytest.approx(group_advantages(base), rel=1e-5)


@pytest.mark.parametrize("rewards", [[0.0] * 8, [1.0] * 8, [0.3] * 5, [1 / 3] * 3, [0.7]])
def test_zero_variance_group_has_exactly_zero_advantages(rewards):
    assert group_advantages(rewards) == [0.0] * len(rewards)


def test_empty_group_and_eps():
    assert group_advantages([]) == []
    # a tiny but real spread is normalised (eps keeps it finite), not zeroed
    adv = group_advantages([0.0, 1e-3])
    assert adv[0] < 0 < adv[1] and abs(adv[1]) == pytest.approx(1.0, rel=1e-2)


# -- groups from engine results ----------------------------------------------------------
def _result(tokens_per_completion, version=(0, 0), finish="length"):
    comps = tuple(Completion(tuple(t), tuple(-1.0 for _ in t), finish) for t in tokens_per_completion)
    return GenerationResult("r", (1, 9), comps, version_start=version[0], weight_version=version[1], slot=0, incarnation=1)


def test_build_group_scores_every_completion_and_skips_returns():
    task = AllowedTokensTask()
    good, bad = sorted(task.allowed)[0], next(t for t in range(4, 512) if t not in task.allowed)
    results = [
        _result([[good, good], [good, bad]], version=(3, 4)),  # one request, n=2
        FleetResult("f1", "completed", _result([[bad, bad]], version=(4, 4))),
        FleetResult("f2", "returned", None, reason="fleet exhausted"),
        _result([[good]], finish="abort"),  # an explicit abort is not a zero-reward sample
    ]
    group, skipped = build_group([1, 9], results, task)
    assert skipped == 2
    assert group.prompt_ids == (1, 9)
    assert group.rewards == [1.0, 0.5, 0.0]
    assert [(s.version_start, s.weight_version) for s in group.samples] == [(3, 4), (3, 4), (4, 4)]
    assert group.samples[0].logprobs == (-1.0, -1.0)


def test_sample_rejects_mismatched_logprobs():
    with pytest.raises(ValueError, match="logprobs"):
        Sample((1, 2), (-0.1,), 0.0)
    assert Group((1,), ()).rewards == []


# -- sampling parameters -----------------------------------------------------------------
def test_sampling_params_and_seeds_never_collide():
    cfg = RecipeConfig(prompts_per_step=8, samples_per_prompt=8, max_tokens=6, seed=0)
    p = cfg.sampling(2, 3)
    assert p == {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "seed": cfg.seed_for(2, 3)}
    assert cfg.sampling(2, 3, sample_index=5)["seed"] == cfg.seed_for(2, 3) + 5
    assert "n" not in p
    seeds = [cfg.seed_for(s, j) + i for s in range(50) for j in range(8) for i in range(8)]
    assert len(set(seeds)) == len(seeds)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        RecipeConfig(samples_per_prompt=0)
