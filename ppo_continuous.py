"""PPO for continuous control (MuJoCo) on gymnasium 1.x, with the 13 core and 9 continuous-action details of the 37.

Read beside "The 37 Implementation Details of PPO" (Huang et al., ICLR blog track 2022). Comments
cite its items as "core #k" (the 13 core details) and "cont. #k" (the 9 continuous-action ones),
GAE as Schulman et al. 2016 eq. 16 and the clipped surrogate as Schulman et al. 2017 eq. 7.

Usage:
    python ppo_continuous.py --env-id HalfCheetah-v5 --seed 1
    python ppo_continuous.py --resume runs/<run>/checkpoint.pt
    python ppo_continuous.py --eval-checkpoint runs/<run>/checkpoint.pt --eval-episodes 10
    tensorboard --logdir runs

Where things are: ``Args``; the algorithm's pure parts (network, minibatch loss, GAE, minibatch
split); ``train()``, the loop in the order of the paper's algorithm box; below it the environment
(gymnasium's own wrappers), its normalisation state, evaluation, and the run plumbing (flag
checks, resume, checkpoints). A reader may stop at the end of ``train()``.

Differences from CleanRL's ppo_continuous_action.py (same defaults otherwise):
  * gymnasium 1.x next-step autoreset: the step after an episode ends returns the reset
    observation, ignores the action and pays reward 0. That transition is stored but masked out
    of the loss, the advantage recursion never crosses it, and its observation (the *final*
    observation of the finished episode) gives the bootstrap value for time-limit truncations.
  * --bootstrap-truncation (default on): when an episode is cut by the time limit, the TD target
    is r + gamma * V(final obs) instead of r. CleanRL treats truncation like termination
    (target r); --no-bootstrap-truncation reproduces that.
  * Normalisation uses gymnasium's vector-level wrappers, so the statistics live in this
    process, are shared by all envs (CleanRL keeps one set per env), and are saved in the
    checkpoint; --eval-checkpoint evaluates with them frozen.
  * The rollout only samples actions, with the actor's mean computed by a NumPy copy of its
    weights (same function to float32 rounding, a sixth of torch's cost per call); values and
    log-probs of the whole rollout are computed in one batched torch pass afterwards (same
    parameters, same numbers, far less overhead).
  * Minibatches hold at least 2 real transitions: when masked autoreset steps leave fewer than
    2 * --num-minibatches of them, an epoch uses fewer, larger minibatches (a 1-transition
    minibatch has no advantage std; CleanRL gives NaN there).
  * A non-finite loss or gradient norm stops the run with one line before that update is applied;
    non-finite weights (checked after each iteration's updates) stop it before anything is saved.

Checkpoints ({runs_dir}/{run_name}/checkpoint.pt, written atomically every --save-every iterations
and at the end) hold the networks, the optimizer, iteration and step, every RNG state, the
normalisation statistics and the reward scaler's running return. ``--resume PATH`` continues a run
with the flags it was started with; a flag given again overrides the saved one (the learning rate
too), except --env-id, --num-envs, --num-steps and --runs-dir, which cannot change. The limit of a
resumed run: the simulator state is not saved, so the envs restart from a reset seeded with
--seed + global step. An episode in flight at the checkpoint is therefore dropped (its steps were
trained on; its return is never logged) and, on MuJoCo, the first episodes start from other
initial states. Everything else continues exactly: when no episode is in flight and resets are
deterministic, the resumed run equals the uninterrupted one bit for bit (tested).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import tyro
from gymnasium.wrappers import vector as vector_wrappers
from gymnasium.wrappers.utils import RunningMeanStd
from torch.distributions.normal import Normal
from tqdm import tqdm

import common
from common import UsageError

SCRIPT = "ppo_continuous.py"
"""The name this script writes into its checkpoints (``"script"``); ``--resume`` and ``--eval-checkpoint`` check it."""


@dataclass
class Args:
    exp_name: str = "ppo_continuous"
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment: all randomness (networks, actions, minibatches, envs) flows from it"""
    torch_deterministic: bool = True
    """if toggled, sets `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """use CUDA when it is available"""
    num_threads: int = 1
    """torch CPU threads; 1 is fastest for 64x64 MLPs (0 keeps torch's default)"""
    compile: bool = False
    """torch.compile the minibatch loss (fewer, fused kernels; needs a C++ compiler, ~1 min warm-up)"""
    runs_dir: str = "runs"
    """TensorBoard logs, args.json and checkpoints go to {runs_dir}/{run_name}/"""
    capture_video: bool = False
    """record videos of env 0 to {runs_dir}/{run_name}/videos (needs moviepy: pip install moviepy)"""
    save_every: int = 50
    """write {run_dir}/checkpoint.pt every this many iterations (0: only at the end)"""
    resume: str | None = None
    """path of a checkpoint.pt to continue: its run's flags are the defaults, flags given again override them"""
    eval_checkpoint: str | None = None
    """path of a checkpoint.pt to evaluate with the deterministic (mean) action instead of training"""
    eval_episodes: int = 10
    """number of episodes for --eval-checkpoint"""

    # Algorithm specific arguments
    env_id: str = "HalfCheetah-v5"
    """the id of a gymnasium environment with a continuous (Box) action space"""
    total_timesteps: int = 1_000_000
    """total environment steps of the experiment"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel environments"""
    vector_mode: Literal["sync", "async"] = "sync"
    """run the envs in this process (sync) or one subprocess each (async)"""
    num_steps: int = 2048
    """the number of steps per env per rollout"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0 (core #4)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda of generalized advantage estimation"""
    num_minibatches: int = 32
    """the number of minibatches per epoch"""
    update_epochs: int = 10
    """the number of epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch (core #7)"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient epsilon"""
    clip_vloss: bool = True
    """clip the value loss (core #9)"""
    ent_coef: float = 0.0
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """the maximum global norm of the gradients (core #11)"""
    target_kl: float | None = None
    """stop the epochs of an update early once approx_kl exceeds this (off by default)"""
    bootstrap_truncation: bool = True
    """bootstrap from V(final observation) when the time limit truncates an episode (off: CleanRL)"""
    obs_clip: float = 10.0
    """clip normalised observations to [-obs_clip, obs_clip] (cont. #7)"""
    reward_clip: float = 10.0
    """clip scaled rewards to [-reward_clip, reward_clip] (cont. #9)"""

    # computed after parsing, not flags
    batch_size: tyro.conf.Suppress[int] = 0
    """the batch size, num_envs * num_steps"""
    minibatch_size: tyro.conf.Suppress[int] = 0
    """the minibatch size, batch_size // num_minibatches"""
    num_iterations: tyro.conf.Suppress[int] = 0
    """the number of iterations, total_timesteps // batch_size"""


# ----------------------------------------------------------------------------------------------
# ALGO LOGIC. Network: separate actor and critic, 64x64 tanh MLPs (core #13, cont. #4)
# ----------------------------------------------------------------------------------------------
def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """Orthogonal weights with gain ``std``, constant biases (core #2)."""
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Gaussian policy with state-independent log-std (cont. #1-#3) and a separate critic.

    ``actor_mean(x)``: ``(B, obs_dim) -> (B, act_dim)``; ``get_value(x)``: ``(B, obs_dim) -> (B,)``.
    """

    def __init__(self, obs_dim: int, act_dim: int):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, act_dim), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))  # cont. #2

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def numpy_actor_mean(self) -> Callable[[np.ndarray], np.ndarray]:
        """A NumPy copy of ``actor_mean`` as it is now: ``(B, obs_dim) -> (B, act_dim)``, float32.

        Same function to float32 rounding (tested). The rollout calls it once per env step: a
        one-row torch forward costs ~90 us of framework overhead there, NumPy ~15 us, and the
        rollout is most of the run. Take a fresh copy after every update.
        """
        (w1, b1), (w2, b2), (w3, b3) = [
            (layer.weight.detach().cpu().numpy().T.copy(), layer.bias.detach().cpu().numpy().copy())
            for layer in self.actor_mean if isinstance(layer, nn.Linear)
        ]
        return lambda x: np.tanh(np.tanh(x @ w1 + b1) @ w2 + b2) @ w3 + b3

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor):
        """Log-prob ``(B,)`` of ``action`` ``(B, act_dim)``, entropy ``(B,)`` and value ``(B,)``.

        Action dimensions are independent: log-probs and entropies are summed over them (cont. #3).
        """
        action_mean = self.actor_mean(x)
        probs = Normal(action_mean, self.actor_logstd.expand_as(action_mean).exp(), validate_args=False)
        return probs.log_prob(action).sum(-1), probs.entropy().sum(-1), self.get_value(x)


# ----------------------------------------------------------------------------------------------
# The PPO loss of one minibatch (core #7-#10, #12)
# ----------------------------------------------------------------------------------------------
def ppo_loss(
    agent: Agent, obs: torch.Tensor, actions: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
    returns: torch.Tensor, old_values: torch.Tensor, clip_coef: float, vf_coef: float, ent_coef: float,
    norm_adv: bool = True, clip_vloss: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-surrogate PPO loss of one minibatch of ``B`` transitions, to be minimised.

    ``loss = L_clip + vf_coef * L_V - ent_coef * H`` (Schulman et al. 2017 eq. 7 and 9, negated).

    Args:
        obs: ``(B, obs_dim)`` normalised observations; actions: ``(B, act_dim)``, unclipped.
        old_logprobs, old_values: ``(B,)`` log pi_old(a|s) and V_old(s) from the rollout's pass.
        advantages, returns: ``(B,)`` GAE advantages and ``advantages + old_values``.
        clip_coef: epsilon of the ratio clip, also the value clip range (core #9).
    Returns:
        ``(loss, stats)``: the scalar loss, and detached scalars ``policy_loss``, ``value_loss``,
        ``entropy``, ``old_approx_kl``, ``approx_kl`` (k1 and k3 estimates of KL(pi_old || pi),
        core #12) and ``clipfrac`` (fraction of ratios outside ``1 +- clip_coef``).
    Raises:
        ValueError: fewer than 2 transitions with ``norm_adv`` (their std is undefined), or none.
    """
    if advantages.shape[0] < (2 if norm_adv else 1):
        raise ValueError(f"ppo_loss: a minibatch needs at least {2 if norm_adv else 1} transitions, "
                         f"got {advantages.shape[0]}")
    newlogprob, entropy, newvalue = agent.get_action_and_value(obs, actions)
    logratio = newlogprob - old_logprobs
    ratio = logratio.exp()

    if norm_adv:  # core #7: per-minibatch advantage normalisation
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

    # core #8: clipped surrogate objective (Schulman et al. 2017 eq. 7), negated
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

    # core #9: value loss clipping
    if clip_vloss:
        v_loss_unclipped = (newvalue - returns) ** 2
        v_clipped = old_values + torch.clamp(newvalue - old_values, -clip_coef, clip_coef)
        v_loss_clipped = (v_clipped - returns) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    else:
        v_loss = 0.5 * ((newvalue - returns) ** 2).mean()

    # core #10: overall loss with entropy bonus (left out of the graph when its coef is 0)
    entropy_loss = entropy.mean()
    loss = pg_loss + v_loss * vf_coef
    if ent_coef != 0:
        loss = loss - ent_coef * entropy_loss

    with torch.no_grad():  # core #12: debug variables
        stats = {
            "policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(), "entropy": entropy_loss.detach(),
            "old_approx_kl": (-logratio).mean(), "approx_kl": ((ratio - 1) - logratio).mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_coef).float().mean(),
        }
    return loss, stats


# ----------------------------------------------------------------------------------------------
# GAE (core #5), minibatches (core #6), explained variance (core #12)
# ----------------------------------------------------------------------------------------------
def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    terminations: np.ndarray,
    dones: np.ndarray,
    gamma: float,
    gae_lambda: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation, Schulman et al. 2016 eq. 16, with episode boundaries.

    All inputs are float arrays of shape ``(T, N)`` (steps, envs):
      ``rewards[t]`` reward of step t; ``values[t]`` V(s_t); ``next_values[t]`` V(s_{t+1}) where
      s_{t+1} is the observation the step returned (the final observation when the episode ended);
      ``terminations[t]`` 1 where s_{t+1} is terminal, so nothing is bootstrapped (pass
      terminated-or-truncated here to treat truncation as termination, as CleanRL does);
      ``dones[t]`` 1 where the episode ended after step t (terminated or truncated), which stops
      the recursion ``A_t = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}`` with
      ``delta_t = r_t + gamma * (1 - term_t) * V(s_{t+1}) - V(s_t)``.
    Returns ``(advantages, returns)``, shape ``(T, N)``, dtype of ``rewards``, ``returns =
    advantages + values``. NumPy, not torch: the T-step loop costs ~1 us per op instead of ~5.
    Raises ``ValueError`` if the shapes differ.
    """
    if not (rewards.shape == values.shape == next_values.shape == terminations.shape == dones.shape):
        raise ValueError("compute_gae: rewards, values, next_values, terminations, dones need one shape")
    advantages = np.zeros_like(rewards)
    lastgaelam = np.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        delta = rewards[t] + gamma * next_values[t] * (1.0 - terminations[t]) - values[t]
        lastgaelam = delta + gamma * gae_lambda * (1.0 - dones[t]) * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def minibatches(inds: torch.Tensor, num_minibatches: int) -> tuple[torch.Tensor, ...]:
    """Split the shuffled indices ``(B,)`` of a rollout's real transitions into minibatches (core #6).

    ``num_minibatches`` near-equal parts (sizes differ by at most 1), or fewer when ``B < 2 *
    num_minibatches``, so that every part holds at least 2 transitions: per-minibatch advantage
    normalisation (core #7) needs a standard deviation. ``()`` when ``B < 2``.
    """
    return torch.tensor_split(inds, min(num_minibatches, len(inds) // 2)) if len(inds) >= 2 else ()


def explained_variance(y_pred: np.ndarray, y_true: np.ndarray) -> float:
    """1 - Var[y_true - y_pred] / Var[y_true] over 1-D arrays; NaN when Var[y_true] is 0 (core #12)."""
    var_y = np.var(y_true)
    return float("nan") if var_y == 0 else float(1 - np.var(y_true - y_pred) / var_y)


# ----------------------------------------------------------------------------------------------
# Training: the loop of the paper's algorithm box
# ----------------------------------------------------------------------------------------------
NONFINITE_HINT = "--learning-rate (try a lower one) and --max-grad-norm"
"""The flags a non-finite loss, gradient norm or weight points to."""


def train(args: Args) -> dict:
    """Train PPO; returns ``{"run_dir", "global_step", "sps", "cpu_sps", "episodes": [(step, return,
    length)], "masked_steps"}`` (the autoreset transitions left out of the updates) and writes it,
    with the mean return of the last 10 episodes, to ``{run_dir}/summary.json``.

    Raises:
        UsageError: an unwritable ``--runs-dir`` (or a new run's directory holding a checkpoint), a bad
            ``--resume`` checkpoint, or an ``--env-id`` that cannot be made (all before any env is created);
            a non-finite loss or gradient norm (before that update is applied) or weight (after the
            iteration's updates, before anything is saved).
    """
    ckpt = check_resume(args)  # before any env: --runs-dir writable, or the --resume checkpoint usable
    run_dir = Path(args.resume).resolve().parent if ckpt is not None else new_run_dir(args)
    obs_dim, act_dim = check_env_id(args.env_id)
    check_rollout_memory(args, obs_dim, act_dim)
    if ckpt is not None:
        check_checkpoint_fits(ckpt, args.resume, "--resume", args.env_id, obs_dim, act_dim)
    ckpt_path = run_dir / "checkpoint.pt"
    video_dir = _video_dir(args.capture_video, args.env_id, run_dir / "videos")

    # TRY NOT TO MODIFY: seeding
    common.seed_everything(args.seed, args.torch_deterministic)
    device = _device(args)

    # env setup (core #1: vectorized architecture)
    envs = make_envs(args.env_id, args.num_envs, args.vector_mode, args.gamma, args.obs_clip, args.reward_clip,
                     video_dir)

    agent = Agent(obs_dim, act_dim).to(device)
    loss_fn = torch.compile(ppo_loss) if args.compile else ppo_loss
    # core #3: Adam with eps 1e-5; fused (one kernel for all parameters), same update rule
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)

    # ALGO Logic: storage setup, shape (num_steps, num_envs, ...). The rollout fills NumPy arrays
    # (a NumPy copy costs ~1 us, a torch one ~5 us); they become tensors once per rollout.
    obs = np.zeros((args.num_steps, args.num_envs, obs_dim), dtype=np.float32)
    actions = np.zeros((args.num_steps, args.num_envs, act_dim), dtype=np.float32)
    rewards = np.zeros((args.num_steps, args.num_envs), dtype=np.float32)
    terminations = np.zeros((args.num_steps, args.num_envs), dtype=np.float32)
    dones = np.zeros((args.num_steps, args.num_envs), dtype=np.float32)
    valid = np.zeros((args.num_steps, args.num_envs), dtype=np.float32)  # 0: autoreset step

    if ckpt is None:
        start_iteration, global_step = 1, 0
        next_obs, _ = envs.reset(seed=args.seed)
    else:  # in-flight episodes restart from a seeded reset (see the module docstring)
        start_iteration, global_step, next_obs = restore_checkpoint(ckpt, agent, optimizer, envs, args)
    next_valid = np.ones(args.num_envs, dtype=np.float32)
    writer = common.make_writer(run_dir, args, purge_step=None if ckpt is None else global_step + 1)
    episodes, masked_steps = [], 0  # (global step, return, length) of every finished episode; autoreset steps
    start_time, start_cpu, start_step = time.time(), time.process_time(), global_step
    pbar = tqdm(total=args.num_iterations * args.batch_size, initial=global_step, unit="step", mininterval=1.0)

    try:
        for iteration in range(start_iteration, args.num_iterations + 1):
            # core #4: linear learning-rate annealing
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / args.num_iterations
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            # ROLLOUT: a ~ N(mu(s), sigma) (cont. #1) sampled as mu(s) + sigma * noise, with mu from a
            # NumPy copy of the actor; values and log-probs are computed for the whole rollout after
            # it, in one batched torch pass.
            rollout_start = time.time()
            with torch.no_grad():
                noise = torch.randn((args.num_steps, args.num_envs, act_dim), device=device)
                scaled_noise = (agent.actor_logstd.exp() * noise).cpu().numpy()
            actor_mean = agent.numpy_actor_mean()
            for step in range(args.num_steps):
                global_step += args.num_envs
                obs[step] = next_obs
                valid[step] = next_valid
                action = actor_mean(next_obs) + scaled_noise[step]
                actions[step] = action  # stored unclipped; the env sees it clipped (cont. #5)
                next_obs, reward, term, trunc, infos = envs.step(action)
                rewards[step], terminations[step] = reward, term
                done = np.logical_or(term, trunc)
                dones[step] = done
                # gymnasium 1.x next-step autoreset: after an episode ends, the next step of that env
                # only resets it (action ignored, reward 0); it is stored but never trained on.
                next_valid = 1.0 - done
                for _, ep_return, ep_length in finished_episodes(infos):
                    episodes.append((global_step, ep_return, ep_length))
                    writer.add_scalar("charts/episodic_return", ep_return, global_step)
                    writer.add_scalar("charts/episodic_length", ep_length, global_step)
            rollout_time = time.time() - rollout_start

            # values and old log-probs of the whole rollout in one batched pass
            with torch.no_grad():
                b_obs = torch.from_numpy(obs).to(device).reshape(-1, obs_dim)
                b_actions = torch.from_numpy(actions).to(device).reshape(-1, act_dim)
                b_logprobs, _, b_values = agent.get_action_and_value(b_obs, b_actions)
                values = b_values.cpu().numpy().reshape(args.num_steps, args.num_envs)
                last_value = agent.get_value(torch.from_numpy(next_obs).to(device)).cpu().numpy()
            # V(s_{t+1}): the next stored observation is the one the step returned (the final one when
            # the episode ended, thanks to next-step autoreset); the last one is next_obs.
            next_values = np.concatenate([values[1:], last_value[None]])

            # GAE (core #5, Schulman et al. 2016 eq. 16). A time-limit truncation bootstraps from
            # V(final obs) unless --no-bootstrap-truncation, which treats it as a termination.
            bootstrap_stop = terminations if args.bootstrap_truncation else dones
            advantages, returns = compute_gae(
                rewards, values, next_values, bootstrap_stop, dones, args.gamma, args.gae_lambda
            )

            # flatten the batch; keep only real transitions (autoreset steps masked out)
            b_advantages = torch.from_numpy(advantages).to(device).reshape(-1)
            b_returns = torch.from_numpy(returns).to(device).reshape(-1)
            b_valid_inds = torch.as_tensor(np.flatnonzero(valid.reshape(-1)), device=device)
            masked_steps += args.batch_size - len(b_valid_inds)

            # UPDATE: epochs over shuffled minibatches of at least 2 transitions (core #6)
            clipfracs, stats = [], {}
            for epoch in range(args.update_epochs):
                perm = b_valid_inds[torch.randperm(len(b_valid_inds), device=device)]
                for mb_inds in minibatches(perm, args.num_minibatches):
                    loss, stats = loss_fn(
                        agent, b_obs[mb_inds], b_actions[mb_inds], b_logprobs[mb_inds], b_advantages[mb_inds],
                        b_returns[mb_inds], b_values[mb_inds], args.clip_coef, args.vf_coef, args.ent_coef,
                        args.norm_adv, args.clip_vloss,
                    )
                    clipfracs.append(stats["clipfrac"])
                    optimizer.zero_grad()
                    loss.backward()
                    grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)  # core #11
                    common.check_finite_update({"loss": loss, "gradient norm": grad_norm},  # before the step
                                               f"iteration {iteration}, epoch {epoch + 1}", NONFINITE_HINT, ckpt_path)
                    optimizer.step()

                if args.target_kl is not None and stats and stats["approx_kl"] > args.target_kl:
                    break
            common.check_finite_parameters(agent.parameters(), f"iteration {iteration}", NONFINITE_HINT, ckpt_path)

            # TRY NOT TO MODIFY: record rewards and debug variables for plotting purposes
            sps = int((global_step - start_step) / (time.time() - start_time))
            log_iteration(writer, global_step, optimizer.param_groups[0]["lr"], stats, clipfracs,
                          b_values[b_valid_inds].cpu().numpy(), b_returns[b_valid_inds].cpu().numpy(), sps,
                          rollout_time, time.time() - rollout_start)
            pbar.update(args.batch_size)
            if episodes:
                pbar.set_postfix(ret=f"{episodes[-1][1]:.1f}", sps=sps, refresh=False)

            if iteration == args.num_iterations or (args.save_every and iteration % args.save_every == 0):
                common.atomic_save(checkpoint_dict(agent, optimizer, envs, args, iteration, global_step), ckpt_path)
    finally:  # also on an error: the progress bar ends its line, the logs reach the disk
        pbar.close()
        envs.close()
        writer.close()
    return write_summary(run_dir, args, episodes, masked_steps, global_step, start_step, start_time, start_cpu)


def log_iteration(writer, global_step: int, learning_rate: float, stats: dict, clipfracs: list, y_pred: np.ndarray,
                  y_true: np.ndarray, sps: int, rollout_seconds: float, iteration_seconds: float) -> None:
    """Write one iteration's debug variables (core #12): the losses and KL estimates of its last
    minibatch (none when no minibatch ran), the mean clip fraction, the explained variance of the
    values ``y_pred`` against the returns ``y_true`` (real transitions only), speed and timings."""
    writer.add_scalar("charts/learning_rate", learning_rate, global_step)
    for name in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl"):
        if name in stats:
            writer.add_scalar(f"losses/{name}", stats[name].item(), global_step)  # last minibatch
    if clipfracs:
        writer.add_scalar("losses/clipfrac", torch.stack(clipfracs).mean().item(), global_step)
    writer.add_scalar("losses/explained_variance", explained_variance(y_pred, y_true), global_step)
    writer.add_scalar("charts/SPS", sps, global_step)
    writer.add_scalar("perf/rollout_seconds", rollout_seconds, global_step)
    writer.add_scalar("perf/iteration_seconds", iteration_seconds, global_step)


def write_summary(run_dir: Path, args: Args, episodes: list, masked_steps: int, global_step: int, start_step: int,
                  start_time: float, start_cpu: float) -> dict:
    """The summary :func:`train` returns, also written to ``{run_dir}/summary.json`` with the mean
    return of the last 10 episodes; speeds count the steps of this session (from ``start_step``)."""
    sps = (global_step - start_step) / max(time.time() - start_time, 1e-9)
    # steps per second of this process's CPU time: comparable across runs on a shared machine
    cpu_sps = (global_step - start_step) / max(time.process_time() - start_cpu, 1e-9)
    last = [r for _, r, _ in episodes[-10:]]
    summary = {"run_dir": str(run_dir), "global_step": global_step, "sps": sps, "episodes": episodes,
               "masked_steps": masked_steps, "cpu_sps": cpu_sps}
    with open(run_dir / "summary.json", "w") as f:
        json.dump({**summary, "final_return_last10": float(np.mean(last)) if last else None}, f)
    if last:
        print(f"{args.env_id}: {global_step} steps, {sps:.0f} steps/s, "
              f"mean return of the last {len(last)} episodes {np.mean(last):.1f}")
    print(f"checkpoint: {run_dir / 'checkpoint.pt'}")
    return summary


# ----------------------------------------------------------------------------------------------
# Environment: gymnasium's own vector-level wrappers (statistics shared by all envs)
# ----------------------------------------------------------------------------------------------
class FastRunningMeanStd(RunningMeanStd):
    """gymnasium's ``RunningMeanStd`` with a shortcut for a batch of one row.

    ``update(x)`` with ``x`` of shape ``(1, *shape)`` uses mean ``x[0]`` and variance 0, which is
    exactly what ``np.mean``/``np.var`` return for one row, through the same
    ``update_mean_var_count_from_moments`` (Chan et al. parallel variance), so the statistics are
    bit-for-bit gymnasium's; it only skips ~50 us of NumPy reduction overhead per env step when
    ``--num-envs 1``. Larger batches take gymnasium's own path.
    """

    def update(self, x: np.ndarray) -> None:
        if x.shape[0] == 1:
            self.update_from_moments(x[0], np.zeros_like(self.var), 1)
        else:
            super().update(x)


def check_env_id(env_id: str) -> tuple[int, int]:
    """Make ``env_id`` once to check it; returns ``(obs_dim, act_dim)``.

    Raises:
        UsageError: the id is unknown or cannot be made (e.g. MuJoCo missing), its action space is
            not a ``Box`` (this script is for continuous actions), or its observation is not flat.
    """
    try:
        env = gym.make(env_id)
    except Exception as e:  # noqa: BLE001 - gym raises many error types; the user needs one line
        msg = common.first_line(e) or type(e).__name__
        cause = e.__cause__  # gymnasium re-raises a failed MuJoCo import as "MuJoCo is not installed": keep the cause
        why = f" ({type(cause).__name__}: {common.first_line(cause) or type(cause).__name__})" if cause is not None else ""
        raise UsageError(f"--env-id: cannot make {env_id!r}: {msg}{why}") from None
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    common.check(
        isinstance(act_space, gym.spaces.Box),
        f"--env-id: {env_id} has a {type(act_space).__name__} action space; this script needs a "
        "continuous (Box) one (use a discrete-action PPO for it)",
    )
    common.check(
        isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) == 1,
        f"--env-id: {env_id} needs a flat Box observation space, got {obs_space}",
    )
    return int(obs_space.shape[0]), int(np.prod(act_space.shape))


