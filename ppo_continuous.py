"""PPO for continuous control (MuJoCo) on gymnasium 1.x, read beside "The 37 Implementation
Details of PPO" (Huang et al., ICLR blog track 2022): its 13 core ("core #k") and 9 continuous
("cont. #k") details; GAE is Schulman et al. 2016 eq. 16, the clipped surrogate Schulman et al.
2017 eq. 7. CleanRL's ppo_continuous_action.py with its defaults, except:
  * gymnasium's vector-level normalisation (statistics shared by all envs, saved in checkpoints,
    frozen by --eval-checkpoint) needs next-step autoreset: the step after an episode ends only
    resets the env (reward 0); it is stored but masked out of the loss, and GAE never crosses it.
  * A time-limit truncation bootstraps from V(final observation), which that masked step holds
    (--no-bootstrap-truncation: a termination, as in CleanRL).
  * The rollout samples with a NumPy copy of the actor (a sixth of torch's cost per step);
    values and log-probs come from one batched pass after it.
  * Minibatches hold at least 2 real transitions (with 1, CleanRL's advantage std is NaN).
  * Nothing non-finite is applied or saved; checkpoints are atomic; --resume continues a run
    exactly, but for one limit (see resume_from).
Usage: python ppo_continuous.py --env-id Hopper-v5 --seed 1, then --resume or --eval-checkpoint
runs/<run>/checkpoint.pt; tensorboard --logdir runs."""

import contextlib
import dataclasses
import io
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Literal

import gymnasium as gym
import numpy as np
import pydantic
import torch
import torch.nn as nn
import tyro
from annotated_types import Ge, Gt, Interval
from gymnasium.wrappers import vector as vector_wrappers
from torch.utils.tensorboard import SummaryWriter

# a name that can be part of a path: no '/', backslash or NUL
PathPart = Annotated[str, pydantic.StringConstraints(pattern=r"^[^/\\\x00]+$")]


@pydantic.with_config(pydantic.ConfigDict(allow_inf_nan=False, extra="forbid"))
@dataclasses.dataclass
class Args:  # the flags, each with its constraints (checked by validate()) and --help text
    exp_name: PathPart = "ppo_continuous"  # the name of this experiment (part of the run's name)
    seed: Annotated[int, Interval(ge=0, le=2**32 - 1)] = 1  # all randomness flows from it
    torch_deterministic: bool = True  # if toggled, sets `torch.backends.cudnn.deterministic=True`
    cuda: bool = True  # use CUDA when it is available
    #: torch CPU threads, at most this machine's CPUs; 1 is fastest for 64x64 MLPs (0: torch's own)
    num_threads: Annotated[int, Interval(ge=0, le=os.cpu_count() or 1)] = 1
    compile: bool = False  # torch.compile the minibatch loss (needs a C++ compiler, ~1 min warm-up)
    runs_dir: str = "runs"  # TensorBoard logs, args.json and checkpoints go to {runs_dir}/{run}/
    capture_video: bool = False  # record videos of env 0 to {run_dir}/videos (needs moviepy)
    save_every: Annotated[int, Ge(0)] = 50  # checkpoint every this many iterations (0: at the end)
    #: a checkpoint.pt to continue; its run's flags are the defaults, flags given again win
    resume: str | None = None
    #: a checkpoint.pt to evaluate with the deterministic (mean) action instead of training
    eval_checkpoint: str | None = None
    eval_episodes: Annotated[int, Ge(1)] = 10  # number of episodes for --eval-checkpoint

    # Algorithm specific arguments
    env_id: str = "HalfCheetah-v5"  # a gymnasium environment with a continuous (Box) action space
    total_timesteps: int = 1_000_000  # total environment steps of the experiment
    learning_rate: Annotated[float, Gt(0)] = 3e-4  # the learning rate of the optimizer
    num_envs: Annotated[int, Ge(1)] = 1  # the number of parallel environments
    vector_mode: Literal["sync", "async"] = "sync"  # envs in this process, or one subprocess each
    num_steps: Annotated[int, Ge(1)] = 2048  # the number of steps per env per rollout
    anneal_lr: bool = True  # linearly anneal the learning rate to 0 (core #4)
    gamma: Annotated[float, Interval(ge=0, le=1)] = 0.99  # the discount factor gamma
    gae_lambda: Annotated[float, Interval(ge=0, le=1)] = 0.95  # the lambda of GAE
    num_minibatches: Annotated[int, Ge(1)] = 32  # the number of minibatches per epoch
    update_epochs: Annotated[int, Ge(1)] = 10  # the number of epochs over each rollout
    norm_adv: bool = True  # normalise advantages per minibatch (core #7)
    clip_coef: Annotated[float, Gt(0)] = 0.2  # the surrogate clipping coefficient epsilon
    clip_vloss: bool = True  # clip the value loss (core #9)
    ent_coef: Annotated[float, Ge(0)] = 0.0  # coefficient of the entropy bonus
    vf_coef: Annotated[float, Ge(0)] = 0.5  # coefficient of the value loss
    max_grad_norm: Annotated[float, Gt(0)] = 0.5  # the maximum global gradient norm (core #11)
    target_kl: Annotated[float, Gt(0)] | None = None  # stop an update once approx_kl exceeds it
    #: bootstrap from V(final observation) at time-limit truncations (off: CleanRL)
    bootstrap_truncation: bool = True
    obs_clip: Annotated[float, Gt(0)] = 10.0  # clip normalised observations to +-this (cont. #7)
    reward_clip: Annotated[float, Gt(0)] = 10.0  # clip scaled rewards to +-this (cont. #9)

    # computed after parsing, not flags
    batch_size: tyro.conf.Suppress[int] = 0  # num_envs * num_steps
    minibatch_size: tyro.conf.Suppress[int] = 0  # batch_size // num_minibatches
    num_iterations: tyro.conf.Suppress[int] = 0  # total_timesteps // batch_size


