"""Tests for ppo_continuous.py (CPU only; about 20 s of CPU time, one core).

GAE against hand-computed numbers and a naive reference; next-step autoreset masking and episode
logging on a counting env; normalisation statistics restored bit for bit; learning on
InvertedPendulum-v5; a CLI smoke run (train, resume, eval, one-line errors); resume with the run's
saved flags, exact when no episode is in flight, each step logged once; minibatches of at least 2
transitions; a non-finite update stopped before anything is saved; the function-length budgets.
The table of bad inputs is in test_bad_input_ppo_continuous.py.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

gym = pytest.importorskip("gymnasium")  # without it (requirements.txt): a skip, not an error
from gymnasium.wrappers.utils import RunningMeanStd  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conftest import tb_scalars  # noqa: E402

import ppo_continuous as pc  # noqa: E402

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------------
# A tiny env whose episodes have a known length: obs = [t], reward 1 per step, actions ignored.
# Reset with seed s gives episodes of length 2 + s % 2 (kept by later unseeded resets).
# ----------------------------------------------------------------------------------------------
class CountingEnv(gym.Env):
    def __init__(self, truncate: bool = False):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.truncate, self.length, self.t = truncate, 3, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.length = 2 + seed % 2
        self.t = 0
        return np.array([0.0], np.float32), {}

    def step(self, action):
        self.t += 1
        end = self.t >= self.length
        return (
            np.array([self.t], np.float32),
            1.0,
            end and not self.truncate,
            end and self.truncate,
            {},
        )


gym.register("CountingEnv-v0", entry_point=CountingEnv)
gym.register("CountingTruncEnv-v0", entry_point=CountingEnv, kwargs={"truncate": True})


# ----------------------------------------------------------------------------------------------
# GAE
# ----------------------------------------------------------------------------------------------
def test_gae_hand_computed_truncation_termination_and_autoreset():
    # env 0: s0 -> s1 (r=1), s1 -> s2 truncated (r=2), autoreset step s2 -> s3 (r=0, masked),
    #        s3 -> s4 terminated (r=4). env 1: four steps of reward 1, no episode end, V = 0.
    rewards = np.array([[1, 1], [2, 1], [0, 1], [4, 1]], np.float32)
    values = np.array([[0.5, 0], [1.0, 0], [3.0, 0], [0.2, 0]], np.float32)  # V(s_t)
    next_values = np.array([[1.0, 0], [3.0, 0], [0.2, 0], [7.0, 0]], np.float32)  # V(s_{t+1})
    terminations = np.array([[0, 0], [0, 0], [0, 0], [1, 0]], np.float32)
    dones = np.array([[0, 0], [1, 0], [0, 0], [1, 0]], np.float32)
    gamma, lam = 0.9, 0.8  # gamma * lambda = 0.72

    adv, ret = pc.compute_gae(
        rewards,
        values,
        next_values,
        terminations=terminations,
        dones=dones,
        gamma=gamma,
        gae_lambda=lam,
    )
    # by hand: delta0 = 1 + 0.9*1.0 - 0.5 = 1.4; delta1 = 2 + 0.9*3.0 - 1.0 = 3.7 (bootstrapped
    # from the final observation); A1 = 3.7 (episode ended); A0 = 1.4 + 0.72*3.7 = 4.064;
    # A3 = 4 - 0.2 = 3.8 (terminal: no bootstrap from V(s4) = 7).
    assert adv[0, 0] == pytest.approx(4.064, abs=1e-5)
    assert adv[1, 0] == pytest.approx(3.7, abs=1e-5)
    assert adv[3, 0] == pytest.approx(3.8, abs=1e-5)
    # env 1: A3 = 1, A2 = 1 + 0.72, A1 = 1 + 0.72*1.72, A0 = 1 + 0.72*2.2384
    np.testing.assert_allclose(adv[:, 1], [2.611648, 2.2384, 1.72, 1.0], atol=1e-5)
    np.testing.assert_allclose(ret, adv + values, atol=0)

    # CleanRL's convention (--no-bootstrap-truncation): truncation treated as termination
    adv_c, _ = pc.compute_gae(
        rewards, values, next_values, terminations=dones, dones=dones, gamma=gamma, gae_lambda=lam
    )
    assert adv_c[1, 0] == pytest.approx(2 - 1.0, abs=1e-5)  # delta1 = r1 - V(s1)
    assert adv_c[0, 0] == pytest.approx(1.4 + 0.72 * 1.0, abs=1e-5)


def naive_gae(rewards, values, next_values, *, terminations, dones, gamma, lam):
    """A_t = sum_l (gamma*lam)^l delta_{t+l}, summed until the episode ends (eq. 16, truncated)."""
    T, N = rewards.shape
    delta = rewards + gamma * next_values * (1 - terminations) - values
    adv = np.zeros((T, N))
    for n in range(N):
        for t in range(T):
            for k in range(T - t):
                adv[t, n] += (gamma * lam) ** k * delta[t + k, n]
                if dones[t + k, n]:
                    break
    return adv


def test_gae_matches_naive_reference_on_random_data():
    rng = np.random.default_rng(0)
    T, N = 50, 3
    rewards, values, next_values = (rng.normal(size=(T, N)).astype(np.float64) for _ in range(3))
    dones = (rng.random((T, N)) < 0.15).astype(np.float64)
    terminations = dones * (rng.random((T, N)) < 0.5)
    kw = dict(terminations=terminations, dones=dones, gamma=0.99)
    adv, ret = pc.compute_gae(rewards, values, next_values, gae_lambda=0.95, **kw)
    reference = naive_gae(rewards, values, next_values, lam=0.95, **kw)
    np.testing.assert_allclose(adv, reference, atol=1e-10)


# ----------------------------------------------------------------------------------------------
# gymnasium 1.x next-step autoreset: masking and episode logging
# ----------------------------------------------------------------------------------------------
def test_autoreset_steps_are_masked_and_every_episode_is_logged():
    # sub-env seeds 0 and 1 give episode lengths 2 and 3; both envs finish on step 10
    envs = pc.make_envs(pc.Args(env_id="CountingEnv-v0", num_envs=2))
    envs.reset(seed=0)
    next_valid = np.ones(2)
    valid, rewards, episodes = [], [], []
    for step in range(12):
        valid.append(next_valid)
        _, reward, term, trunc, infos = envs.step(np.zeros((2, 1), np.float32))
        rewards.append(reward)
        next_valid = 1.0 - np.logical_or(term, trunc)  # the rule ppo_continuous.py uses
        episodes += [(step, *e) for e in pc.finished_episodes(infos)]
    valid, rewards = np.array(valid), np.array(rewards)
    np.testing.assert_array_equal(valid[:, 0], [1, 1, 0] * 4)  # length 2 + one autoreset step
    np.testing.assert_array_equal(valid[:, 1], [1, 1, 1, 0] * 3)  # length 3 + one autoreset step
    # exactly the masked steps are the autoreset ones, which pay reward 0
    assert np.all(rewards[valid == 0] == 0) and np.all(rewards[valid == 1] > 0)
    assert episodes == [
        (1, 0, 2.0, 2),
        (2, 1, 3.0, 3),
        (4, 0, 2.0, 2),
        (6, 1, 3.0, 3),
        (7, 0, 2.0, 2),
        (10, 0, 2.0, 2),
        (10, 1, 3.0, 3),  # two envs finishing on the same step: both logged
    ]
    envs.close()


@pytest.mark.parametrize("env_id", ["CountingEnv-v0", "CountingTruncEnv-v0"])
def test_training_loop_masks_autoreset_steps(tmp_path, env_id):
    args = pc.validate(
        pc.Args(
            env_id=env_id,
            num_envs=2,
            num_steps=12,
            num_minibatches=2,
            update_epochs=1,
            total_timesteps=24,
            seed=0,
            runs_dir=str(tmp_path),
        )
    )
    s = pc.train(args)
    # env 0 (length 2) finishes on steps 1, 4, 7, 10; env 1 (length 3) on steps 2, 6, 10; each
    # following step is an autoreset step, left out of the update
    assert s["masked_steps"] == 7
    assert (
        sorted((round(r), length) for _, r, length in s["episodes"]) == [(2, 2)] * 4 + [(3, 3)] * 3
    )


# ----------------------------------------------------------------------------------------------
# normalisation statistics
# ----------------------------------------------------------------------------------------------
def test_fast_running_mean_std_is_gymnasium_bit_for_bit():
    rng = np.random.default_rng(1)
    ours, ref = pc.FastRunningMeanStd(shape=(5,)), RunningMeanStd(shape=(5,))
    for i in range(300):
        x = rng.normal(3.0, 2.0, size=(1 if i % 7 else 4, 5))
        ours.update(x), ref.update(x)
    assert (
        np.array_equal(ours.mean, ref.mean)
        and np.array_equal(ours.var, ref.var)
        and ours.count == ref.count
    )
    s_ours, s_ref = pc.FastRunningMeanStd(shape=()), RunningMeanStd(shape=())
    for r in rng.normal(size=200).astype(np.float32):
        s_ours.update(np.array([r])), s_ref.update(np.array([r]))
    assert np.array_equal(s_ours.var, s_ref.var) and s_ours.mean.dtype == s_ref.mean.dtype


def _short_run(tmp_path, **kw) -> dict:
    args = dict(
        env_id="InvertedPendulum-v5",
        total_timesteps=512,
        num_steps=256,
        num_minibatches=4,
        update_epochs=2,
        seed=3,
        runs_dir=str(tmp_path),
    )
    args.update(kw)
    return pc.train(pc.validate(pc.Args(**args)))


def test_normalisation_statistics_restored_bit_for_bit(tmp_path):
    s = _short_run(tmp_path)
    ckpt = pc.load_checkpoint(Path(s["run_dir"]) / "checkpoint.pt")
    saved = ckpt["norm"]
    assert saved["obs_count"] > 500 and saved["ret_count"] > 400  # really trained statistics
    assert set(ckpt) >= {"agent", "optimizer", "iteration", "global_step", "rng", "norm", "args"}

    envs = pc.make_envs(pc.Args(env_id="InvertedPendulum-v5"))
    pc.set_norm_state(envs, saved, update=False)  # frozen, as for evaluation
    restored = pc.get_norm_state(envs)
    for k in saved:
        assert (
            np.array_equal(restored[k], saved[k])
            and np.asarray(restored[k]).dtype == np.asarray(saved[k]).dtype
        ), k

    # the restored statistics are the ones applied, and stay frozen while stepping
    raw_env = gym.make("InvertedPendulum-v5")
    raw, _ = raw_env.reset(seed=5)
    obs, _ = envs.reset(seed=5)
    expected = np.clip(
        (raw - saved["obs_mean"]) / np.sqrt(saved["obs_var"] + 1e-8), -10, 10
    ).astype(np.float32)
    np.testing.assert_array_equal(obs[0], expected)
    for _ in range(20):
        envs.step(np.zeros((1, 1), np.float32))
    after = pc.get_norm_state(envs)
    assert all(np.array_equal(after[k], saved[k]) for k in saved)
    envs.close()


def test_same_seed_same_networks(tmp_path):
    a = pc.load_checkpoint(Path(_short_run(tmp_path / "a")["run_dir"]) / "checkpoint.pt")
    b = pc.load_checkpoint(Path(_short_run(tmp_path / "b")["run_dir"]) / "checkpoint.pt")
    for k in a["agent"]:
        assert torch.equal(a["agent"][k], b["agent"][k]), k


# ----------------------------------------------------------------------------------------------
# learning
# ----------------------------------------------------------------------------------------------
def test_learns_inverted_pendulum(tmp_path):
    # random policy: ~8 per episode. After 16,384 steps (8 iterations) the defaults reach 100-1000;
    # we require the mean of the last 10 episodes to beat the first 10 by at least 80.
    s = pc.train(
        pc.validate(
            pc.Args(
                env_id="InvertedPendulum-v5", total_timesteps=16384, seed=1, runs_dir=str(tmp_path)
            )
        )
    )
    returns = [r for _, r, _ in s["episodes"]]
    first, last = np.mean(returns[:10]), np.mean(returns[-10:])
    assert first < 30
    assert last >= first + 80, (first, last)


# ----------------------------------------------------------------------------------------------
# errors and the CLI
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, flag",
    [
        (dict(env_id="NoSuchEnv-v9"), "--env-id"),
        (dict(env_id="CartPole-v1"), "--env-id"),
        (dict(num_steps=100, num_minibatches=32), "--num-minibatches"),
        (dict(total_timesteps=100), "--total-timesteps"),
        (dict(num_envs=0), "--num-envs"),
    ],
)
def test_bad_input_is_a_usage_error(tmp_path, kw, flag):
    with pytest.raises(pc.UsageError, match=f"^{flag}"):
        pc.main(pc.Args(runs_dir=str(tmp_path), **kw))


def test_env_that_cannot_be_made_names_the_cause(monkeypatch):
    # gymnasium turns any failed MuJoCo import (e.g. mismatched mujoco / mujoco-core wheels) into
    # "MuJoCo is not installed": the one-line error keeps the import error that caused it
    def make(env_id, **kw):
        try:
            raise ImportError(
                "Version mismatch between 'mujoco' (4.0.0) and 'mujoco-core' (4.0.1)."
                "\nPlease upgrade"
            )
        except ImportError as e:
            raise gym.error.DependencyNotInstalled(
                'MuJoCo is not installed, run `pip install "gymnasium[mujoco]"`'
            ) from e

    monkeypatch.setattr(pc.gym, "make", make)
    with pytest.raises(pc.UsageError) as err:
        pc.check_env_id("Hopper-v5")
    assert str(err.value) == (
        "--env-id: cannot make 'Hopper-v5': MuJoCo is not installed, run `pip install "
        "\"gymnasium[mujoco]\"` (ImportError: Version mismatch between 'mujoco' (4.0.0) and "
        "'mujoco-core' (4.0.1).)"
    )


def _cli(*flags, cwd):
    return subprocess.run(
        [sys.executable, str(ROOT / "ppo_continuous.py"), *flags],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_train_resume_eval_and_errors(tmp_path, capsys):
    small = [
        "--env-id",
        "InvertedPendulum-v5",
        "--num-steps",
        "256",
        "--num-minibatches",
        "4",
        "--update-epochs",
        "1",
        "--runs-dir",
        "runs",
        "--seed",
        "7",
    ]
    p = _cli(*small, "--total-timesteps", "512", "--save-every", "1", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert list(run_dir.glob("events.out.tfevents.*"))
    ckpt_path = run_dir / "checkpoint.pt"
    assert pc.load_checkpoint(ckpt_path)["global_step"] == 512
    assert json.loads((run_dir / "args.json").read_text())["env_id"] == "InvertedPendulum-v5"

    # --resume continues the same run directory up to the new total (in-process: faster)
    pc.main(
        pc.Args(
            env_id="InvertedPendulum-v5",
            num_steps=256,
            num_minibatches=4,
            update_epochs=1,
            seed=7,
            total_timesteps=1024,
            resume=str(ckpt_path),
        )
    )
    ckpt = pc.load_checkpoint(ckpt_path)
    assert (ckpt["global_step"], ckpt["iteration"]) == (1024, 4)
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2

    # deterministic evaluation with frozen statistics
    returns = pc.main(pc.Args(eval_checkpoint=str(ckpt_path), eval_episodes=3))
    assert len(returns) == 3 and all(r > 0 for r in returns)
    assert "eval InvertedPendulum-v5: 3 episodes, return" in capsys.readouterr().out

    # a bad flag is one line on stderr and exit code 2, never a traceback
    p = _cli("--env-id", "CartPole-v1", "--runs-dir", "runs", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("error: --env-id: CartPole-v1 has Discrete actions, Box(")
    assert line.endswith(
        "needs Box actions (use a discrete-action PPO for others) and flat Box observations"
    )


def test_capture_video_without_moviepy_is_gymnasiums_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "moviepy", None)  # import moviepy fails
    with pytest.raises(SystemExit) as exit_:
        pc.cli(["--env-id", "InvertedPendulum-v5", "--capture-video", "--runs-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.lower().startswith("error: moviepy is not installed")
    assert err.count("\n") == 1 and not list(tmp_path.rglob("checkpoint.pt"))


def test_capture_video_records_the_first_episodes(tmp_path):
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")  # comes with moviepy (requirements.txt)
    s = _short_run(tmp_path, total_timesteps=256, num_steps=256, capture_video=True)
    videos = Path(s["run_dir"]) / "videos"
    # gymnasium's default schedule records episodes 0, 1, 8, 27, ...: the first two are always there
    first, second = videos / "rl-video-episode-0.mp4", videos / "rl-video-episode-1.mp4"
    assert first.is_file() and second.is_file()
    # RecordVideo keeps a frame after the reset and after every step of env 0's first episode; the
    # mp4 moviepy writes from them holds all of them or all but the last (its duration rounding)
    reader = imageio_ffmpeg.read_frames(str(first))
    meta = next(reader)
    n_frames = sum(1 for _ in reader)
    assert (
        meta["size"] == (480, 480)
        and meta["fps"] == gym.make("InvertedPendulum-v5").metadata["render_fps"]
    )
    assert n_frames in (s["episodes"][0][2], s["episodes"][0][2] + 1) and n_frames > 3


# ----------------------------------------------------------------------------------------------
# the rollout's NumPy actor
# ----------------------------------------------------------------------------------------------
def test_numpy_actor_mean_matches_torch_and_tracks_updates():
    torch.manual_seed(0)
    agent = pc.Agent(17, 6)
    for p in agent.parameters():  # away from the init, so every layer matters
        p.data.add_(0.3 * torch.randn_like(p))
    x = torch.randn(5, 17)
    mean = agent.numpy_actor_mean()
    out = mean(x.numpy())
    assert out.dtype == np.float32 and out.shape == (5, 6)
    np.testing.assert_allclose(out, agent.actor_mean(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # a copy: it keeps the weights it was taken with
        agent.actor_mean[0].bias.add_(1.0)
    np.testing.assert_array_equal(mean(x.numpy()), out)
    assert np.abs(agent.numpy_actor_mean()(x.numpy()) - out).max() > 1e-3


# ----------------------------------------------------------------------------------------------
# the minibatch loss
# ----------------------------------------------------------------------------------------------
def _loss_batch():
    """Two transitions whose ratios pi/pi_old are 1.5 and 0.5, and whose new values are known."""
    torch.manual_seed(0)
    agent = pc.Agent(3, 2)
    obs, actions = torch.randn(2, 3), torch.randn(2, 2)
    with torch.no_grad():
        logp, _, value = agent.get_action_and_value(obs, actions)
    old_logprobs = logp - torch.log(torch.tensor([1.5, 0.5]))
    return agent, obs, actions, old_logprobs, value


def test_ppo_loss_hand_computed():
    agent, obs, actions, old_logprobs, v = _loss_batch()
    adv = torch.tensor([2.0, 2.0])
    # V_old = V - 1 and V + 1, returns = V_old + 3: the first value moved 1 toward its return, the
    # second 1 away from it; clipped to 0.2, the errors become 2.8 and 3.2 instead of 2 and 4
    old_values = v - torch.tensor([1.0, -1.0])
    returns = old_values + 3.0
    loss, stats = pc.ppo_loss(
        agent,
        (obs, actions, old_logprobs, adv, returns, old_values),
        clip_coef=0.2,
        vf_coef=0.5,
        ent_coef=0.0,
        norm_adv=False,
    )
    # eq. 7: min(r A, clip(r) A) with A = 2: min(3, 2.4) = 2.4 and min(1, 1.6) = 1
    # -> loss -(2.4 + 1) / 2
    assert stats["policy_loss"].item() == pytest.approx(-1.7, abs=1e-5)
    # value (core #9): max((V - R)^2, (V_old + clip(V - V_old) - R)^2)
    # = max(2^2, 2.8^2) and max(4^2, 3.2^2)
    assert stats["value_loss"].item() == pytest.approx(0.5 * (2.8**2 + 4**2) / 2, abs=1e-4)
    assert loss.item() == pytest.approx(-1.7 + 0.5 * stats["value_loss"].item(), abs=1e-5)
    assert stats["clipfrac"].item() == 1.0  # |1.5 - 1| and |0.5 - 1| both exceed 0.2
    k1, k3 = (
        (-torch.log(torch.tensor([1.5, 0.5]))).mean(),
        (torch.tensor([0.5, -0.5]) - torch.log(torch.tensor([1.5, 0.5]))).mean(),
    )
    assert stats["old_approx_kl"].item() == pytest.approx(k1.item(), abs=1e-5)
    assert stats["approx_kl"].item() == pytest.approx(k3.item(), abs=1e-5)
    # the clipped first ratio passes no gradient: only the second transition moves the actor
    loss.backward()
    assert agent.actor_logstd.grad.abs().sum() > 0


def test_ppo_loss_entropy_bonus_and_advantage_normalisation():
    agent, obs, actions, old_logprobs, v = _loss_batch()
    adv = torch.tensor([1.0, 3.0])  # normalised: (-1, 1) / std([1, 3]) = (-0.7071, 0.7071)
    mb, kw = (obs, actions, old_logprobs, adv, v, v), dict(clip_coef=0.2, vf_coef=0.5)
    base, stats = pc.ppo_loss(agent, mb, ent_coef=0.0, **kw)
    a = 1 / math.sqrt(2)
    # min(1.5 * -a, 1.2 * -a) = -1.5a; min(0.5 * a, 0.8 * a) = 0.5a
    # -> loss -(-1.5a + 0.5a) / 2 = a / 2
    assert base.item() == pytest.approx(a / 2, abs=1e-5)
    with_bonus, _ = pc.ppo_loss(agent, mb, ent_coef=0.01, **kw)
    # entropy of a diagonal Gaussian with log-std 0: act_dim * (0.5 + 0.5 * log(2 pi))
    assert stats["entropy"].item() == pytest.approx(
        2 * (0.5 + 0.5 * math.log(2 * math.pi)), abs=1e-5
    )
    assert with_bonus.item() == pytest.approx(
        base.item() - 0.01 * stats["entropy"].item(), abs=1e-6
    )


def test_compiled_loss_matches_eager(tmp_path):
    agent, obs, actions, old_logprobs, v = _loss_batch()
    minibatch = (obs, actions, old_logprobs, torch.tensor([1.0, -2.0]), v + 1, v - 0.5)
    coefs = dict(clip_coef=0.2, vf_coef=0.5, ent_coef=0.01)
    eager, _ = pc.ppo_loss(agent, minibatch, **coefs)
    eager.backward()
    grads = [p.grad.clone() for p in agent.parameters()]
    agent.zero_grad()
    compiled, _ = torch.compile(pc.ppo_loss)(agent, minibatch, **coefs)
    compiled.backward()
    assert compiled.item() == pytest.approx(eager.item(), abs=1e-6)
    for g, p in zip(grads, agent.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# resume (issue 13 item 13): the run's flags are the defaults, flags given again take effect;
# a killed run resumes within the documented limit; TensorBoard never shows a step twice
# ----------------------------------------------------------------------------------------------
def _scalars(run_dir) -> dict:
    """Every logged scalar but the timings, as TensorBoard shows it: {tag: [(step, value), ...]}."""
    return {
        tag: series
        for tag, series in tb_scalars(run_dir).items()
        if not tag.startswith("perf/") and tag != "charts/SPS"
    }


def _train_killed_after(tmp_path, monkeypatch, kill_after: int, **kw) -> tuple[dict, Path]:
    """Train to the end, keeping a copy of the checkpoint of iteration ``kill_after`` as
    ``killed.pt`` in the run directory: what a run killed after logging later iterations would
    have left."""
    real_save = pc.atomic_save

    def save(obj, path):
        real_save(obj, path)
        if obj["iteration"] == kill_after:
            (Path(path).parent / "killed.pt").write_bytes(Path(path).read_bytes())

    monkeypatch.setattr(pc, "atomic_save", save)
    s = pc.train(pc.validate(pc.Args(runs_dir=str(tmp_path), save_every=1, **kw)))
    monkeypatch.setattr(pc, "atomic_save", real_save)
    return s, Path(s["run_dir"]) / "killed.pt"


@pytest.mark.parametrize("save_every, saved", [(0, [4]), (1, [1, 2, 3, 4]), (3, [3, 4])])
def test_checkpoints_are_written_every_save_every_iterations_and_at_the_end(
    tmp_path, monkeypatch, save_every, saved
):
    iterations = []
    monkeypatch.setattr(pc, "atomic_save", lambda obj, path: iterations.append(obj["iteration"]))
    kw = dict(env_id="CountingEnv-v0", num_steps=4, num_minibatches=1, total_timesteps=16)
    pc.train(pc.validate(pc.Args(runs_dir=str(tmp_path), save_every=save_every, **kw)))
    assert iterations == saved


def test_resume_is_exact_when_no_episode_is_in_flight_and_logs_each_step_once(
    tmp_path, monkeypatch
):
    # episodes of 3 steps plus the autoreset step: every 4-step rollout ends between two episodes,
    # so nothing is in flight at a checkpoint and the resumed run must be the uninterrupted one
    kw = dict(
        env_id="CountingEnv-v0",
        num_steps=4,
        num_minibatches=1,
        update_epochs=2,
        total_timesteps=16,
        seed=1,
    )
    s, killed = _train_killed_after(tmp_path, monkeypatch, 2, **kw)
    run_dir = Path(s["run_dir"])
    uninterrupted = _scalars(run_dir)
    final = pc.load_checkpoint(run_dir / "checkpoint.pt")
    assert len(uninterrupted["losses/value_loss"]) == 4

    pc.cli(["--resume", str(killed)])  # iterations 3 and 4 again, from the iteration-2 checkpoint
    resumed = pc.load_checkpoint(run_dir / "checkpoint.pt")
    for k in final["agent"]:
        assert torch.equal(resumed["agent"][k], final["agent"][k]), k
    for k in final["norm"]:
        assert np.array_equal(resumed["norm"][k], final["norm"][k]), k
    assert _scalars(run_dir) == uninterrupted  # the same values, and no step twice


def test_resume_restarts_episodes_in_flight_from_a_seeded_reset(tmp_path, monkeypatch):
    # the documented limit: 2-step rollouts cut 3-step episodes; the episode in flight at the
    # iteration-1 checkpoint (step 2) is not finished, a fresh one starts at the resume
    kw = dict(
        env_id="CountingEnv-v0",
        num_steps=2,
        num_minibatches=1,
        update_epochs=1,
        total_timesteps=16,
        seed=1,
    )
    s, killed = _train_killed_after(tmp_path, monkeypatch, 1, **kw)
    assert [(step, length) for step, _, length in s["episodes"]] == [
        (3, 3),
        (7, 3),
        (11, 3),
        (15, 3),
    ]
    resumed = pc.main(pc.parse_args(["--resume", str(killed)]))
    assert [(step, length) for step, _, length in resumed["episodes"]] == [(5, 3), (9, 3), (13, 3)]
    ckpt = pc.load_checkpoint(Path(s["run_dir"]) / "checkpoint.pt")
    assert (ckpt["global_step"], ckpt["iteration"]) == (16, 8)


def test_resume_without_flags_continues_any_env_with_its_saved_flags(tmp_path, monkeypatch):
    kw = dict(
        env_id="InvertedPendulum-v5",
        num_envs=2,
        num_steps=64,
        num_minibatches=4,
        update_epochs=1,
        total_timesteps=512,
        learning_rate=1e-3,
        seed=5,
    )
    s, killed = _train_killed_after(tmp_path, monkeypatch, 2, **kw)
    run_dir = Path(s["run_dir"])
    (run_dir / "checkpoint.pt").unlink()
    pc.cli(["--resume", str(killed)])  # the README's line: no --env-id, no sizes
    ckpt = pc.load_checkpoint(run_dir / "checkpoint.pt")
    assert (ckpt["global_step"], ckpt["iteration"]) == (512, 4)
    assert ckpt["args"]["env_id"] == "InvertedPendulum-v5" and ckpt["args"]["learning_rate"] == 1e-3
    assert ckpt["script"] == "ppo_continuous.py"
    lr = dict(_scalars(run_dir)["charts/learning_rate"])
    assert lr[384] == pytest.approx(1e-3 * (1 - 2 / 4)) and lr[512] == pytest.approx(
        1e-3 * (1 - 3 / 4)
    )


def test_resume_flags_given_again_take_effect_even_without_annealing(tmp_path, monkeypatch):
    kw = dict(
        env_id="InvertedPendulum-v5",
        num_steps=64,
        num_minibatches=2,
        update_epochs=1,
        total_timesteps=256,
        learning_rate=1e-3,
        anneal_lr=False,
        seed=5,
    )
    s, killed = _train_killed_after(tmp_path, monkeypatch, 2, **kw)
    run_dir = Path(s["run_dir"])
    pc.cli(["--resume", str(killed), "--learning-rate", "2e-4", "--total-timesteps", "384"])
    ckpt = pc.load_checkpoint(run_dir / "checkpoint.pt")
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == 2e-4 and ckpt["global_step"] == 384
    lr = _scalars(run_dir)["charts/learning_rate"]
    assert [step for step, _ in lr] == [64, 128, 192, 256, 320, 384]  # each step once
    assert [v for _, v in lr] == pytest.approx([1e-3, 1e-3, 2e-4, 2e-4, 2e-4, 2e-4])
    assert ckpt["args"]["learning_rate"] == 2e-4 and not ckpt["args"]["anneal_lr"]


# ----------------------------------------------------------------------------------------------
# nothing non-finite (issue 13 item 14, issue 14)
# ----------------------------------------------------------------------------------------------
def test_minibatches_hold_at_least_two_transitions():
    for n in range(0, 80):
        parts = pc.minibatches(torch.arange(n), 32)
        assert sum(len(p) for p in parts) == (n if n >= 2 else 0)
        assert all(len(p) >= 2 for p in parts)
        assert len(parts) == min(32, n // 2)
    assert [len(p) for p in pc.minibatches(torch.arange(128), 32)] == [
        4
    ] * 32  # the flag's layout when it fits


def test_small_minibatches_after_masking_give_finite_weights(tmp_path):
    # 64 steps in 32 minibatches: short InvertedPendulum episodes leave fewer than 64 real steps,
    # which used to give minibatches of 0 or 1 transitions, a NaN advantage std and NaN weights
    s = _short_run(tmp_path, num_steps=64, num_minibatches=32, update_epochs=2, total_timesteps=128)
    assert s["masked_steps"] > 0
    ckpt = pc.load_checkpoint(Path(s["run_dir"]) / "checkpoint.pt")
    assert all(torch.isfinite(v).all() for v in ckpt["agent"].values())
    for tag, values in _scalars(s["run_dir"]).items():
        if tag.startswith("losses/") and tag != "losses/explained_variance":
            assert all(math.isfinite(v) for _, v in values), tag


def test_non_finite_update_stops_the_run_before_anything_is_saved(tmp_path):
    with pytest.raises(pc.UsageError) as err:
        _short_run(
            tmp_path, learning_rate=1e30, anneal_lr=False, num_steps=128, total_timesteps=384
        )
    assert re.fullmatch(
        r"non-finite loss or gradient norm at iteration \d+, epoch \d+ "
        r"\(the update was not applied\); check --learning-rate; no checkpoint was written yet",
        str(err.value),
    ), str(err.value)
    assert not list(tmp_path.rglob("checkpoint.pt"))


def test_ppo_loss_needs_two_transitions_to_normalise():
    # why minibatches() keeps at least 2: one transition has no advantage std
    agent, obs, actions, old_logprobs, v = _loss_batch()
    one = (obs[:1], actions[:1], old_logprobs[:1], torch.ones(1), v[:1], v[:1])
    coefs = dict(clip_coef=0.2, vf_coef=0.5, ent_coef=0.0)
    assert torch.isnan(pc.ppo_loss(agent, one, **coefs)[0])
    assert torch.isfinite(pc.ppo_loss(agent, one, norm_adv=False, **coefs)[0])


# ----------------------------------------------------------------------------------------------
# the script's own plumbing: atomic checkpoints (kill -9 safe) and TensorBoard purge on resume
# ----------------------------------------------------------------------------------------------
def test_atomic_save_refuses_non_finite_values_and_disk_errors_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "run" / "checkpoint.pt"
    path.parent.mkdir()  # the run directory: TensorBoard's writer makes it
    with pytest.raises(pc.UsageError) as err:
        pc.atomic_save({"agent": {"w": torch.ones(2), "b": torch.tensor([0.0, math.nan])}}, path)
    assert str(err.value) == (
        f"not saving {path}: agent.b holds non-finite values (NaN or inf); none was written yet"
    )
    assert not list(path.parent.iterdir())
    pc.atomic_save({"step": 1, "norm": {"var": np.ones(2)}}, path)
    before = path.read_bytes()
    for obj, where in [
        ({"optimizer": [{"exp_avg": torch.tensor([math.inf])}]}, "optimizer.0.exp_avg"),
        ({"norm": {"var": np.array([1.0, -math.inf])}}, "norm.var"),
        ({"norm": {"count": np.float64(math.nan)}}, "norm.count"),
    ]:
        with pytest.raises(pc.UsageError, match=rf"^not saving .*: {where} holds non-finite .*"):
            pc.atomic_save(obj, path)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pc.os, "fsync", disk_full)
    with pytest.raises(pc.UsageError) as err:
        pc.atomic_save({"step": 2}, path)
    assert str(err.value) == (
        f"cannot write checkpoint {path}: No space left on device; "
        "the previous checkpoint there is intact"
    )
    assert path.read_bytes() == before and [p.name for p in path.parent.iterdir()] == [path.name]


_SAVER = """
import sys, time, torch
from pathlib import Path
sys.path.insert(0, {root!r})
import ppo_continuous as pc