def make_envs(
    env_id: str,
    num_envs: int,
    vector_mode: str = "sync",
    gamma: float = 0.99,
    obs_clip: float = 10.0,
    reward_clip: float = 10.0,
    video_dir: str | None = None,
) -> gym.vector.VectorEnv:
    """Vector env with the 37-details wrappers, all gymnasium's own, at the vector level.

    Order (inner to outer): RecordEpisodeStatistics (raw returns, core #12), TransformAction clip
    (the env sees clipped actions, cont. #5), NormalizeObservation (cont. #6), TransformObservation clip
    (cont. #7), NormalizeReward by the std of the discounted return (cont. #8), TransformReward
    clip (cont. #9). Next-step autoreset (gymnasium's default, which the vector
    NormalizeObservation requires). Observations are float32 of shape ``(num_envs, obs_dim)``.
    ``video_dir`` records env 0 with ``gymnasium.wrappers.RecordVideo``.
    """

    def thunk(idx: int):
        def _make():
            if video_dir is not None and idx == 0:
                env = gym.make(env_id, render_mode="rgb_array")
                return gym.wrappers.RecordVideo(env, video_dir)
            return gym.make(env_id)

        return _make

    vec_cls = gym.vector.SyncVectorEnv if vector_mode == "sync" else gym.vector.AsyncVectorEnv
    # copy=False: no deep copy of each batch of observations; NormalizeObservation below returns
    # a fresh array every step anyway
    envs = vec_cls(
        [thunk(i) for i in range(num_envs)], copy=False, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP
    )
    envs = vector_wrappers.RecordEpisodeStatistics(envs)
    # cont. #5: what gymnasium's vector ClipAction does, without its per-env Python loop
    low, high = envs.single_action_space.low, envs.single_action_space.high
    envs = vector_wrappers.TransformAction(envs, lambda act: np.clip(act, low, high), envs.action_space)
    envs = vector_wrappers.NormalizeObservation(envs)
    envs.obs_rms = FastRunningMeanStd(shape=envs.obs_rms.mean.shape, dtype=envs.obs_rms.mean.dtype)
    envs = vector_wrappers.TransformObservation(
        envs, lambda obs: np.clip(obs, -obs_clip, obs_clip), envs.observation_space
    )
    envs = vector_wrappers.NormalizeReward(envs, gamma=gamma)
    envs.return_rms = FastRunningMeanStd(shape=())
    envs = vector_wrappers.TransformReward(envs, lambda r: np.clip(r, -reward_clip, reward_clip))
    return envs