# ----------------------------------------------------------------------------------------------
# ALGO LOGIC. Network: separate actor and critic, 64x64 tanh MLPs (core #13, cont. #4)
# ----------------------------------------------------------------------------------------------
def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """Orthogonal weights with gain ``std``, constant biases (core #2)."""
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def mlp(in_dim: int, out_dim: int, std: float) -> nn.Sequential:
    """``(B, in_dim) -> (B, out_dim)``: two tanh layers of 64, an output layer of gain ``std``."""
    hidden1 = layer_init(nn.Linear(in_dim, 64))
    hidden2 = layer_init(nn.Linear(64, 64))
    output = layer_init(nn.Linear(64, out_dim), std)
    return nn.Sequential(hidden1, nn.Tanh(), hidden2, nn.Tanh(), output)


class Agent(nn.Module):
    """Gaussian policy with state-independent log-std (cont. #1-#3) and a separate critic.
    ``actor_mean(x)``: ``(B, obs_dim) -> (B, act_dim)``; ``critic(x)``: ``(B, obs_dim) -> (B, 1)``.
    """

    def __init__(self, obs_dim: int, act_dim: int):
        super().__init__()
        self.critic = mlp(obs_dim, 1, std=1.0)
        self.actor_mean = mlp(obs_dim, act_dim, std=0.01)
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))  # cont. #2

    def numpy_actor_mean(self):
        """A NumPy copy of ``actor_mean`` as it is now, float32, the same function to rounding
        (tested): a one-row torch forward costs ~90 us per env step, NumPy ~15 us."""
        params = [p.detach().cpu().numpy() for p in self.actor_mean.parameters()]
        w1, b1, w2, b2, w3, b3 = [p.T.copy() for p in params]  # weights as (in, out)

        def actor_mean(x):
            hidden = np.tanh(x @ w1 + b1)
            hidden = np.tanh(hidden @ w2 + b2)
            return hidden @ w3 + b3

        return actor_mean

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor):
        """Log-prob ``(B,)`` of ``action`` ``(B, act_dim)``, entropy ``(B,)`` and value ``(B,)``;
        action dimensions are independent, their log-probs and entropies summed (cont. #3)."""
        action_mean = self.actor_mean(x)
        action_logstd = self.actor_logstd.expand_as(action_mean)
        action_std = action_logstd.exp()
        probs = torch.distributions.Normal(action_mean, action_std, validate_args=False)
        logprob = probs.log_prob(action).sum(-1)
        entropy = probs.entropy().sum(-1)
        value = self.critic(x).squeeze(-1)
        return logprob, entropy, value


# ----------------------------------------------------------------------------------------------
# The PPO loss of one minibatch (core #7-#10, #12)
# ----------------------------------------------------------------------------------------------
def ppo_loss(
    agent: Agent, minibatch, *, clip_coef, vf_coef, ent_coef, norm_adv=True, clip_vloss=True
):
    """``L_clip + vf_coef * L_V - ent_coef * H`` of ``B`` transitions, to be minimised (Schulman et
    al. 2017 eq. 7 and 9, negated). ``minibatch``: ``obs`` ``(B, obs_dim)`` normalised, ``actions``
    ``(B, act_dim)`` unclipped, then ``(B,)``: ``old_logprobs``, ``advantages`` (GAE), ``returns =
    advantages + old_values``, ``old_values``. Returns ``(loss, stats)``: detached ``policy_loss``,
    ``value_loss``, ``entropy``, ``old_approx_kl``, ``approx_kl`` (k1, k3 estimates of KL(pi_old ||
    pi)), ``clipfrac``. With ``norm_adv``, 1 transition has no std: :func:`minibatches` gives 2+."""
    obs, actions, old_logprobs, advantages, returns, old_values = minibatch
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

    # core #10: overall loss with entropy bonus (left out of the graph when its coef is 0: faster)
    entropy_loss = entropy.mean()
    loss = pg_loss + v_loss * vf_coef
    if ent_coef:
        loss = loss - ent_coef * entropy_loss

    with torch.no_grad():  # core #12: debug variables
        old_approx_kl = (-logratio).mean()  # k1 estimate of KL(old || new)
        approx_kl = ((ratio - 1) - logratio).mean()  # k3 estimate of KL(old || new)
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    stats = dict(policy_loss=pg_loss, value_loss=v_loss, entropy=entropy_loss, clipfrac=clipfrac)
    stats = {name: stat.detach() for name, stat in stats.items()}
    stats["old_approx_kl"] = old_approx_kl
    stats["approx_kl"] = approx_kl
    return loss, stats


