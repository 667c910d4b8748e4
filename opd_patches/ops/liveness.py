"""Fail instead of hanging when a rollout-side Ray actor dies during a step.

Upstream's sync trainer hands a step's prompts to the agent-loop workers and then waits in
`ReplayBuffer.sample` until TransferQueue holds the step's finished samples, polling without a deadline.
If an actor on the rollout side dies meanwhile (Ray's memory monitor kills a worker when the host runs out
of memory; an engine crashes), those samples never arrive and the trainer waits for ever without a word
(docs/training.md).

`install()` wraps the replay buffer's poll (`_wait_for_next_poll`, called between looks at TransferQueue;
tests/test_liveness.py guards it) so that every `opd.liveness_check_s` seconds of waiting it asks Ray
whether the rollout servers, agent-loop workers and reward workers are still alive, and raises
`RolloutActorDied`, naming them, when one is dead. The trainer then exits non-zero; the newest complete
state is what `trainer.resume_mode=auto` resumes from.
"""

import time
from typing import Any, Callable

from opd_patches.patches import replay_wait_for_next_poll


class RolloutActorDied(RuntimeError):
    """A rollout-side actor died: the samples the trainer waits for will never arrive."""


def rollout_actors(trainer) -> dict[str, Any]:
    """name -> Ray actor handle of every actor a step's samples pass through (those that exist)."""
    actors = {}
    servers = getattr(getattr(trainer, "llm_server_manager", None), "server_handles", None) or []
    for i, handle in enumerate(servers):
        actors[f"rollout server {i}"] = handle
    workers = getattr(getattr(trainer, "agent_loop_manager", None), "agent_loop_workers", None) or []
    for i, handle in enumerate(workers):
        actors[f"agent-loop worker {i}"] = handle
    rewards = getattr(getattr(trainer, "reward_loop_manager", None), "reward_loop_workers", None) or []
    for i, handle in enumerate(rewards):
        actors[f"reward worker {i}"] = handle
    return actors


def dead(actors: dict[str, Any], timeout_s: float = 10.0) -> list[str]:
    """Names of the actors Ray reports dead. One that is alive but too busy to answer within `timeout_s`
    (a synchronous server inside a long generate) counts as alive: only a death is an answer."""
    import ray
    from ray.exceptions import ActorDiedError

    if not actors:
        return []
    refs = {name: handle.__ray_ready__.remote() for name, handle in actors.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    ready = set(ready)
    out = []
    for name, ref in refs.items():
        if ref in ready:
            try:
                ray.get(ref)
            except ActorDiedError:
                out.append(name)
    return out


def install(replay_buffer, actors: Callable[[], dict[str, Any]], every_s: float) -> None:
    """Check `actors()` every `every_s` seconds spent waiting in `replay_buffer`'s poll loop (the run-time patch
    opd_patches/patches/replay_wait_for_next_poll.py)."""
    due = [time.monotonic() + every_s]

    def check():
        if time.monotonic() >= due[0]:
            names = dead(actors())
            if names:
                raise RolloutActorDied(
                    f"[opd] {', '.join(names)} died while the trainer waited for this step's samples "
                    "(they will never arrive). Ray's log above says why (e.g. 'killed due to memory pressure': "
                    "the host ran out of memory; give the run more memory or run less beside it). "
                    "The run stops here; rerun with trainer.resume_mode=auto to resume from its newest "
                    "complete state.")
            due[0] = time.monotonic() + every_s

    replay_wait_for_next_poll.apply(replay_buffer, check)