def finished_episodes(infos: dict) -> list[tuple[int, float, int]]:
    """Every episode that ended on this step, as ``(env_index, return, length)``.

    Reads ``infos["episode"]`` / ``infos["_episode"]`` written by gymnasium 1.x's vector
    ``RecordEpisodeStatistics`` (raw, unscaled rewards); several envs finishing on the same step
    all appear. Returns ``[]`` when none finished.
    """
    if "_episode" not in infos:
        return []
    ep = infos["episode"]
    return [(int(i), float(ep["r"][i]), int(ep["l"][i])) for i in np.flatnonzero(infos["_episode"])]


# ----------------------------------------------------------------------------------------------
# Normalisation state: saved in checkpoints, restored for resume and evaluation
# ----------------------------------------------------------------------------------------------
def _find_wrapper(envs: gym.vector.VectorEnv, cls: type) -> gym.vector.VectorWrapper:
    env = envs
    while not isinstance(env, cls):
        if not hasattr(env, "env"):
            raise ValueError(f"no {cls.__name__} in the wrapper chain")
        env = env.env
    return env


def get_norm_state(envs: gym.vector.VectorEnv) -> dict[str, np.ndarray | float]:
    """Copy of the normalisation statistics of ``make_envs``'s wrappers.

    Returns ``obs_mean``/``obs_var`` of shape ``(obs_dim,)`` and ``obs_count`` (observation
    normaliser, cont. #6) and ``ret_mean``/``ret_var``/``ret_count`` (scalars, the discounted-return
    statistics of the reward scaler, cont. #8). Raises ``ValueError`` if a wrapper is missing.
    """
    obs_rms = _find_wrapper(envs, vector_wrappers.NormalizeObservation).obs_rms
    ret_rms = _find_wrapper(envs, vector_wrappers.NormalizeReward).return_rms
    return {
        "obs_mean": np.array(obs_rms.mean, copy=True), "obs_var": np.array(obs_rms.var, copy=True),
        "obs_count": obs_rms.count,
        "ret_mean": np.array(ret_rms.mean, copy=True), "ret_var": np.array(ret_rms.var, copy=True),
        "ret_count": ret_rms.count,
    }


