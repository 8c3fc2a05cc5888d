"""One learner, several actors: policy-gradient training on gymnasium's CartPole through paramshard.

Start a fleet, then the whole run (a learner process and ``--actors`` actor processes):

    paramshard up --shards 2 --base-port 7100                # in one terminal
    export PARAMSHARD_SHARDS=http://127.0.0.1:7100,http://127.0.0.1:7101
    python examples/cartpole_actors.py run --actors 4

or each process by hand (``learner --actors 4``, then ``actor --actor-index i`` for i in 0..3).

The roles, as in A3C-style and "learner with actors" setups:

* an **actor** plays CartPole-v1 episodes with the newest policy it has, sends what it saw
  (observations, actions, returns-to-go) to the fleet as its experience variable
  (``ps.assign``), then blocks in ``ps.pull([published, stop], newer_than="cached")`` until the
  learner has published a newer policy, and pulls it: only the variables that changed travel,
  and a waiting actor costs the shards nothing;
* the **learner** blocks in ``ps.pull(experience, newer_than="cached")`` until the actors sent
  their batches (one from each, or what came within ``--wait`` seconds of the first), computes
  the REINFORCE gradient (normalised discounted returns as the advantage), takes an Adam step
  in numpy, pushes the change (the variables use the ``Add`` optimizer: the learner runs its
  own) and, once the push is on every shard, bumps ``cartpole/published``. It stops after
  ``--updates`` updates, or once the mean return of the last 20 episodes reaches
  ``--target``, and bumps ``cartpole/stop``,
  which wakes the actors (it is among the names they wait on) so they exit. Run again
  against the same fleet, it starts over from fresh weights.

The policy is a small network (4 observations -> 16 tanh units -> 2 action scores, softmax), in
plain numpy. A random policy's episodes last ~22 steps (the return is the number of steps the
pole stays up); CartPole-v1 caps an episode at 500.

Each line the learner prints is one update: ``update 12  episodes 240  return 87.3`` (the mean
return of the last 20 episodes); the last is ``final mean return <x> after <n> episodes``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

from client_sdk import PSClient
from client_sdk.optimizers import Add

#: Observation size and number of actions of CartPole-v1; hidden units of the policy.
N_OBS, N_ACTIONS, N_HIDDEN = 4, 2, 16
POLICY = ("cartpole/w1", "cartpole/b1", "cartpole/w2")
#: Bumped by the learner once each new policy is on every shard, and when it is done; the
#: actors wait on both. (A push to several shards lands on each at its own moment: a wait on
#: the policy variables themselves could wake with some of them new and others not yet.)
PUBLISHED = "cartpole/published"
STOP = "cartpole/stop"
#: An actor's experience batch: a header row, then one row per step.
STEPS_PER_BATCH = 400
ROWS = 1 + STEPS_PER_BATCH + 500  # the last episode of a batch may run to CartPole's 500 steps
COLUMNS = 6  # a step: observation (4), action, return-to-go; the header: the number of steps
WINDOW = 20  # episodes in the reported mean return
GAMMA = 0.99  # the discount of the returns the policy gradient weighs actions with


def experience_name(actor: int) -> str:
    return f"cartpole/experience/{actor}"


def init_policy(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "cartpole/w1": rng.normal(0.0, 0.5, (N_OBS, N_HIDDEN)).astype(np.float32),
        "cartpole/b1": np.zeros(N_HIDDEN, np.float32),
        "cartpole/w2": np.zeros((N_HIDDEN, N_ACTIONS), np.float32),
    }


def action_probs(policy: dict[str, np.ndarray], obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The hidden layer and the action probabilities for a batch of observations."""
    hidden = np.tanh(obs @ policy["cartpole/w1"] + policy["cartpole/b1"])
    scores = hidden @ policy["cartpole/w2"]
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    return hidden, probs / probs.sum(axis=-1, keepdims=True)


def policy_gradient(
    policy: dict[str, np.ndarray], obs: np.ndarray, actions: np.ndarray, advantages: np.ndarray
) -> dict[str, np.ndarray]:
    """The gradient of ``-mean(advantage * log pi(action | obs))`` for every policy variable."""
    hidden, probs = action_probs(policy, obs)
    d_scores = probs
    d_scores[np.arange(len(actions)), actions] -= 1.0
    d_scores *= advantages[:, None] / len(actions)
    d_hidden = (d_scores @ policy["cartpole/w2"].T) * (1.0 - hidden * hidden)
    return {
        "cartpole/w1": obs.T @ d_hidden,
        "cartpole/b1": d_hidden.sum(axis=0),
        "cartpole/w2": hidden.T @ d_scores,
    }