path, weights = Path({path!r}), torch.randn(1_000_000)
pc.atomic_save({{"step": 1, "weights": weights}}, path)
print("saved", flush=True)


def half_then_wait(obj, f):  # killed while the temporary file is half written
    f.write(b"half a checkpoint")
    f.flush()
    print("mid-write", flush=True)
    time.sleep(60)


def wait(fd):  # killed once the temporary file is whole, before it replaces the checkpoint
    print("before-rename", flush=True)
    time.sleep(60)


if {moment!r} == "mid-write":
    torch.save = half_then_wait
else:
    pc.os.fsync = wait
pc.atomic_save({{"step": 2, "weights": weights}}, path)
"""


@pytest.mark.parametrize("moment", ["mid-write", "before-rename"])
def test_kill_9_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path, moment):
    path = tmp_path / "checkpoint.pt"
    code = _SAVER.format(root=str(ROOT), path=str(path), moment=moment)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert [proc.stdout.readline().strip() for _ in range(2)] == ["saved", moment]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = torch.load(path, weights_only=False)
    assert saved["step"] == 1 and saved["weights"].shape == (1_000_000,)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.pt.tmp", "checkpoint.pt"]
    pc.atomic_save({"step": 3}, path)  # the next save overwrites what the killed one left
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_a_run_resumed_within_the_same_second_shows_each_step_once(tmp_path, monkeypatch):
    # TensorBoard reads event files in name order and purges only what it has read: names start
    # with the second they were made in, then host, pid and a per-process counter, so in the same
    # second "...10" sorts before "...9"
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    while time.time() % 1 > 0.5:  # start early in a second: the resume comes within it
        time.sleep(0.01)
    writer = pc.make_writer(tmp_path, pc.Args(), purge_step=None)
    for step in range(1, 4):
        writer.add_scalar("loss", float(step), step)
    writer.close()
    resumed = pc.make_writer(tmp_path, pc.Args(), purge_step=3)
    resumed.add_scalar("loss", 30.0, 3)
    resumed.close()
    assert tb_scalars(tmp_path)["loss"] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert json.loads((tmp_path / "args.json").read_text())["env_id"] == "HalfCheetah-v5"