def set_norm_state(envs: gym.vector.VectorEnv, state: dict, update: bool = True) -> None:
    """Restore what :func:`get_norm_state` returned, bit for bit; ``update=False`` freezes both
    normalisers (gymnasium's ``update_running_mean``), as for evaluation.

    Raises:
        UsageError: the statistics' shape does not match the env's observation.
    """
    obs_norm = _find_wrapper(envs, vector_wrappers.NormalizeObservation)
    ret_norm = _find_wrapper(envs, vector_wrappers.NormalizeReward)
    common.check(
        np.shape(state["obs_mean"]) == obs_norm.obs_rms.mean.shape,
        f"checkpoint: observation statistics of shape {np.shape(state['obs_mean'])} do not fit "
        f"observations of shape {obs_norm.obs_rms.mean.shape}",
    )
    obs_norm.obs_rms.mean = np.array(state["obs_mean"], copy=True)
    obs_norm.obs_rms.var = np.array(state["obs_var"], copy=True)
    obs_norm.obs_rms.count = state["obs_count"]
    ret_norm.return_rms.mean = np.array(state["ret_mean"], copy=True)
    ret_norm.return_rms.var = np.array(state["ret_var"], copy=True)
    ret_norm.return_rms.count = state["ret_count"]
    set_norm_updates(envs, update)