# ----------------------------------------------------------------------------------------------
# GAE (core #5) and minibatches (core #6)
# ----------------------------------------------------------------------------------------------
def compute_gae(
    rewards, values, next_values, *, terminations, dones, gamma: float, gae_lambda: float
):
    """Generalized advantage estimation (Schulman et al. 2016 eq. 16) over NumPy arrays ``(T, N)``:
    ``delta_t = r_t + gamma * (1 - term_t) * V(s_{t+1}) - V(s_t)``, ``A_t = delta_t + gamma *
    lambda * (1 - done_t) * A_{t+1}``; ``next_values[t]``: V of the observation step t returned (the
    final one at an episode's end); ``terminations``: 1 where it is terminal (``dones``: CleanRL's
    rule); ``dones``: 1 where the episode ended. Returns ``(advantages, advantages + values)``."""
    advantages = np.zeros_like(rewards)
    lastgaelam = np.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        nonterminal = 1.0 - terminations[t]
        delta = rewards[t] + gamma * next_values[t] * nonterminal - values[t]
        continues = 1.0 - dones[t]  # 0: step t + 1 starts another episode
        lastgaelam = delta + gamma * gae_lambda * continues * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def minibatches(inds: torch.Tensor, num_minibatches: int) -> tuple[torch.Tensor, ...]:
    """The shuffled indices ``(B,)`` of real transitions in ``num_minibatches`` near-equal parts
    (core #6), fewer when ``B < 2 * num_minibatches``: each holds at least 2 for core #7's std."""
    if len(inds) < 2:
        return ()
    num_parts = min(num_minibatches, len(inds) // 2)
    return torch.tensor_split(inds, num_parts)


# ----------------------------------------------------------------------------------------------
# Training: the loop of the paper's algorithm box
# ----------------------------------------------------------------------------------------------
def train(args: Args) -> dict:
    """Train PPO; returns ``{run_dir, global_step, sps, cpu_sps, episodes: [(step, return, length)],
    masked_steps, final_return_last10}``, also written to ``{run_dir}/summary.json``. Raises
    UsageError: bad input (before any vector env is made), a non-finite update (not applied)."""
    ckpt, run_dir, obs_dim, act_dim = open_run(args)  # flags, files and env checked, none made
    ckpt_path = run_dir / "checkpoint.pt"

    # TRY NOT TO MODIFY: seeding
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.num_threads or torch.get_num_threads())
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    # core #13: separate networks; core #3: Adam with eps 1e-5, fused (one kernel, same update)
    agent = Agent(obs_dim, act_dim).to(device)
    if ckpt is not None:
        load_networks(agent, ckpt, args.resume, flag="--resume", env_id=args.env_id)
    loss_fn = torch.compile(ppo_loss) if args.compile else ppo_loss
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
    video_dir = str(run_dir / "videos") if args.capture_video else None
    envs = make_envs(args, video_dir)  # core #1

    # ALGO Logic: storage setup, shape (num_steps, num_envs, ...). The rollout fills NumPy arrays
    # (a NumPy copy costs ~1 us, a torch one ~5 us); they become tensors once per rollout.
    rollout_shape = (args.num_steps, args.num_envs)
    obs = np.zeros((*rollout_shape, obs_dim), dtype=np.float32)
    actions = np.zeros((*rollout_shape, act_dim), dtype=np.float32)
    rewards = np.zeros(rollout_shape, dtype=np.float32)
    terminations = np.zeros(rollout_shape, dtype=np.float32)
    dones = np.zeros(rollout_shape, dtype=np.float32)
    valid = np.zeros(rollout_shape, dtype=np.float32)  # 0 at autoreset steps

    if ckpt is None:
        start_iteration = 1
        global_step = 0
        next_obs, _ = envs.reset(seed=args.seed)
    else:  # in-flight episodes restart from a seeded reset (see resume_from)
        start_iteration, global_step, next_obs = resume_from(ckpt, optimizer, envs, args)
    next_valid = np.ones(args.num_envs, dtype=np.float32)
    purge_step = None if ckpt is None else global_step + 1
    writer = make_writer(run_dir, args, purge_step=purge_step)
    episodes = []  # (global step, return, length) of each episode
    masked_steps = 0  # autoreset steps, left out of the updates
    start_time = time.time()
    start_cpu_time = time.process_time()
    start_step = global_step
    save_every = args.save_every or args.num_iterations  # 0: only at the end

    try:
        for iteration in range(start_iteration, args.num_iterations + 1):
            # core #4: linear learning-rate annealing
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / args.num_iterations
                lrnow = frac * args.learning_rate
                optimizer.param_groups[0]["lr"] = lrnow

            # ROLLOUT: a ~ N(mu(s), sigma) (cont. #1) sampled as mu(s) + sigma * noise, with mu from
            # a NumPy copy of the actor; values and log-probs come from one batched pass after it.
            noise = torch.randn((*rollout_shape, act_dim), device=device)
            action_std = agent.actor_logstd.detach().exp()
            scaled_noise = (action_std * noise).cpu().numpy()
            actor_mean = agent.numpy_actor_mean()
            for step in range(args.num_steps):
                global_step += args.num_envs
                obs[step] = next_obs
                valid[step] = next_valid
                action = actor_mean(next_obs) + scaled_noise[step]
                actions[step] = action  # stored unclipped; the env sees it clipped (cont. #5)
                next_obs, reward, terminated, truncated, infos = envs.step(action)
                rewards[step] = reward
                terminations[step] = terminated
                done = np.logical_or(terminated, truncated)
                dones[step] = done
                # gymnasium 1.x next-step autoreset: after an episode ends, the next step of that
                # env only resets it (action ignored, reward 0); it is stored, never trained on.
                next_valid = 1.0 - done
                for _, ep_return, ep_length in finished_episodes(infos):
                    episodes.append((global_step, ep_return, ep_length))
                    writer.add_scalar("charts/episodic_return", ep_return, global_step)
                    writer.add_scalar("charts/episodic_length", ep_length, global_step)

            # values and old log-probs of the whole rollout in one batched pass
            with torch.no_grad():
                b_obs = torch.from_numpy(obs).to(device).reshape(-1, obs_dim)
                b_actions = torch.from_numpy(actions).to(device).reshape(-1, act_dim)
                b_logprobs, _, b_values = agent.get_action_and_value(b_obs, b_actions)
                values = b_values.cpu().numpy().reshape(rollout_shape)
                last_obs = torch.from_numpy(next_obs).to(device)
                last_value = agent.critic(last_obs).cpu().numpy()  # (num_envs, 1)
            # V(s_{t+1}): the next stored observation is the one the step returned (the final one
            # when the episode ended, thanks to next-step autoreset); the last one is next_obs'.
            next_values = np.concatenate([values[1:], last_value.T])

            # GAE (core #5, Schulman et al. 2016 eq. 16). A time-limit truncation bootstraps from
            # V(final obs) unless --no-bootstrap-truncation, which treats it as a termination.
            terminal = terminations if args.bootstrap_truncation else dones
            advantages, returns = compute_gae(
                rewards,
                values,
                next_values,
                terminations=terminal,
                dones=dones,
                gamma=args.gamma,
                gae_lambda=args.gae_lambda,
            )

            # flatten the batch; keep only real transitions (autoreset steps masked out)
            b_advantages = torch.from_numpy(advantages).to(device).reshape(-1)
            b_returns = torch.from_numpy(returns).to(device).reshape(-1)
            valid_inds = np.flatnonzero(valid.reshape(-1))
            b_valid_inds = torch.as_tensor(valid_inds, device=device)
            masked_steps += args.batch_size - len(b_valid_inds)
            batch = (b_obs, b_actions, b_logprobs, b_advantages, b_returns, b_values)

            # UPDATE: epochs over shuffled minibatches of at least 2 transitions (core #6)
            clipfracs = []
            stats = {}
            for epoch in range(args.update_epochs):
                perm = b_valid_inds[torch.randperm(len(b_valid_inds), device=device)]
                for mb_inds in minibatches(perm, args.num_minibatches):
                    minibatch = [x[mb_inds] for x in batch]
                    loss, stats = loss_fn(
                        agent,
                        minibatch,
                        clip_coef=args.clip_coef,
                        vf_coef=args.vf_coef,
                        ent_coef=args.ent_coef,
                        norm_adv=args.norm_adv,
                        clip_vloss=args.clip_vloss,
                    )
                    clipfracs.append(stats["clipfrac"])
                    optimizer.zero_grad()
                    loss.backward()
                    # core #11: global gradient-norm clipping; nothing non-finite is applied
                    grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    check_finite(
                        loss, grad_norm, iteration=iteration, epoch=epoch, ckpt_path=ckpt_path
                    )
                    optimizer.step()
                if args.target_kl is not None and stats and stats["approx_kl"] > args.target_kl:
                    break

            # TRY NOT TO MODIFY: record rewards and debug variables for plotting purposes
            if stats:  # the last minibatch's, but clipfrac: the mean over all minibatches
                stats["clipfrac"] = torch.stack(clipfracs).mean()
            y_pred = b_values[b_valid_inds].cpu().numpy()
            y_true = b_returns[b_valid_inds].cpu().numpy()
            var_y = np.var(y_true)  # explained variance, NaN when the returns do not vary
            explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
            for name, stat in stats.items():
                writer.add_scalar(f"losses/{name}", stat.item(), global_step)
            writer.add_scalar("losses/explained_variance", float(explained_var), global_step)
            writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
            sps = int((global_step - start_step) / (time.time() - start_time))
            writer.add_scalar("charts/SPS", sps, global_step)
            last_return = episodes[-1][1] if episodes else ""
            print(f"step {global_step}: {sps} SPS, last return", last_return)

            if iteration % save_every == 0 or iteration == args.num_iterations:
                state = run_state(
                    agent, optimizer, envs, args, iteration=iteration, global_step=global_step
                )
                atomic_save(state, ckpt_path)
    finally:  # also on an error: the logs reach the disk
        envs.close()
        writer.close()

    # the summary (also for benchmarks/ppo_continuous_bench.py); speeds per wall and CPU second
    steps = global_step - start_step
    sps = steps / (time.time() - start_time)
    cpu_sps = steps / (time.process_time() - start_cpu_time)
    last_ep_returns = [ep_return for _, ep_return, _ in episodes[-10:]]
    final_return = float(np.mean(last_ep_returns)) if last_ep_returns else None
    summary = dict(run_dir=str(run_dir), global_step=global_step, sps=sps, cpu_sps=cpu_sps)
    summary["episodes"] = episodes
    summary["masked_steps"] = masked_steps
    summary["final_return_last10"] = final_return
    (run_dir / "summary.json").write_text(json.dumps(summary))
    print(f"{args.env_id}: {global_step} steps at {sps:.0f} SPS; checkpoint: {ckpt_path}")
    return summary


