"""The bench-only agent loop of length profiles (lengths.py): upstream's single-turn loop, each request's
length set by the profile. Named in the file `lengths.write_config` writes for upstream's
`actor_rollout_ref.rollout.agent.agent_loop_config_path`; nothing registers it otherwise."""

import json
import os

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from opd_patches.hooks import lengths


class LengthProfileAgentLoop(SingleTurnAgentLoop):
    """Upstream's single-turn loop with each request's length set by a profile (BENCH ONLY).

    `log`: a JSONL file that gets one line per request ({step, key, profile, tokens}): the bench's
    record of what it asked for, which tests compare with VERL's own response-length metrics."""

    # `name`: upstream instantiates the file's entry with every key it has, its name included (unused here)
    def __init__(self, *args, spec: str = "cap", seed: int = 0, log: str | None = None, name: str | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.schedule, self.seed, self.log = lengths.schedule(spec), int(seed), log

    async def run(self, sampling_params: dict, priority: int = 0, **kwargs):
        step = int(kwargs.get("global_steps", 0) or 0)
        key = json.dumps([str(kwargs.get("raw_prompt")), str(kwargs.get("index")), int(kwargs.get("session_id", 0))])
        name = lengths.profile_at(self.schedule, step)
        tokens = lengths.draw(name, int(self.response_length), self.seed, step, key)
        if self.log:
            with open(self.log, "a") as f:  # one short line per request: appends from several workers stay whole
                f.write(json.dumps({"step": step, "key": key, "profile": name, "tokens": tokens, "pid": os.getpid()}) + "\n")
        params = {**sampling_params, "max_tokens": tokens, "ignore_eos": True}
        return await super().run(params, priority=priority, **kwargs)