def set_norm_updates(envs: gym.vector.VectorEnv, update: bool) -> None:
    """Let both normalisers update their running statistics, or freeze them (gymnasium's ``update_running_mean``)."""
    for wrapper in (vector_wrappers.NormalizeObservation, vector_wrappers.NormalizeReward):
        _find_wrapper(envs, wrapper).update_running_mean = update


def get_running_return(envs: gym.vector.VectorEnv) -> np.ndarray:
    """A copy of the reward scaler's running discounted return per env, shape ``(num_envs,)`` (cont. #8).

    Not a statistic but per-env state: ``envs.reset`` clears it, so a resumed run puts it back
    after its reset (:func:`restore_checkpoint`).
    """
    return np.array(_find_wrapper(envs, vector_wrappers.NormalizeReward).accumulated_reward, copy=True)


# ----------------------------------------------------------------------------------------------
# Evaluation: deterministic policy, frozen statistics
# ----------------------------------------------------------------------------------------------
def evaluate(args: Args) -> list[float]:
    """Run ``--eval-episodes`` episodes of the checkpoint's mean action with frozen
    normalisation statistics; prints and returns the raw episodic returns.

    Raises:
        UsageError: an unreadable checkpoint, another script's, or one that does not fit its env.
    """
    ckpt = load_checked_checkpoint(args.eval_checkpoint, "--eval-checkpoint", ("agent", "norm"))
    saved = Args(**ckpt["args"])  # the flags of the run that wrote it (its env, discount and clips)
    obs_dim, act_dim = check_env_id(saved.env_id)
    check_checkpoint_fits(ckpt, args.eval_checkpoint, "--eval-checkpoint", saved.env_id, obs_dim, act_dim)
    run_dir = Path(args.eval_checkpoint).resolve().parent
    video_dir = _video_dir(args.capture_video, saved.env_id, run_dir / "videos_eval")
    device = _device(args)
    envs = make_envs(saved.env_id, 1, "sync", saved.gamma, saved.obs_clip, saved.reward_clip, video_dir)
    set_norm_state(envs, ckpt["norm"], update=False)
    agent = Agent(obs_dim, act_dim).to(device)
    agent.load_state_dict(ckpt["agent"])
    agent.eval()
    returns: list[float] = []
    next_obs, _ = envs.reset(seed=args.seed)
    with torch.inference_mode():
        while len(returns) < args.eval_episodes:
            action = agent.actor_mean(torch.as_tensor(next_obs, device=device))  # the mean action
            next_obs, _, _, _, infos = envs.step(action.cpu().numpy())
            returns += [r for _, r, _ in finished_episodes(infos)]
    envs.close()
    returns = returns[: args.eval_episodes]
    print(f"eval {saved.env_id}: {len(returns)} episodes, return {np.mean(returns):.1f} +- {np.std(returns):.1f}")
    return returns


