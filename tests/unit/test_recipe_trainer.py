"""``GRPOTrainer`` in-process on the tiny model (no Ray, no vLLM): logprobs, one step, staleness, weights."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.recipe.grpo import Group, Sample, clipped_pg_loss
from rlfleet.recipe.logprobs import batch_token_logprobs
from rlfleet.recipe.task import AllowedTokensTask, PromptGenerator
from rlfleet.recipe.trainer import GRPOTrainer
from rlfleet.refit.model_spec import checkpoint_spec
from rlfleet.refit.sender import WeightSender


# One intra-op thread: on a shared 2-core machine OpenMP threads spinning against other
# processes make a step tens of times slower.
THREADS = 1


@pytest.fixture()
def trainer(tiny_model):
    return GRPOTrainer(tiny_model, lr=3e-3, num_threads=THREADS)


def _reference_logprobs(model, prompt, completion):
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return [float(lp[len(prompt) + k - 1, t]) for k, t in enumerate(completion)]


def _self_sample(trainer, prompt, n, length, gen, task, version=None):
    """n completions sampled from the trainer's own policy (exact behaviour logprobs)."""
    ids = torch.tensor([list(prompt)] * n)
    with torch.no_grad():
        for _ in range(length):
            probs = torch.softmax(trainer.model(input_ids=ids).logits[:, -1].float(), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], 1)
    v = trainer.version if version is None else version
    out = []
    for row in ids[:, len(prompt) :].tolist():
        out.append(Sample(tuple(row), tuple(trainer.logprobs(prompt, row)), task.reward(prompt, row), v, v))
    return Group(tuple(prompt), tuple(out))


def test_logprobs_match_a_plain_forward_and_padding_changes_nothing(trainer):
    prompts = PromptGenerator(seed=1).batch(0, 4)
    comps = [[7, 8, 9], [100], [5, 6, 7, 8, 9, 10], [300, 301]]
    for p, c in zip(prompts, comps):
        assert trainer.logprobs(p, c) == pytest.approx(_reference_logprobs(trainer.model, p, c), abs=1e-6)
    with torch.no_grad():
        batched, mask = batch_token_logprobs(trainer.model, list(zip(prompts, comps)), trainer.pad_id)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        assert mask[i].sum() == len(c)
        assert batched[i, : len(c)].tolist() == pytest.approx(trainer.logprobs(p, c), abs=1e-6)
    assert trainer.logprobs([1, 2], []) == []
    with pytest.raises(ValueError):
        trainer.logprobs([], [3])


def test_weights_are_float32_under_checkpoint_names(trainer, tiny_model):
    items = trainer.state_dict_items()
    spec = checkpoint_spec(tiny_model)
    assert {n for n, _ in items} == set(spec)
    for name, t in items:
        assert t.dtype == torch.float32 and not t.requires_grad
        assert tuple(t.shape) == spec[name][0]
    # The trainer is a valid WeightSender source: every weight is sent, live (no copy).
    sent = WeightSender(trainer.state_dict_items, dtype=torch.float32).named_tensors()
    assert [n for n, _ in sent] == [n for n, _ in items]
    assert all(a.data_ptr() == b.data_ptr() for (_, a), (_, b) in zip(sent, items))


def test_one_step_updates_weights_and_version_and_reports_mismatch(trainer):
    task = AllowedTokensTask()
    gen = torch.Generator().manual_seed(0)
    groups = [_self_sample(trainer, p, 8, 6, gen, task) for p in PromptGenerator().batch(0, 4)]
    before = {n: t.clone() for n, t in trainer.state_dict_items()}
    m = trainer.step(groups)
    assert m["trained"] and m["version"] == 0 and m["new_version"] == trainer.version == 1
    assert m["samples"] == 32 and m["tokens"] == 32 * 6
    assert m["mismatch_max"] < 1e-5 and m["fresh_mismatch_max"] == m["mismatch_max"]
    assert m["staleness_max"] == 0 and m["clip_frac"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["reward_mean"] == pytest.approx(sum(s.reward for g in groups for s in g.samples) / 32)
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    changed = [n for n, t in trainer.state_dict_items() if not torch.equal(t, before[n])]
    assert "lm_head.weight" in changed and len(changed) > 10


def test_stale_samples_are_dropped_and_counted(tiny_model):
    trainer = GRPOTrainer(tiny_model, max_staleness=1, initial_version=5, num_threads=THREADS)
    task = AllowedTokensTask()
    gen = torch.Generator().manual_seed(1)
    p = PromptGenerator().prompt(0, 0)
    old = _self_sample(trainer, p, 4, 3, gen, task, version=3)  # 2 versions behind
    m = trainer.step([old])
    assert m["dropped_stale"] == 4 and m["trained"] is False and trainer.version == 5
    ok = _self_sample(trainer, p, 4, 3, gen, task, version=4)  # 1 version behind
    m = trainer.step([old, ok])
    assert m["dropped_stale"] == 4 and m["trained"] and m["staleness_max"] == 1 and trainer.version == 6


def test_zero_variance_groups_leave_weights_alone(trainer):
    p = [1, 10, 11]
    same = Group(tuple(p), tuple(Sample((20, 21), tuple(trainer.logprobs(p, [20, 21])), 0.5) for _ in range(4)))
    before = {n: t.clone() for n, t in trainer.state_dict_items()}
    m = trainer.step([same])
    assert m["groups_with_signal"] == 0 and m["loss"] == 0.0 and m["grad_norm"] == 0.0
    assert all(torch.equal(t, before[n]) for n, t in trainer.state_dict_items())


def test_clipped_loss_matches_ppo_by_hand():
    new = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]])
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    pos, clip_frac, ratio_mean = clipped_pg_loss(new, old, torch.tensor([[1.0]]), mask, 0.2)
    assert float(pos) == pytest.approx(-(1.2 + 0.5) / 2)  # A>0: ratio capped at 1+eps, not floored
    neg, _, _ = clipped_pg_loss(new, old, torch.tensor([[-1.0]]), mask, 0.2)
    assert float(neg) == pytest.approx((1.5 + 0.8) / 2)  # A<0: ratio floored at 1-eps, not capped
    assert clip_frac == 1.0 and ratio_mean == pytest.approx(1.0)


