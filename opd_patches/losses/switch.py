"""On/off switches that a recipe key exports to every Ray worker as an environment variable."""

import os

TRUE, FALSE = ("1", "true", "True"), ("0", "false", "False")


def env_switch(env: str, default: bool, key: str) -> bool:
    """The value of `env` (1/0, true/false); `default` when unset or empty. `key` names the recipe key in errors."""
    value = os.environ.get(env)
    if value is None or value == "":
        return default
    if value not in TRUE + FALSE:
        raise ValueError(f"{env}={value!r}: use 1 or 0 (set by the recipe key {key}).")
    return value in TRUE