# ----------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: run plumbing (flag checks, resume, checkpoints, video, device)
# ----------------------------------------------------------------------------------------------
def validate_args(args: Args) -> Args:
    """Check every flag and fill in the derived sizes; returns ``args``. Reads no file, makes no env.

    Raises:
        UsageError: one line naming the flag: a seed outside [0, 2**32 - 1], a NaN or infinite
            float, a size that is not positive or does not divide, a minibatch of fewer than 2
            transitions, an out-of-range coefficient, a run name with a '/', --resume together
            with --eval-checkpoint, or a rollout larger than this machine's memory.
    """
    common.check_seed(args.seed)
    common.check_finite_floats(args)
    for name in ("num_envs", "num_steps", "num_minibatches", "update_epochs", "eval_episodes"):
        value = getattr(args, name)
        common.check(value >= 1, f"{common.flag_name(name)}: must be a positive integer, got {value}")
    common.check(args.save_every >= 0, f"--save-every: must be >= 0 (0 saves only at the end), got {args.save_every}")
    cpus = os.cpu_count() or 1
    common.check(0 <= args.num_threads <= cpus, f"--num-threads: must be in [0, {cpus}] (0 keeps torch's default; "
                 f"this machine has {cpus} CPUs), got {args.num_threads}")
    for name in ("learning_rate", "clip_coef", "max_grad_norm", "obs_clip", "reward_clip"):
        value = getattr(args, name)
        common.check(value > 0, f"{common.flag_name(name)}: must be positive, got {value}")
    for name in ("vf_coef", "ent_coef"):
        value = getattr(args, name)
        common.check(value >= 0, f"{common.flag_name(name)}: must be >= 0, got {value}")
    for name in ("gamma", "gae_lambda"):
        value = getattr(args, name)
        common.check(0.0 <= value <= 1.0, f"{common.flag_name(name)}: must be in [0, 1], got {value}")
    common.check(args.target_kl is None or args.target_kl > 0,
                 f"--target-kl: must be positive (leave it out for no early stopping), got {args.target_kl}")
    common.check(args.exp_name != "" and not any(c in args.exp_name for c in "/\\\0"),
                 f"--exp-name: must be a non-empty name without '/' (it names the run directory), "
                 f"got {args.exp_name!r}")
    common.check(args.resume is None or args.eval_checkpoint is None,
                 "--eval-checkpoint: cannot be combined with --resume (evaluate the checkpoint after training)")
    args.batch_size = args.num_envs * args.num_steps
    common.check(
        args.batch_size % args.num_minibatches == 0,
        f"--num-minibatches: must divide num_envs * num_steps = {args.batch_size}, got {args.num_minibatches}",
    )
    args.minibatch_size = args.batch_size // args.num_minibatches
    common.check(args.minibatch_size >= 2, f"--num-minibatches: each minibatch needs at least 2 transitions "
                 f"(num_envs * num_steps = {args.batch_size} split into {args.num_minibatches})")
    if args.eval_checkpoint is None:
        common.check(
            args.total_timesteps >= args.batch_size,
            f"--total-timesteps: must be at least one rollout, num_envs * num_steps = {args.batch_size}",
        )
        check_rollout_memory(args)
    args.num_iterations = args.total_timesteps // args.batch_size
    return args