class Adam:
    """Adam (Kingma & Ba) in numpy, for the learner: ``step(grads)`` returns the change."""

    def __init__(self, lr: float, beta1: float = 0.9, beta2: float = 0.999) -> None:
        self.lr, self.beta1, self.beta2, self.t = lr, beta1, beta2, 0
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    def step(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.t += 1
        out = {}
        for name, g in grads.items():
            m = self.m[name] = self.beta1 * self.m.get(name, 0.0) + (1 - self.beta1) * g
            v = self.v[name] = self.beta2 * self.v.get(name, 0.0) + (1 - self.beta2) * g * g
            m_hat, v_hat = m / (1 - self.beta1**self.t), v / (1 - self.beta2**self.t)
            out[name] = (-self.lr * m_hat / (np.sqrt(v_hat) + 1e-8)).astype(np.float32)
        return out


# -- actor -------------------------------------------------------------------------------------


def play(env, policy: dict[str, np.ndarray], rng: np.random.Generator, seed: int) -> np.ndarray:
    """Episodes with ``policy`` until at least :data:`STEPS_PER_BATCH` steps: the experience
    batch, a ``(ROWS, COLUMNS)`` float32 array (header row, then one row per step)."""
    batch = np.zeros((ROWS, COLUMNS), np.float32)
    row, episodes = 1, 0
    while row - 1 < STEPS_PER_BATCH:
        obs, _ = env.reset(seed=seed + episodes)
        start, done = row, False
        while not done:
            p_right = action_probs(policy, obs[None])[1][0, 1]
            action = int(rng.random() < p_right)
            batch[row, :N_OBS], batch[row, N_OBS] = obs, action
            row += 1
            obs, _, terminated, truncated, _ = env.step(action)
            done = terminated or truncated
        steps = row - start
        batch[start:row, N_OBS + 1] = np.arange(steps, 0, -1)  # reward 1 per step, no discount
        episodes += 1
    batch[0, 0] = row - 1
    return batch


def actor(ps: PSClient, index: int, seed: int, wait: float) -> None:
    import gymnasium as gym  # only actors need the environment

    signals = [PUBLISHED, STOP]
    ps.wait_ready([*POLICY, *signals], timeout=60)
    mine = experience_name(index)
    ps.init({mine: np.zeros((ROWS, COLUMNS), np.float32)}, optimizer=Add())
    env = gym.make("CartPole-v1")
    rng = np.random.default_rng([seed, index])
    held = dict(ps.pull(signals))
    stop = held[STOP].item()  # the learner bumps it when it is done
    policy = ps.pull(list(POLICY))
    batches = 0
    while held[STOP] == stop:
        batch = play(env, policy, rng, seed=(seed * 1000 + index) * 100_000 + batches * 100)
        ps.assign({mine: batch})
        batches += 1
        # Block until the learner published a newer policy (or said stop). At the timeout
        # nothing changed: wait again.
        news = ps.pull(signals, newer_than="cached", timeout=wait)
        held.update(news)
        if PUBLISHED in news:
            policy = ps.pull(list(POLICY))  # only the variables that changed travel
    env.close()


# -- learner -----------------------------------------------------------------------------------


def collect(ps: PSClient, inbox: list[str], wait: float) -> list[np.ndarray]:
    """One new batch from every actor, or what came within ``wait`` seconds of the first."""
    fresh: dict[str, np.ndarray] = {}
    deadline = None
    while len(fresh) < len(inbox):
        left = wait if deadline is None else max(0.0, deadline - time.monotonic())
        # Blocks until any actor's experience variable has a version this client has not
        # pulled: only the new batches travel.
        arrived = ps.pull(inbox, newer_than="cached", timeout=left)
        fresh.update((name, b) for name, b in arrived.items() if b[0, 0] > 0)
        if not arrived and (deadline is None or time.monotonic() >= deadline):
            break
        if fresh and deadline is None:
            deadline = time.monotonic() + wait
    return list(fresh.values())


def learner(
    ps: PSClient, actors: int, updates: int, target: float, lr: float, seed: int, wait: float
) -> float:
    """Train until ``updates`` updates or a mean return of ``target``; return the final mean."""
    policy = init_policy(seed)
    if not all(r["created"] for r in ps.init(policy, optimizer=Add()).values()):
        ps.assign(policy)  # a fleet that ran this before: start over
    ps.init({STOP: np.zeros((), np.int64), PUBLISHED: np.zeros((), np.int64)})
    inbox = [experience_name(i) for i in range(actors)]
    ps.wait_ready(inbox, timeout=120)
    adam = Adam(lr)
    returns: list[float] = []
    ps.pull(inbox)  # what the actors' variables hold now is not news
    update = 0
    started = time.monotonic()
    idle = 0
    while update < updates:
        batches = collect(ps, inbox, wait)
        if not batches:
            idle += 1
            if idle == 3:
                raise SystemExit(f"no actor sent experience for {3 * wait:.0f} s: are they up?")
            continue
        idle = 0
        steps = np.concatenate([b[1 : 1 + int(b[0, 0])] for b in batches])
        to_go = steps[:, N_OBS + 1].astype(np.float64)
        # An episode's return is its first step's return-to-go; the step after a 1 starts one.
        returns += to_go[np.r_[0, np.flatnonzero(to_go[:-1] == 1) + 1]].tolist()
        advantages = (1.0 - GAMMA**to_go) / (1.0 - GAMMA)  # the discounted return-to-go
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        policy = ps.pull(list(POLICY))
        grads = policy_gradient(
            {k: v.astype(np.float64) for k, v in policy.items()},
            steps[:, :N_OBS].astype(np.float64),
            steps[:, N_OBS].astype(np.int64),
            advantages,
        )
        ps.push(adam.step(grads))  # returns once every shard applied it
        ps.increment(PUBLISHED)  # wakes the actors
        update += 1
        mean = float(np.mean(returns[-WINDOW:]))
        print(
            f"update {update}  episodes {len(returns)}  return {mean:.1f}  "
            f"({time.monotonic() - started:.1f} s)",
            flush=True,
        )
        if mean >= target:
            break
    ps.increment(STOP)
    final = float(np.mean(returns[-WINDOW:])) if returns else 0.0
    print(f"final mean return {final:.1f} after {len(returns)} episodes", flush=True)
    return final


# -- command line ------------------------------------------------------------------------------


def _env(name: str, default: str) -> str:
    return os.environ.get(f"CARTPOLE_{name.upper()}", default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["run", "learner", "actor"])
    parser.add_argument("--shards", default=None, help="shard URLs (default: PARAMSHARD_SHARDS)")
    parser.add_argument("--actors", type=int, default=int(_env("actors", "4")))
    parser.add_argument("--actor-index", type=int, default=int(_env("actor_index", "0")))
    parser.add_argument("--updates", type=int, default=int(_env("updates", "200")))
    parser.add_argument("--target", type=float, default=float(_env("target", "475")))
    parser.add_argument("--lr", type=float, default=float(_env("lr", "0.02")))
    parser.add_argument("--seed", type=int, default=int(_env("seed", "0")))
    parser.add_argument(
        "--wait",
        type=float,
        default=float(_env("wait", "30")),
        help="seconds one blocking pull waits before it asks again",
    )
    args = parser.parse_args(argv)
    if args.actors < 1:
        parser.error("--actors must be at least 1")
    return args


def run(args: argparse.Namespace) -> int:
    """Start the learner and ``--actors`` actors as processes; return the learner's status."""
    me = [sys.executable, os.path.abspath(__file__)]
    common = ["--actors", str(args.actors), "--seed", str(args.seed), "--wait", str(args.wait)]
    if args.shards:
        common += ["--shards", args.shards]
    learner_proc = subprocess.Popen(
        [
            *me,
            "learner",
            *common,
            "--updates",
            str(args.updates),
            "--target",
            str(args.target),
            "--lr",
            str(args.lr),
        ]
    )
    actors = [
        subprocess.Popen([*me, "actor", *common, "--actor-index", str(i)])
        for i in range(args.actors)
    ]
    status = learner_proc.wait()
    for proc in actors:
        try:
            proc.wait(timeout=2 * args.wait + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = status or 1
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "run":
        return run(args)
    worker_id = "learner" if args.role == "learner" else f"actor-{args.actor_index}"
    with PSClient(args.shards, worker_id=worker_id) as ps:
        if args.role == "learner":
            learner(ps, args.actors, args.updates, args.target, args.lr, args.seed, args.wait)
        else:
            actor(ps, args.actor_index, args.seed, args.wait)
    return 0


if __name__ == "__main__":
    sys.exit(main())
