"""The RL demo end to end: every algorithm trains under jit, GRPO and PPO raise the
reward over the warm start, the task's reward matches an independent string-level
scorer, and a checkpoint restores to exactly the same next step."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl_kernels.demo import ALGOS, Config, Demo, checkpoint  # noqa: E402
from jaxrl_kernels.demo.__main__ import main  # noqa: E402
from jaxrl_kernels.demo.task import EOS, PAD, AdditionTask  # noqa: E402

# A tiny model on one-digit addition: small enough to compile and train in seconds.
TINY = dict(digits=1, held_out=10, d_model=32, layers=1, heads=2, warmup_batch=64,
            warmup_lr=3e-3, batch_size=16, group_size=8, lr=1e-3, lr_warmup=5,
            eval_every=10**6, seed=0)
WARMUP_STEPS = 60
RL_STEPS = 100
# Mean sampled reward gain over the warm start asserted for grpo and ppo. Seen with these
# settings (KL 0.02) on seeds 0-7: grpo +0.08..+0.20, ppo +0.15..+0.29 (seed 0: +0.15, +0.23).
IMPROVEMENT = 0.05


def _reward_by_strings(tokens, total, task):
    """Independent scorer: render the answer as text and apply the reward's definition."""
    text = "".join("E" if t == EOS else "P" if t == PAD else "+="[t - 10] if t >= 10 else str(t)
                   for t in tokens)
    if "E" not in text:
        return 0.0, False
    answer = text[:text.index("E")]
    if not (1 <= len(answer) <= task.digits + 1 and answer.isdigit()):
        return 0.0, False
    if int(answer) != total:
        return task.format_credit, False
    return 1.0 + task.brevity * (task.max_new - len(answer) - 1) / task.max_new, True


@pytest.mark.parametrize("digits", [1, 2])
def test_reward_matches_string_scorer(digits):
    task = AdditionTask(digits=digits, held_out=10)
    rng = np.random.default_rng(digits)
    _, sums = task.train_batch(0, 0, 400)
    answers = task.answer_tokens(sums)
    # Mix correct answers, corrupted ones and uniform noise over the vocabulary.
    noise = rng.integers(0, 14, answers.shape)
    digit_noise = rng.integers(0, 10, answers.shape)
    pick = rng.integers(0, 3, (len(sums), 1))
    tokens = np.where(pick == 0, answers, np.where(pick == 1, noise,
                                                   np.where(answers < 10, digit_noise, answers)))
    got = jax.device_get(task.score(jnp.asarray(tokens), jnp.asarray(sums)))
    want = [_reward_by_strings(t, int(s), task) for t, s in zip(tokens, sums)]
    np.testing.assert_allclose(got["reward"], [w[0] for w in want], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got["correct"], [float(w[1]) for w in want])
    assert got["correct"].mean() > 0.3 and got["well_formed"].mean() < 1.0


def test_held_out_never_trained_on():
    task = AdditionTask(digits=2, held_out=500)
    held, _ = task.held_out_set()
    seen, _ = task.train_batch(3, 7, 5000)
    as_set = lambda a: {tuple(r) for r in a}
    assert len(as_set(held)) == 500 and not as_set(held) & as_set(seen)


@pytest.fixture(scope="module")
def warm_params():
    demo = Demo(Config(algo="reinforce", warmup_steps=WARMUP_STEPS, **TINY))
    params = demo.init_params()
    opt_state = demo.sft_optimizer.init(params)
    for i in range(WARMUP_STEPS):
        params, opt_state, _ = demo.sft_step(params, opt_state, *demo.sft_batch(i))
    return params


@pytest.fixture(scope="module")
def demos():
    """One Demo (so one compilation) per algorithm, shared by the tests below."""
    cache = {}

    def get(algo):
        if algo not in cache:
            kl = 0.02 if algo in ("grpo", "ppo") else 0.0
            cache[algo] = Demo(Config(algo=algo, steps=RL_STEPS, kl_coef=kl, **TINY))
        return cache[algo]

    return get


@pytest.mark.parametrize("algo", ALGOS)
def test_algo_trains_end_to_end(algo, warm_params, demos):
    demo = demos(algo)
    # A fixed batch of training prompts, scored with a fixed sampling key before and after.
    prompts, sums = demo.task.train_batch(0, 0, 256, phase=2)
    state = demo.init_state(warm_params)
    before = demo.evaluate(state["params"], prompts, sums)
    steps = RL_STEPS if algo in ("grpo", "ppo") else 3
    for step in range(steps):
        state, metrics = demo.step(state, step)
    assert all(np.isfinite(float(v)) for v in metrics.values()), metrics
    assert int(state["step"]) == steps
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state["params"], warm_params)
    assert all(jax.tree.leaves(moved))
    if algo in ("grpo", "ppo"):
        after = demo.evaluate(state["params"], prompts, sums)
        gain = after["sampled_reward"] - before["sampled_reward"]
        assert gain > IMPROVEMENT, (before, after)


def test_checkpoint_resume_gives_the_same_next_step(tmp_path, warm_params, demos):
    demo = demos("grpo")
    state = demo.init_state(warm_params)
    for step in range(2):
        state, _ = demo.step(state, step)
    path = os.path.join(tmp_path, "ckpt.msgpack")
    checkpoint.save(path, state)
    template = demo.init_state(demo.init_params())
    restored = checkpoint.restore(path, template)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    next_live = demo.step(state, 2)
    next_restored = demo.step(restored, 2)
    for a, b in zip(jax.tree.leaves(next_live), jax.tree.leaves(next_restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_command_line_writes_log_plot_and_checkpoint(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = str(tmp_path / "run")
    # The TINY settings, so the programs compiled by the tests above are reused.
    common = ["--algo", "reward_weighted", "--eval-every", "2", "--no-progress"]
    for name, value in TINY.items():
        if name != "eval_every":
            common += ["--" + name.replace("_", "-"), str(value)]
    assert main(common + ["--warmup-steps", "3", "--steps", "3", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy" in printed and "peak memory" in printed
    with open(os.path.join(out, "log.json")) as f:
        log = json.load(f)
    assert [r["step"] for r in log["rl"]] == [1, 2, 3]
    assert [e["step"] for e in log["evals"]] == [0, 2, 3]
    assert set(log["summary"]) >= {"held_out_accuracy_before", "held_out_accuracy_after",
                                   "tokens_per_second", "peak_memory_bytes"}
    with open(os.path.join(out, "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # Resuming from the written checkpoint continues at step 3 and runs to --steps 5.
    resume = ["--steps", "5", "--out", out + "2",
              "--resume", os.path.join(out, "checkpoint.msgpack")]
    assert main(common + resume) == 0
    with open(os.path.join(out + "2", "log.json")) as f:
        assert [r["step"] for r in json.load(f)["rl"]] == [4, 5]