def check_rollout_memory(args: Args, obs_dim: int = 1, act_dim: int = 1) -> None:
    """Refuse, in one line, a rollout that cannot fit in this machine's memory (before NumPy asks for it).

    Counts about ``obs_dim + 8 * act_dim + 280`` float32 per transition: the storage arrays, the
    noise, values, advantages and indices, and the 64-wide activations of the batched forward
    pass. With the default dimensions 1 it is a lower bound, usable before the env is made.
    """
    floats = obs_dim + 8 * act_dim + 280
    common.check_fits_in_memory(4 * floats * args.batch_size, "--num-steps/--num-envs",
                                f"a rollout of num_envs * num_steps = {args.batch_size:,} transitions ")


RESUME_FROZEN = {
    "env_id": "the networks and normalisation statistics are that env's; start a new run instead",
    "num_envs": "the reward scaler's state is per env and iterations count num_envs * num_steps steps; "
                "start a new run instead",
    "num_steps": "iterations count num_envs * num_steps steps; start a new run instead",
    "runs_dir": "a resumed run writes to the directory of its checkpoint",
}
"""Flags a resumed run cannot change, and why (see :func:`common.check_resume_compatible`)."""


def check_resume(args: Args) -> dict | None:
    """Before any env is made: for a new run, check that ``--runs-dir`` can be written and return
    None; for ``--resume``, return its checkpoint after checking it (readable, this script's,
    complete, flags compatible, steps left to train, its directory writable).

    Raises:
        UsageError: one line naming the flag.
    """
    if args.resume is None:
        common.check_writable_dir(args.runs_dir, "--runs-dir")
        return None
    ckpt = load_checked_checkpoint(args.resume, "--resume", ("agent", "optimizer", "norm", "rng", "iteration",
                                                              "global_step"))
    common.check_resume_compatible(ckpt["args"], args, RESUME_FROZEN)
    common.check(args.num_iterations > ckpt["iteration"],
                 f"--total-timesteps: this run already reached step {ckpt['global_step']} ({ckpt['iteration']} "
                 f"iterations of {args.batch_size} steps); pass more than {args.total_timesteps} to train further")
    common.check_writable_dir(Path(args.resume).resolve().parent, "--resume")
    return ckpt


def new_run_dir(args: Args) -> Path:
    """``{runs_dir}/{env}__{exp_name}__{seed}__{unix time}`` (:func:`common.make_run_name`), for a run not resumed.

    Raises:
        UsageError: it holds a checkpoint (a run of the same env, name and seed started in the same second).
    """
    run_dir = Path(args.runs_dir) / common.make_run_name(args.exp_name, args)
    common.check_new_run_dir(run_dir, "--exp-name")
    return run_dir