# ----------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: environment (gymnasium's vector-level wrappers) and evaluation
# ----------------------------------------------------------------------------------------------
class FastRunningMeanStd(gym.wrappers.utils.RunningMeanStd):
    """gymnasium's ``RunningMeanStd``, bit for bit, with a shortcut for a batch of one row (mean
    ``x[0]``, variance 0) that skips ~50 us of NumPy reductions per step with ``--num-envs 1``."""

    def update(self, x: np.ndarray) -> None:
        if x.shape[0] == 1:
            self.update_from_moments(x[0], np.zeros_like(self.var), 1)
        else:
            super().update(x)


def check_env_id(env_id: str) -> tuple[int, int]:
    """Make ``env_id`` once to read its spaces; returns ``(obs_dim, act_dim)``. Refuses an env that
    cannot be made (with the cause: gymnasium reports any failed MuJoCo import as "MuJoCo is not
    installed"), has no ``Box`` action space or no flat observation."""
    try:
        with gym.make(env_id) as env:
            obs_space = env.observation_space
            act_space = env.action_space
    except Exception as e:  # noqa: BLE001 - gym raises many error types; the user needs one line
        cause = e.__cause__
        why = f" ({type(cause).__name__}: {first_line(cause)})" if cause else ""
        raise UsageError(f"--env-id: cannot make {env_id!r}: {first_line(e)}{why}") from None
    box_actions = isinstance(act_space, gym.spaces.Box)
    flat_obs = isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) == 1
    got = f"{env_id} has {type(act_space).__name__} actions, {obs_space} observations"
    needs = "Box actions (use a discrete-action PPO for others) and flat Box observations"
    check(box_actions and flat_obs, f"--env-id: {got}; this script needs {needs}")
    obs_dim = int(obs_space.shape[0])
    act_dim = int(np.prod(act_space.shape))
    return obs_dim, act_dim


