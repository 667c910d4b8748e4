"""opd_patches reaches a process through VERL_USE_EXTERNAL_MODULES, idempotently, and only for the pinned VERL;
a plain `import opd_patches` registers nothing and imports no VERL (the evaluation, data and statistics
commands start without VERL's import cost).

Each check reads a fresh interpreter (tests/fresh_verl.py): registration is a side effect of import, so an
in-process test would only see whatever an earlier test imported.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fresh_verl import REGISTRATION, facts

def probe(code, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_PLATFORM")}
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)
    return out


@pytest.mark.fresh_process
def test_registered_in_a_fresh_process_through_the_env_var():
    assert facts("registered")["registration"] == dict.fromkeys(REGISTRATION, True)


@pytest.mark.fresh_process
def test_nothing_registered_without_the_env_var():
    """Neither VERL (registration must not depend on the silent `verl.plugins` entry point: there is none)
    nor a plain `import opd_patches` registers anything."""
    registration = facts("none")["registration"]
    assert set(registration) == set(REGISTRATION) and not any(registration.values())


@pytest.mark.fresh_process
def test_register_is_idempotent():
    """register() twice more after the env var's import: nothing raises, everything stays registered."""
    assert facts("registered")["registration_again"] == dict.fromkeys(REGISTRATION, True)


def test_wrong_verl_version_fails_with_a_clear_message():
    code = textwrap.dedent(
        """
        import importlib.metadata as md
        real = md.version
        md.version = lambda name: "0.8.0" if name == "verl" else real(name)
        import opd_patches.registered
        """
    )
    out = probe(code)
    assert out.returncode != 0
    assert "pinned to verl==0.9.1 but verl==0.8.0 is installed" in out.stderr
    assert "make install" in out.stderr


def test_importing_the_package_is_cheap():
    """No VERL (nor torch) until something asks for registration; the commands that need neither start fast."""
    code = ("import sys, opd_patches, opd_patches.eval.__main__, opd_patches.data.__main__, opd_patches.eval.stats\n"
            "print(json.dumps({m: m in sys.modules for m in ('verl', 'torch', 'ray')}))")
    out = probe("import json\n" + code, VERL_USE_EXTERNAL_MODULES="opd_patches.registered")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"verl": False, "torch": False, "ray": False}