def load_checked_checkpoint(path: str, flag: str, keys: tuple[str, ...]) -> dict:
    """The checkpoint at ``path``, read on the CPU, after checking that this script wrote it (see
    :func:`common.check_checkpoint_script`), that it holds ``keys`` and that none of their values
    holds a NaN or an inf (a run that diverged before checkpoints refused them could save one).

    Raises:
        UsageError: one line naming ``flag`` and ``path``.
    """
    ckpt = common.load_checkpoint(path, flag)
    common.check_checkpoint_script(ckpt, path, Args, SCRIPT, flag)
    missing = [key for key in keys if key not in ckpt]
    common.check(not missing, f"{flag}: {path} holds no {', '.join(missing)}; it is not a complete {SCRIPT} checkpoint")
    bad = common.first_non_finite({key: ckpt[key] for key in keys})
    common.check(bad is None, f"{flag}: {path} holds non-finite values in {bad}; it is from a run that diverged")
    return ckpt


def check_checkpoint_fits(ckpt: dict, path: str, flag: str, env_id: str, obs_dim: int, act_dim: int) -> None:
    """Refuse a checkpoint whose networks or observation statistics have other shapes than an
    ``Agent(obs_dim, act_dim)`` for ``env_id``, before any vector env is made.

    Raises:
        UsageError: ``"--resume: the networks in PATH do not fit ENV (observation size O, action size A)"``.
    """
    with torch.random.fork_rng(devices=[]):  # a throw-away Agent for its shapes; the RNG stays as it was
        expected = {key: tuple(value.shape) for key, value in Agent(obs_dim, act_dim).state_dict().items()}
    agent, norm = ckpt["agent"], ckpt["norm"]
    shapes = {key: tuple(np.shape(value)) for key, value in agent.items()} if isinstance(agent, dict) else None
    fits = shapes == expected and isinstance(norm, dict) and np.shape(norm.get("obs_mean")) == (obs_dim,)
    common.check(fits, f"{flag}: the networks in {path} do not fit {env_id} "
                       f"(observation size {obs_dim}, action size {act_dim})")


def checkpoint_dict(agent, optimizer, envs, args: Args, iteration: int, global_step: int) -> dict:
    """Everything a resumed run or an evaluation needs: networks, optimizer, counters, every RNG,
    the normalisation statistics (see :func:`get_norm_state`), the reward scaler's running return,
    the flags and this script's name."""
    return {
        "agent": agent.state_dict(),
        "optimizer": optimizer.state_dict(),
        "iteration": iteration,
        "global_step": global_step,
        "rng": common.get_rng_state(),
        "norm": get_norm_state(envs),
        "running_return": get_running_return(envs),
        "args": dataclasses.asdict(args),
        "script": SCRIPT,
    }


def restore_checkpoint(ckpt: dict, agent: Agent, optimizer: optim.Optimizer, envs: gym.vector.VectorEnv,
                       args: Args) -> tuple[int, int, np.ndarray]:
    """Load a checked checkpoint into a fresh run; returns ``(first iteration, global step, first observation)``.

    The envs restart from a reset seeded with ``--seed + global step`` (the simulator state is not
    saved), taken with the statistics frozen: the uninterrupted run had already counted the
    observation of an autoreset step that ended the rollout. The learning rate is the flag's (the
    saved optimizer's would otherwise win under ``--no-anneal-lr``); the RNGs are restored last.
    """
    agent.load_state_dict(ckpt["agent"])
    optimizer.load_state_dict(ckpt["optimizer"])
    for group in optimizer.param_groups:
        group["lr"] = args.learning_rate
    set_norm_state(envs, ckpt["norm"], update=False)  # the reset's observations must not move the saved statistics
    next_obs, _ = envs.reset(seed=args.seed + ckpt["global_step"])
    set_norm_updates(envs, True)
    running_return = ckpt.get("running_return")  # older checkpoints have none: it restarts at 0
    if running_return is not None and np.shape(running_return) == (args.num_envs,):
        _find_wrapper(envs, vector_wrappers.NormalizeReward).accumulated_reward[:] = running_return
    common.set_rng_state(ckpt["rng"])
    return ckpt["iteration"] + 1, ckpt["global_step"], next_obs


def _check_video(flag: str, env_id: str) -> None:
    """Fail early, in one line, when ``env_id`` cannot be recorded: moviepy missing, or no OpenGL.

    MuJoCo renders through GLFW by default, which needs a display; on a Linux machine without one
    (a server, CI) rendering goes through EGL instead, unless ``MUJOCO_GL`` is already set.
    """
    common.check(importlib.util.find_spec("moviepy") is not None,
                 f"{flag}: video recording needs moviepy; install it with: pip install moviepy")
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        env = gym.make(env_id, render_mode="rgb_array")
        env.reset(seed=0)
        frame = env.render()
        env.close()
    except Exception as e:  # noqa: BLE001 - GL and renderer errors have no common base class
        raise UsageError(f"{flag}: cannot render {env_id} ({type(e).__name__}: {common.first_line(e)[:120]}); "
                         f"on a machine without a display try MUJOCO_GL=egl or MUJOCO_GL=osmesa") from None
    common.check(isinstance(frame, np.ndarray) and frame.ndim == 3, f"{flag}: {env_id} rendered no RGB frame")


def _video_dir(capture_video: bool, env_id: str, directory: Path) -> str | None:
    """``directory`` as a string when ``--capture-video`` is on and ``env_id`` can be recorded there, else None.

    Raises:
        UsageError: moviepy missing, no renderer, or ``directory`` cannot be written (:func:`_check_video`).
    """
    if not capture_video:
        return None
    common.check_writable_dir(directory, "--capture-video")
    _check_video("--capture-video", env_id)
    return str(directory)


def _device(args: Args) -> torch.device:
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    return torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")


def main(args: Args | None = None):
    """Entry point: parse flags (unless ``args`` is given), check them, then evaluate or train."""
    if args is None:
        args = common.parse_args(Args, script=SCRIPT)
    args = validate_args(args)
    if args.eval_checkpoint is not None:
        return evaluate(args)
    return train(args)


def cli(argv: list[str] | None = None) -> None:
    """The command line: :func:`main` on ``argv`` (default ``sys.argv[1:]``); a bad input ends with one
    ``error: ...`` line on stderr and exit code 2 (:func:`common.run_cli`)."""
    common.run_cli(lambda: main(common.parse_args(Args, argv, script=SCRIPT)))


if __name__ == "__main__":
    cli()