def make_envs(args: Args, video_dir: str | None = None) -> gym.vector.VectorEnv:
    """``args.num_envs`` envs of ``args.env_id`` with gymnasium's vector-level wrappers, inner to
    outer: RecordEpisodeStatistics (raw returns, core #12), clip the action the env sees (cont.
    #5), NormalizeObservation (cont. #6), clip it (cont. #7), NormalizeReward by the std of the
    discounted return (cont. #8), clip it (cont. #9); next-step autoreset. ``envs.normalizers``:
    the two normalisers; ``video_dir`` records env 0."""
    env_id = args.env_id
    obs_clip = args.obs_clip
    reward_clip = args.reward_clip

    def make_env():
        return gym.make(env_id)

    def make_recorded_env():
        env = gym.make(env_id, render_mode="rgb_array")
        return gym.wrappers.RecordVideo(env, video_dir)

    env_fns = [make_env] * args.num_envs
    if video_dir is not None:  # env 0 records; without a display, MuJoCo renders through EGL
        if sys.platform == "linux" and not os.getenv("DISPLAY"):
            os.environ.setdefault("MUJOCO_GL", "egl")
        env_fns[0] = make_recorded_env
    vec_cls = gym.vector.SyncVectorEnv if args.vector_mode == "sync" else gym.vector.AsyncVectorEnv
    # copy=False: NormalizeObservation below returns a fresh array every step anyway
    envs = vec_cls(env_fns, copy=False, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    envs = vector_wrappers.RecordEpisodeStatistics(envs)
    # cont. #5: what gymnasium's vector ClipAction does, without its per-env Python loop
    low = envs.single_action_space.low
    high = envs.single_action_space.high

    def clip_action(action):
        return np.clip(action, low, high)

    def clip_obs(obs):
        return np.clip(obs, -obs_clip, obs_clip)

    def clip_reward(reward):
        return np.clip(reward, -reward_clip, reward_clip)

    envs = vector_wrappers.TransformAction(envs, clip_action, envs.action_space)
    envs = vector_wrappers.NormalizeObservation(envs)
    obs_norm = envs
    obs_mean = envs.obs_rms.mean
    envs.obs_rms = FastRunningMeanStd(shape=obs_mean.shape, dtype=obs_mean.dtype)
    envs = vector_wrappers.TransformObservation(envs, clip_obs, envs.observation_space)
    envs = vector_wrappers.NormalizeReward(envs, gamma=args.gamma)
    ret_norm = envs
    envs.return_rms = FastRunningMeanStd(shape=())
    envs = vector_wrappers.TransformReward(envs, clip_reward)
    envs.normalizers = (obs_norm, ret_norm)
    return envs


def finished_episodes(infos: dict) -> list[tuple[int, float, int]]:
    """Every episode that ended on this step, as ``(env_index, return, length)``, from gymnasium
    1.x's ``infos["episode"]``/``infos["_episode"]`` (raw rewards), all when several envs finish."""
    if "_episode" not in infos:  # on most steps
        return []
    ended = np.flatnonzero(infos["_episode"])
    ep_returns = infos["episode"]["r"]
    ep_lengths = infos["episode"]["l"]
    return [(int(i), float(ep_returns[i]), int(ep_lengths[i])) for i in ended]


def get_norm_state(envs) -> dict:
    """Copies of the statistics: ``obs_mean``, ``obs_var`` ``(obs_dim,)``, ``obs_count`` (cont.
    #6); scalars ``ret_*`` of the discounted return whose std scales the rewards (cont. #8)."""
    obs_norm, ret_norm = envs.normalizers
    state = {}
    for key, rms in (("obs", obs_norm.obs_rms), ("ret", ret_norm.return_rms)):
        state[f"{key}_mean"] = np.array(rms.mean)
        state[f"{key}_var"] = np.array(rms.var)
        state[f"{key}_count"] = rms.count
    return state


def set_norm_state(envs, state: dict, update: bool = True) -> None:
    """Restore what :func:`get_norm_state` returned, bit for bit; ``update=False`` freezes both
    normalisers (gymnasium's ``update_running_mean``), as for evaluation."""
    for normalizer, key in zip(envs.normalizers, ("obs", "ret"), strict=True):
        rms = normalizer.obs_rms if key == "obs" else normalizer.return_rms
        rms.mean = np.array(state[f"{key}_mean"])
        rms.var = np.array(state[f"{key}_var"])
        rms.count = state[f"{key}_count"]
        normalizer.update_running_mean = update


def evaluate(args: Args) -> list[float]:
    """Run ``--eval-episodes`` episodes of the checkpoint's mean action with frozen normalisation
    statistics; prints and returns the raw episodic returns."""
    path = args.eval_checkpoint
    ckpt = load_checkpoint(path, "--eval-checkpoint")
    saved = Args(**ckpt["args"])  # the flags of the run that wrote it (its env, discount, clips)
    obs_dim, act_dim = check_env_id(saved.env_id)
    agent = Agent(obs_dim, act_dim)  # on the CPU: one row per step
    load_networks(agent, ckpt, path, flag="--eval-checkpoint", env_id=saved.env_id)
    video_dir = str(Path(path).parent / "videos_eval") if args.capture_video else None
    env_args = dataclasses.replace(saved, num_envs=1, vector_mode="sync")
    envs = make_envs(env_args, video_dir)
    set_norm_state(envs, ckpt["norm"], update=False)
    ep_returns = []
    next_obs, _ = envs.reset(seed=args.seed)
    with torch.inference_mode():
        while len(ep_returns) < args.eval_episodes:
            action = agent.actor_mean(torch.as_tensor(next_obs))  # the mean action
            next_obs, _, _, _, infos = envs.step(action.numpy())
            ep_returns += [ep_return for _, ep_return, _ in finished_episodes(infos)]
    envs.close()
    mean = np.mean(ep_returns)
    std = np.std(ep_returns)
    print(f"eval {saved.env_id}: {len(ep_returns)} episodes, return {mean:.1f} +- {std:.1f}")
    return ep_returns


# ----------------------------------------------------------------------------------------------
# TRY NOT TO MODIFY: run plumbing (flags, one-line errors, checkpoints and resume, logs)
# ----------------------------------------------------------------------------------------------
SCRIPT = "ppo_continuous.py"  # written into checkpoints ("script") and checked when reading one


class UsageError(Exception):
    """Bad input, or a diverged run: one ``error: ...`` line and exit code 2, never a traceback."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def main(args: Args | None = None):
    """Check the flags (parsed from the command line without ``args``), then evaluate or train."""
    if args is None:
        args = parse_args()
    args = validate(args)
    if args.eval_checkpoint is not None:
        return evaluate(args)
    return train(args)


def cli(argv: list[str] | None = None) -> None:
    """:func:`main` on ``argv``; a UsageError, or a dependency gymnasium misses (moviepy for
    --capture-video), ends with one ``error: ...`` line on stderr and exit code 2."""
    try:
        main(parse_args(argv))
    except (UsageError, gym.error.DependencyNotInstalled) as e:  # e.g. no moviepy for videos
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None = None, default: Args | None = None) -> Args:
    """tyro's parse of ``argv`` (default ``sys.argv[1:]``); with ``--resume PATH`` the run's saved
    flags are the defaults, so a flag given again overrides its saved value. tyro's error box
    (stderr, exit 2) becomes a UsageError: its first paragraph, in one line."""
    box = io.StringIO()
    try:
        with contextlib.redirect_stderr(box):
            args = tyro.cli(Args, args=argv, default=default)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            raise
        rows = box.getvalue().splitlines()[1:]  # 0: the title
        text = "\n".join(row.strip(" │|") for row in rows)
        paragraphs = re.split(r"^[─-]*$", text, flags=re.M)
        paragraph = next((p for p in paragraphs if p.strip()), "?")
        one_line = " ".join(paragraph.split())
        message = re.sub(r"^Error parsing (--[\w-]+):", r"\1:", one_line)
        raise UsageError(message) from None
    if args.resume is not None and default is None:  # again, with the run's flags as defaults
        saved = load_checkpoint(args.resume, "--resume")["args"]
        return parse_args(argv, Args(**saved))
    return args


def flag_error(flags: dict) -> str | None:
    """None when ``flags`` (as ``dataclasses.asdict`` or a checkpoint holds them) fit ``Args``:
    each constraint beside its field, finite floats, exact types ("0.99" is no float), no unknown
    name; else the first error in one line, e.g. ``"--gamma: must be ..., got 1.5"``."""
    try:  # through JSON: pydantic's strict mode takes a dict for a dataclass only there
        pydantic.TypeAdapter(Args).validate_json(json.dumps(flags, default=str), strict=True)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        message = re.sub(r"^\w+ should", "must", err["msg"])  # "Input should be ..."
        flag = str(err["loc"][0]).replace("_", "-")
        return f"--{flag}: {message}, got {err['input']!r}"


def validate(args: Args) -> Args:
    """Check each flag (:func:`flag_error`), then the rules between flags, and fill in the derived
    sizes; returns ``args``. Reads no file, makes no env. Raises UsageError naming the flag."""
    error = flag_error(dataclasses.asdict(args))
    check(error is None, str(error))
    check(None in (args.resume, args.eval_checkpoint), "--eval-checkpoint: not with --resume")
    args.batch_size = args.num_envs * args.num_steps
    args.minibatch_size = args.batch_size // args.num_minibatches
    args.num_iterations = args.total_timesteps // args.batch_size
    batch = f"num_envs * num_steps = {args.batch_size}"
    check(args.batch_size % args.num_minibatches == 0, f"--num-minibatches: must divide {batch}")
    at_least_2 = f"--num-minibatches: each minibatch needs at least 2 of {batch}"
    check(args.minibatch_size >= 2, at_least_2)
    if args.eval_checkpoint is None:
        check(args.num_iterations > 0, f"--total-timesteps: must be at least one rollout, {batch}")
        gib = 1200 * args.batch_size / 2**30  # a rollout takes at least ~300 float32 per step
        if os.name == "posix":
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
            size = f"a rollout of {args.batch_size:,} steps needs ~{gib:,.1f} GiB of memory"
            check(gib <= ram, f"--num-steps/--num-envs: {size}, this machine has {ram:.1f} GiB")
    return args


def open_run(args: Args) -> tuple[dict | None, Path, int, int]:
    """All that a run checks before any env is made; returns ``(checkpoint, run directory, obs_dim,
    act_dim)``. A new run: CleanRL's ``{runs_dir}/{env}__{exp_name}__{seed}__{unix time}``, refused
    when it holds a checkpoint. ``--resume``: its checkpoint and directory, refused when a flag
    fixing the networks, statistics, steps or place changed, or no steps are left to train."""
    if args.resume is None:
        check_writable(Path(args.runs_dir), "--runs-dir")
        env_name = Path(args.env_id).stem
        run_name = f"{env_name}__{args.exp_name}__{args.seed}__{int(time.time())}"
        ckpt = None
        run_dir = Path(args.runs_dir) / run_name
        again = "resume it with --resume, or pick another --exp-name"
        check(not (run_dir / "checkpoint.pt").exists(), f"{run_dir} holds a checkpoint: {again}")
    else:
        ckpt = load_checkpoint(args.resume)
        run_dir = Path(args.resume).resolve().parent
        for field in ("env_id", "num_envs", "num_steps", "runs_dir"):
            given = getattr(args, field)
            saved = ckpt["args"].get(field, given)
            started = f"cannot change when resuming (this run was started with {saved!r})"
            flag = "--" + field.replace("_", "-")
            check(saved == given, f"{flag}: {started}")
        done = f"this run already reached step {ckpt['global_step']}; pass more to train further"
        check(args.num_iterations > ckpt["iteration"], f"--total-timesteps: {done}")
        check_writable(run_dir, "--resume")
    obs_dim, act_dim = check_env_id(args.env_id)
    return ckpt, run_dir, obs_dim, act_dim


def check_writable(path: Path, flag: str) -> None:
    """Fail now, not at the first save, when ``path`` (or, while it does not exist, its nearest
    existing parent) cannot take a file; leaves nothing behind."""
    probe = next(p for p in [path, *path.parents] if p.exists())
    try:
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as e:
        why = e.strerror or e
        raise UsageError(f"{flag}: cannot write in {path} ({probe}: {why})") from None


def load_checkpoint(path: str | Path, flag: str = "--resume") -> dict:
    """The checkpoint at ``path`` on the CPU, after checking that this script wrote it, that its
    flags fit ``Args`` (:func:`flag_error`) and that it holds every entry, all finite."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise UsageError(f"{flag}: cannot read checkpoint {path}: {first_line(e)}") from None
    where = f"{flag}: {path}"
    saved = ckpt.get("args") if isinstance(ckpt, dict) else None
    check(isinstance(saved, dict), f"{where} holds no flags; it is not a {SCRIPT} checkpoint")
    script = ckpt.get("script", SCRIPT)
    check(script == SCRIPT, f"{where} was written by {script}")
    error = flag_error(saved)
    check(error is None, f"{where} is not a {SCRIPT} checkpoint of this version ({error})")
    needed = {"agent", "optimizer", "iteration", "global_step", "rng", "norm", "running_return"}
    missing = ", ".join(sorted(needed - set(ckpt)))
    check(not missing, f"{where} holds no {missing}; it is not complete")
    bad = first_non_finite(ckpt)
    check(bad is None, f"{where} holds non-finite values in {bad}; it is from a run that diverged")
    return ckpt


def load_networks(agent: Agent, ckpt: dict, path: str, *, flag: str, env_id: str) -> None:
    """Load the checkpoint's networks into ``agent``, before any vector env is made."""
    try:
        agent.load_state_dict(ckpt["agent"])
    except (RuntimeError, TypeError):  # missing, unexpected or mis-shaped tensors
        raise UsageError(f"{flag}: the networks in {path} do not fit {env_id}") from None


def first_non_finite(obj, path: str = "") -> str | None:
    """The key path (e.g. ``"agent.actor_logstd"``) of the first float tensor or array in nested
    dicts, lists and tuples that holds a NaN or an inf; None when all are finite."""
    if isinstance(obj, dict | list | tuple):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            key_path = f"{path}.{key}" if path else str(key)
            found = first_non_finite(value, key_path)
            if found is not None:
                return found
        return None
    numpy = isinstance(obj, np.ndarray | np.floating)
    if numpy and obj.dtype.kind == "f":
        obj = torch.from_numpy(np.asarray(obj))
    floats = isinstance(obj, torch.Tensor) and obj.is_floating_point()
    return path if floats and not torch.isfinite(obj).all() else None


def check_finite(loss, grad_norm, *, iteration: int, epoch: int, ckpt_path: Path) -> None:
    """Stop the run (one sync) before an optimizer step applies a NaN or an inf; non-finite
    weights, which finite steps can still reach, are refused by :func:`atomic_save`."""
    if not torch.isfinite(loss.detach() + grad_norm):
        where = f"at iteration {iteration}, epoch {epoch + 1} (the update was not applied)"
        kept = f"{ckpt_path} is intact" if ckpt_path.is_file() else "no checkpoint was written yet"
        raise UsageError(f"non-finite loss or gradient norm {where}; check --learning-rate; {kept}")


def atomic_save(obj: dict, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then ``os.replace`` (atomic): a
    kill at any moment leaves the previous checkpoint whole. Raises UsageError, writing nothing,
    when ``obj`` holds a NaN or an inf or the file cannot be written (disk full, read-only)."""
    kept = "the previous checkpoint there is intact" if path.is_file() else "none was written yet"
    bad = first_non_finite(obj)
    check(bad is None, f"not saving {path}: {bad} holds non-finite values (NaN or inf); {kept}")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        tmp.unlink(missing_ok=True)
        why = first_line(e)
        if isinstance(e, OSError) and e.strerror:
            why = e.strerror
        raise UsageError(f"cannot write checkpoint {path}: {why}; {kept}") from None


def run_state(agent, optimizer, envs, args: Args, *, iteration: int, global_step: int) -> dict:
    """Everything a resumed run or an evaluation needs: networks, optimizer, counters, the NumPy,
    torch and CUDA RNGs, the normalisation statistics, the reward scaler's running return per env,
    the flags."""
    rng = dict(numpy=np.random.get_state(), torch=torch.get_rng_state())
    rng["cuda"] = torch.cuda.get_rng_state_all()  # [] without CUDA
    state = dict(agent=agent.state_dict(), optimizer=optimizer.state_dict(), rng=rng, script=SCRIPT)
    state["iteration"] = iteration
    state["global_step"] = global_step
    state["norm"] = get_norm_state(envs)
    state["running_return"] = np.array(envs.normalizers[1].accumulated_reward)
    state["args"] = dataclasses.asdict(args)
    return state


def resume_from(ckpt: dict, optimizer, envs, args: Args):
    """Continue a checked checkpoint's run (networks already loaded); returns ``(first iteration,
    global step, first observation)``. Learning rate: the flag's; RNGs restored last. The one
    limit: the simulator state is not saved, so the envs restart from a reset seeded with ``--seed
    + global step`` (statistics frozen: the killed run counted the autoreset step's observation).
    An episode in flight is dropped (trained on, its return never logged) and MuJoCo's first
    episodes start elsewhere. With no episode in flight and deterministic resets, the resumed run
    equals the uninterrupted one bit for bit (tested)."""
    optimizer.load_state_dict(ckpt["optimizer"])
    optimizer.param_groups[0]["lr"] = args.learning_rate  # the flag's, also with --no-anneal-lr
    set_norm_state(envs, ckpt["norm"], update=False)  # the reset must not move the statistics
    next_obs, _ = envs.reset(seed=args.seed + ckpt["global_step"])
    set_norm_state(envs, ckpt["norm"])
    envs.normalizers[1].accumulated_reward[:] = ckpt["running_return"]
    rng = ckpt["rng"]
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    torch.cuda.set_rng_state_all(rng.get("cuda", []))  # none without CUDA
    return ckpt["iteration"] + 1, ckpt["global_step"], next_obs


def make_writer(run_dir: Path, args: Args, purge_step: int | None) -> SummaryWriter:
    """A TensorBoard writer in ``run_dir``, and the flags in ``args.json`` beside it.
    ``purge_step`` (a resumed run's first step) drops what the killed run logged from it on;
    TensorBoard purges only what it read first, reading files in name order
    (``events.out.tfevents.<second>...``), so the new file is made in a later second."""
    event_files = run_dir.glob("events.out.tfevents.*")
    seconds = [int(f.name.split(".")[3]) for f in event_files]
    if purge_step is not None and seconds:
        while int(time.time()) <= max(seconds):
            time.sleep(0.05)
    writer = SummaryWriter(str(run_dir), purge_step=purge_step)
    (run_dir / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
    return writer


if __name__ == "__main__":
    cli()