def test_trainer_learns_the_task_from_its_own_samples(tiny_model):
    """The fallback proof without an engine: 12 on-policy steps from the trainer's own samples."""
    torch.manual_seed(0)
    trainer = GRPOTrainer(tiny_model, lr=3e-3, num_threads=THREADS)
    task, prompts = AllowedTokensTask(), PromptGenerator()
    gen = torch.Generator().manual_seed(0)
    curve = []
    for step in range(12):
        groups = [_self_sample(trainer, p, 8, 6, gen, task) for p in prompts.batch(step, 8)]
        curve.append(trainer.step(groups)["reward_mean"])
    first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    print(f"self-play reward first 3 steps {first:.3f}, last 3 steps {last:.3f}: {[round(r, 3) for r in curve]}")
    assert first < 0.15 and last > first + 0.2


def test_trainer_actor_trains_the_model_it_sends_and_refuses_a_torn_update(tiny_model):
    """``GRPOTrainerActor`` in-process (no Ray): one model for sender and trainer; step between prepare and send."""
    import asyncio

    from rlfleet.recipe.actor import GRPOTrainerActor

    async def scenario():
        actor = GRPOTrainerActor(tiny_model, lr=3e-3, threads=THREADS)
        assert actor.trainer.model is actor.model
        task = AllowedTokensTask()
        gen = torch.Generator().manual_seed(2)
        groups = [_self_sample(actor.trainer, p, 4, 4, gen, task) for p in PromptGenerator().batch(0, 2)]
        before = await actor.checksum()
        manifest = await actor.prepare(1, "bucketed", 64.0)
        assert manifest  # planned against version 0
        m = await actor.step(groups)
        assert m["new_version"] == 1 and await actor.get_version() == 1
        assert await actor.checksum() != before  # the sender sees the trained weights
        out = await actor.send(1, 5.0)
        assert out["ok"] is False and "between prepare and send" in out["error"] and out["bytes_sent"] == 0
        lp = await actor.logprobs(groups[0].prompt_ids, groups[0].samples[0].completion_ids)
        assert lp == pytest.approx(actor.trainer.logprobs(groups[0].prompt_ids, groups[0].samples[0].completion_ids))

    asyncio.run(scenario())


def test_the_weight_source_scores_like_the_trainer_and_steps_deterministically(trainer, tiny_model):
    """``faults.source.WeightSource`` in-process (no Ray): the trainer's logprobs; seeded plain and relative steps."""
    import asyncio

    from rlfleet.faults.source import WeightSource

    async def scenario():
        src = WeightSource(tiny_model, threads=THREADS)
        p, c = [1, 10, 11], [20, 21, 22]
        assert await src.logprobs(p, c) == trainer.logprobs(p, c)
        first = next(src.model.parameters())
        w0 = first.detach().clone()
        assert await src.perturb(seed=1, scale=0.02) == len(list(src.model.parameters()))
        noise = torch.randn(w0.shape, generator=torch.Generator().manual_seed(1))
        assert torch.allclose(first.detach() - w0, noise * 0.02, atol=1e-6)  # plain: noise x scale
        w1 = first.detach().clone()
        await src.perturb(seed=1, scale=0.05, relative=True)
        assert torch.allclose(first.detach() - w1, noise * 0.05 * w1.std().item(), atol=1e-6)  # x each tensor's std
        assert await src.logprobs(p, c) != trainer.logprobs(p, c)
        with pytest.raises(ValueError, match="unknown corruption"):
            await src.corrupt_next_update("size")

    asyncio.run(scenario())
