"""Guards for the run-time patches of opd_patches/patches/ (one file per patch, applied through its registry).

Two kinds of guard:
- per declaration: every upstream symbol a patch changes (`CHANGES`) or relies on (`RELIES_ON`) still exists
  with the parameters and the source the patch was written against;
- no patch outside the registry: in a fresh process, every change registration makes to upstream's modules
  is a registry record (or a public registration hook), every record is declared by its file, and no
  module of opd_patches outside opd_patches/patches/ writes into upstream objects itself.
If one of these fails after a VERL or torch upgrade, the patched upstream code moved or changed: re-read it,
then adapt or delete the patch. Do not loosen the assertions.
"""

import ast
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from verl.workers.config import RolloutConfig
from verl.workers.config.distillation import DistillationTeacherModelConfig
from verl.workers.rollout import base as rollout_base

import opd_patches
from opd_patches import config, patches
from opd_patches.patches import registry
from opd_patches.patches.init_process_group import dedupe_backend

opd_patches.register()

PACKAGE = Path(patches.__file__).parent
DECLARED = [(name, u) for name in patches.ALL
            for u in patches.module(name).CHANGES + patches.module(name).RELIES_ON]


# ---- the registry and its declarations ----------------------------------------------------------------


def test_every_patch_file_is_listed_and_declares_what_it_changes():
    files = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "registry"}
    assert files == set(patches.ALL), "a file of opd_patches/patches/ missing from patches.ALL, or the reverse"
    for name in patches.ALL:
        mod = patches.module(name)
        doc = mod.__doc__ or ""
        assert doc.startswith("Changes ") and mod.CHANGES and callable(mod.apply), name
        for u in mod.CHANGES:  # the docstring names each upstream symbol the patch changes
            assert u.qualname.split(".")[-1] in doc, (name, str(u))
        # the code holds no history (docs/ does): no dates, issue numbers or machine names
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\bissue \d|\b[HA]1[02]0\b", inspect.getsource(mod)), name


def _resolve(u: registry.Upstream):
    """(owner, attribute, the original object) of an Upstream declaration in the installed upstream."""
    obj = importlib.import_module(u.module)
    *path, attribute = u.qualname.split(".")
    for part in path:
        obj = getattr(obj, part)
    if u.instances:  # set on instances: a class attribute, or assigned by the class's __init__
        assert isinstance(obj, type), str(u)
        if not hasattr(obj, attribute):
            assert f"self.{attribute} = " in inspect.getsource(obj.__init__), f"{u}: no longer set by __init__"
            return obj, attribute, None
        return obj, attribute, getattr(obj, attribute)
    assert hasattr(obj, attribute), f"{u}: gone"
    if u.key is registry.NO_KEY:
        return obj, attribute, registry.original(obj, attribute)
    assert isinstance(getattr(obj, attribute), dict), str(u)
    entry = registry.original(obj, attribute, u.key)
    return obj, attribute, None if entry is registry.MISSING else entry


@pytest.mark.parametrize("name,upstream", DECLARED, ids=[f"{n}:{u}" for n, u in DECLARED])
def test_upstream_still_has_what_the_patch_was_written_against(name, upstream):
    _, _, original = _resolve(upstream)
    if upstream.params is not None:
        got = list(inspect.signature(original).parameters)
        want = list(upstream.params)
        if want[-1] == "...":
            got, want = got[: len(want) - 1], want[:-1]
        assert got == want, f"{name}: the parameters of {upstream} changed"
    if upstream.source:
        source = inspect.getsource(original)
        for text in upstream.source:
            assert text in source, f"{name}: {upstream} no longer holds {text!r}"


def test_registry_is_idempotent_and_records_each_patch_once():
    before = [(r.name, id(r.owner), r.attribute, repr(r.key), r.replacement) for r in registry.records()]
    opd_patches.register()
    after = [(r.name, id(r.owner), r.attribute, repr(r.key), r.replacement) for r in registry.records()]
    assert before == after  # nothing re-wrapped, no second record
    targets = [(id(r.owner), r.attribute, repr(r.key)) for r in registry.records()]
    assert len(targets) == len(set(targets))
    for r in registry.records():
        current = getattr(r.owner, r.attribute) if r.key is registry.NO_KEY else getattr(r.owner, r.attribute)[r.key]
        assert r.temporary or current is r.replacement, r.name
        assert Path(r.file) == PACKAGE / f"{r.name}.py"


def test_a_second_apply_of_an_instance_patch_wraps_nothing():
    from opd_patches.patches import replay_wait_for_next_poll

    class Buffer:
        def _wait_for_next_poll(self, partition_id, last_debug_time):
            return last_debug_time

    buffer, calls = Buffer(), []
    first = replay_wait_for_next_poll.apply(buffer, lambda: calls.append(1))
    assert replay_wait_for_next_poll.apply(buffer, lambda: calls.append(2)) is first
    assert buffer._wait_for_next_poll("train", 1.5) == 1.5 and calls == [1]
    assert first.original.__func__ is Buffer._wait_for_next_poll  # upstream's bound method, wrapped once
    registry.revert(first)
    assert "_wait_for_next_poll" not in vars(buffer)


def test_a_temporary_swap_is_recorded_once_and_undone():
    from types import SimpleNamespace

    module, patch = SimpleNamespace(torch="torch"), "opd_patches.patches.fsdp_save_checkpoint"
    for proxy in ("first", "second"):
        with registry.swapped(patch, module, "torch", proxy) as record:
            assert module.torch == proxy and record.original == "torch" and record.temporary
        assert module.torch == "torch"
    assert [r.replacement for r in registry.records() if r.owner is module] == ["second"]
    with pytest.raises(RuntimeError, match="already patched by fsdp_save_checkpoint"):
        registry.apply("opd_patches.patches.rollout_registry", module, "torch", lambda original: "other")
    with pytest.raises(ValueError, match="its own file of opd_patches/patches/"):
        registry.apply("opd_patches.trainers.opd_sync", module, "other", lambda original: "x")
    registry.revert(record)


# ---- no patch outside the registry --------------------------------------------------------------------

# The public registration hooks: new entries through these are registrations, not patches.
PUBLIC_HOOKS = {
    "verl.plugin.platform.platform_manager.PlatformRegistry._platforms": "PlatformRegistry.register",
    "verl.workers.rollout.replica.RolloutReplicaRegistry._registry": "RolloutReplicaRegistry.register",
    "verl.trainer.distillation.losses.DISTILLATION_LOSS_REGISTRY": "register_distillation_loss",
    "verl.trainer.distillation.losses.DISTILLATION_SETTINGS_REGISTRY": "register_distillation_loss",
    "verl.trainer.ppo.v1.trainer_base.TRAINER_REGISTRY": "register_trainer",
    "transformers.modeling_utils.AttentionInterface._global_mapping": "AttentionInterface.register",
    "transformers.masking_utils.AttentionMaskInterface._global_mapping": "AttentionMaskInterface.register",
}
# What a Ray worker of a run imports besides the registration (trainer modes, agent loop, rollout backend).
RUNTIME = ["opd_patches.trainers.opd_sync", "opd_patches.trainers.colocated_teacher", "opd_patches.teacher.agent_loop",
           "opd_patches.rollout.hf"]
BASELINE = sorted({u.module for _, u in DECLARED} | {
    "verl.trainer.ppo.v1.trainer_sync", "verl.trainer.ppo.v1.agent_loop_tq", "verl.workers.rollout.replica",
    "verl.workers.rollout.llm_server", "verl.experimental.reward_loop.reward_loop", "verl.plugin.platform",
    "transformers.masking_utils", "transformers.modeling_utils"})

# Imports BASELINE (no opd_patches), records every upstream module's attributes, the attributes of the
# classes it defines and the entries of the plain dicts among both; then registers opd_patches with every
# switch on (a run's config with entropy_detached and background_state_write), imports RUNTIME and records again. Prints one JSON
# line: each difference (added or changed) with its names "<module>.<qualname>[<key>]", and the registry's records.
_DIFF = textwrap.dedent(
    """
    import importlib, json, sys, types, warnings
    warnings.simplefilter("ignore")
    baseline, runtime = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    PREFIX = ("verl", "torch", "transformers")
    for name in baseline:
        importlib.import_module(name)

    def ours(value):
        module = getattr(value, "__module__", None)
        return (isinstance(module, str) and module.startswith("opd_patches")) or (
            isinstance(value, str) and value.startswith("opd_patches."))

    def entries(where, value, out):  # a dict reached from several modules: one entry, every name of it
        if type(value) is dict:
            for key, item in list(value.items()):
                out.setdefault((id(value), repr(key)), ([], item, "entry"))[0].append(f"{where}[{key!r}]")

    def snapshot():
        out = {}
        for name, module in list(sys.modules.items()):
            if not name.startswith(PREFIX) or not isinstance(module, types.ModuleType):
                continue
            for attr, value in list(vars(module).items()):
                out[(name, attr)] = ([f"{name}.{attr}"], value, "module")
                entries(f"{name}.{attr}", value, out)
                if isinstance(value, type) and value.__module__ == name:
                    for cattr, cvalue in list(vars(value).items()):
                        out[(name, attr, cattr)] = ([f"{name}.{value.__qualname__}.{cattr}"], cvalue, "class")
                        entries(f"{name}.{value.__qualname__}.{cattr}", cvalue, out)
        return out

    before = snapshot()
    import opd_patches
    opd_patches.register()
    for name in runtime:
        importlib.import_module(name)
    opd_patches.register()  # twice: idempotent
    after = snapshot()
    diffs = []
    for key, (wheres, value, kind) in after.items():
        if key in before and before[key][1] is value:
            continue
        # new module attributes and dict entries: lazy imports, upstream registering its own; new classes
        if key not in before and not ours(value) and not (kind == "class" and key[:2] in before):
            continue
        diffs.append({"wheres": sorted(set(wheres)), "added": key not in before, "entry": kind == "entry"})
    from opd_patches.patches import registry

    def described(r):
        owner = r.owner
        where = (owner.__name__ if isinstance(owner, types.ModuleType) else
                 f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else repr(owner))
        return f"{where}.{r.attribute}" + ("" if r.key is registry.NO_KEY else f"[{r.key!r}]")

    records = [{"name": r.name, "where": described(r), "temporary": r.temporary} for r in registry.records()]
    print(json.dumps({"diffs": diffs, "records": records}))
    """
)


@pytest.fixture(scope="module")
def changes():
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_PLATFORM")}
    env.update(config.env(entropy_detached=True, background_state_write=True, run_dir="/nonexistent-run"))
    proc = subprocess.run([sys.executable, "-c", _DIFF, json.dumps(BASELINE), json.dumps(RUNTIME)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.fresh_process
def test_every_change_to_upstream_is_a_registered_patch(changes):
    recorded = {r["where"] for r in changes["records"]}
    unexplained = []
    for diff in changes["diffs"]:
        hook = diff["entry"] and any(where.rsplit("[", 1)[0] in PUBLIC_HOOKS for where in diff["wheres"])
        if recorded.isdisjoint(diff["wheres"]) and not (hook and diff["added"]):
            unexplained.append(diff)
    assert not unexplained, f"changed without opd_patches/patches/registry.py: {unexplained}"


@pytest.mark.fresh_process
def test_registration_applies_every_registration_patch_as_declared(changes):
    declared = {name: {str(u) for u in patches.module(name).CHANGES} for name in patches.ALL}
    for record in changes["records"]:
        assert record["where"] in declared[record["name"]], record
    assert {r["name"] for r in changes["records"]} == set(patches.AT_REGISTRATION)
    changed = {where for diff in changes["diffs"] for where in diff["wheres"]}
    assert changed >= {r["where"] for r in changes["records"] if not r["temporary"]}  # each record is a real change


UPSTREAM_PACKAGES = ("verl", "torch", "transformers", "tensordict", "ray", "vllm", "transfer_queue")


def _patch_shaped(tree: ast.AST) -> list[tuple[int, str]]:
    """Statements that change an upstream object: a write to an attribute or entry of a name imported from
    an upstream package; a function defined in the same scope, or a lambda, bound to an attribute of anything
    but `self` itself (a method rebound); a module's global named for an upstream package replaced (`m.torch =`);
    setattr/delattr on anything but self; a write through `__dict__`. (An instance attribute set to a plain value,
    as `buffer.poll_interval = 0.05`, is not seen here: the trainer's buffer is checked by the next tests.)"""
    upstream, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UPSTREAM_PACKAGES:
                    upstream.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UPSTREAM_PACKAGES:
            upstream.update(alias.asname or alias.name for alias in node.names)

    def root(target):
        while isinstance(target, (ast.Attribute, ast.Subscript)):
            target = target.value
        return target

    def writes(scope):
        """(statement, target, value) of the assignments directly in `scope` (not in functions nested in it)."""
        todo = list(ast.iter_child_nodes(scope))
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            todo.extend(ast.iter_child_nodes(node))
            if isinstance(node, (ast.Assign, ast.Delete)):
                yield from ((node, t, getattr(node, "value", None)) for t in node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                yield node, node.target, node.value

    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        local_defs = {n.name for n in ast.walk(scope) if n is not scope
                      and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and not isinstance(scope, ast.Module)} | {
            n.name for n in scope.body if isinstance(scope, ast.Module) and isinstance(n, ast.FunctionDef)}
        for node, target, value in writes(scope):
            if not isinstance(target, (ast.Attribute, ast.Subscript)):
                continue
            base, text = root(target), ast.unparse(target)
            own = isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
            if isinstance(base, ast.Name) and base.id in upstream:
                found.append((node.lineno, f"writes into upstream's {base.id}"))
            elif isinstance(target, ast.Attribute) and not own and (
                    isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in local_defs)):
                found.append((node.lineno, f"binds a function to .{target.attr}"))
            elif isinstance(target, ast.Attribute) and target.attr in UPSTREAM_PACKAGES and not own:
                found.append((node.lineno, f"swaps a module's global {target.attr}"))
            elif "__dict__" in text or text.startswith("vars("):
                found.append((node.lineno, "writes through __dict__/vars()"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls")):
                found.append((node.lineno, f"{node.func.id} on {ast.unparse(node.args[0])}"))
    return found


def test_no_patch_shaped_code_outside_the_patches_package():
    root = PACKAGE.parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if PACKAGE in path.parents:
            continue
        for line, what in _patch_shaped(ast.parse(path.read_text())):
            found.append(f"{path.relative_to(root.parent)}:{line}: {what}")
    assert not found, "apply these through opd_patches/patches/ (a file there, registry.apply):\n" + "\n".join(found)


def test_the_lint_sees_the_shapes_a_patch_takes():
    seen = _patch_shaped(ast.parse(textwrap.dedent(
        """
        import torch.distributed
        from verl.workers.rollout import base as rollout_base
        torch.distributed.init_process_group = wrapper
        rollout_base._ROLLOUT_REGISTRY[("hf", "async")] = "x"
        def install(buffer):
            def _wait(partition_id, last):
                return last
            buffer._wait_for_next_poll = _wait
            setattr(buffer, "poll_interval", 0.05)
            buffer.__dict__["x"] = 1
            module.torch = proxy
        """)))
    assert sorted(line for line, _ in seen) == [4, 5, 9, 10, 11, 12], seen


def test_the_trainer_changes_its_replay_buffer_only_through_patches():
    """The mixin's changes to upstream's replay buffer (built by upstream's own builder) are registry records."""
    from test_replay_poll import _Upstream, mixin_trainer

    class Plain(_Upstream):  # upstream's sync trainer as far as its builder reads it
        trainer_mode = "sync"

    trainer = mixin_trainer()
    mine, theirs = vars(trainer.replay_buffer), vars(Plain(trainer.config).replay_buffer)
    recorded = {r.attribute for r in registry.records() if r.owner is trainer.replay_buffer}
    assert recorded == {"poll_interval", "_wait_for_next_poll"}
    for attr, value in mine.items():
        if attr in recorded:
            continue
        other = theirs.get(attr, registry.MISSING)
        if callable(value) and not isinstance(value, type):
            assert getattr(value, "__func__", value) == getattr(other, "__func__", other), attr
        elif isinstance(value, (int, float, str, bool, type(None))):
            assert value == other, attr


# ---- init_process_group: duplicate device entries, a taken port ---------------------------------------


def test_dedupe_backend():
    assert dedupe_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert dedupe_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert dedupe_backend("gloo") == "gloo"
    assert dedupe_backend(None) is None


# One fresh process for both patches of torch.distributed.init_process_group (a real gloo group each time):
# every case without the patch first, then `patches.apply_all()` (it imports VERL), then every case
# with it. A failed init leaves no group behind, so the cases can follow each other. Prints one JSON line
# per case: {"case", "out" (what the case printed), "error" (the exception's text, if any)}.
_INIT_CASES = textwrap.dedent(
    """
    import contextlib, io, json, os, socket, sys, torch, torch.distributed as dist
    store = sys.argv[1]

    def case(name, fn):
        out, error = io.StringIO(), None
        with contextlib.redirect_stdout(out):
            try:
                fn()
            except Exception as exc:  # torch's error, reported to the test
                error = f"{type(exc).__name__}: {exc}"
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
        print(json.dumps({"case": name, "out": out.getvalue(), "error": error}), flush=True)

    def duplicate(tag):
        def fn():
            dist.init_process_group(backend="cpu:gloo,cpu:gloo", init_method=f"file://{store}/{tag}", rank=0,
                                    world_size=1)
            dist.all_reduce(torch.ones(1))
        return fn

    def other_forms():  # upstream's own call forms pass through: positional, and no backend
        dist.init_process_group("gloo", init_method=f"file://{store}/positional", rank=0, world_size=1)
        dist.destroy_process_group()
        dist.init_process_group(init_method=f"file://{store}/default", rank=0, world_size=1)
        dist.all_reduce(torch.ones(1))

    def taken_port(world):  # VERL's env:// rendezvous on a port another socket holds
        def fn():
            held = socket.socket(); held.bind(("127.0.0.1", 0)); held.listen()
            port = str(held.getsockname()[1])
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE=str(world))
            try:
                dist.init_process_group(backend="gloo", world_size=world, rank=0)
                dist.all_reduce(torch.ones(1))
                print("moved" if os.environ["MASTER_PORT"] != port else "same")
            finally:
                held.close()
        return fn

    case("plain duplicate", duplicate("plain"))
    case("plain taken port, 1 rank", taken_port(1))
    from opd_patches import patches
    patches.apply_all()
    case("patched duplicate", duplicate("patched"))
    case("patched other forms", other_forms)
    case("patched taken port, 1 rank", taken_port(1))
    case("patched taken port, 2 ranks", taken_port(2))
    """
)


@pytest.fixture(scope="module")
def init_cases(tmp_path_factory):
    store = tmp_path_factory.mktemp("init_store")
    proc = subprocess.run([sys.executable, "-c", _INIT_CASES, str(store)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {row["case"]: row for row in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.fresh_process
def test_torch_refuses_the_duplicate_and_accepts_it_patched(init_cases):
    """A real single-rank gloo group, with and without the patch."""
    assert "Duplicate device type cpu" in (init_cases["plain duplicate"]["error"] or ""), init_cases
    for name in ("patched duplicate", "patched other forms"):
        assert init_cases[name]["error"] is None, init_cases[name]


@pytest.mark.fresh_process
def test_a_taken_master_port_is_retried_for_one_rank_only(init_cases):
    """VERL picks MASTER_PORT seconds before torch listens on it; another process can take it meanwhile.
    Single rank: retried on a fresh port; several ranks: torch's error."""
    for name in ("plain taken port, 1 rank", "patched taken port, 2 ranks"):
        row = init_cases[name]
        assert row["error"] and row["error"].startswith("DistNetworkError") and "EADDRINUSE" in row["error"], row
    row = init_cases["patched taken port, 1 rank"]
    assert row["error"] is None and row["out"].split()[-1] == "moved", row
    assert "MASTER_PORT" in row["out"] and "retrying on" in row["out"], row


# ---- validate_topk_logprobs: the hf teacher -----------------------------------------------------------


def _teacher(name):
    return DistillationTeacherModelConfig(key="t", model_path="/m", inference=RolloutConfig(name=name))


def test_upstream_topk_validation_still_rejects_unknown_engines():
    original = DistillationTeacherModelConfig._validate_topk_logprobs.__wrapped__
    with pytest.raises(NotImplementedError, match="does not support inference engine hf"):
        original(_teacher("hf"), use_topk=True, topk=16)


def test_patched_topk_validation_accepts_hf_only():
    _teacher("hf")._validate_topk_logprobs(use_topk=True, topk=16)
    with pytest.raises(ValueError, match="topk must be specified"):
        _teacher("hf")._validate_topk_logprobs(use_topk=True, topk=None)
    with pytest.raises(NotImplementedError):
        _teacher("trtllm")._validate_topk_logprobs(use_topk=True, topk=16)


# ---- rollout_registry: the hf rollout class -----------------------------------------------------------


def test_rollout_class_registry_is_still_the_private_dict():
    assert isinstance(rollout_base._ROLLOUT_REGISTRY, dict) and ("vllm", "async") in rollout_base._ROLLOUT_REGISTRY
    from opd_patches.rollout.hf import HFServerAdapter

    assert rollout_base.get_rollout_class("hf", "async") is HFServerAdapter


# ---- compute_forward_kl_topk: the top-k logits processor (tail term, memory-lean mode) ----------------


@pytest.mark.parametrize("loss_mode", ["forward_kl_topk", "forward_kl_topk_tail"])
def test_lean_mode_of_the_wrapper_gives_the_originals_outputs(monkeypatch, loss_mode):
    from types import SimpleNamespace

    import torch
    from verl.trainer.distillation.fsdp import losses as fsdp_losses

    from opd_patches import config as opd_config

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 11, 50, generator=gen) * 3
    lp, ids = torch.log_softmax(torch.randn(11, 50, generator=gen) * 3, -1).topk(6, -1)
    offsets = torch.tensor([0, 4, 11])
    nested = [torch.nested.nested_tensor_from_jagged(x, offsets) for x in (lp, ids)]
    config = SimpleNamespace(distillation_loss=SimpleNamespace(
        loss_mode=loss_mode, log_prob_min_clamp=-10.0, use_chunked_topk=False))
    results = {}
    for mode in ("0", "1"):
        with opd_config.override(lean_topk=mode == "1"):
            z = logits.clone().requires_grad_(True)
            out = fsdp_losses.compute_forward_kl_topk(z, *nested, config, "thd")
            sum(out[k].sum() for k in ("distillation_losses", "tail_losses") if k in out).backward()
        results[mode] = (out, z.grad)
    (plain, g0), (lean, g1) = results["0"], results["1"]
    assert set(plain) == set(lean) and ("tail_losses" in lean) == (loss_mode == "forward_kl_topk_tail")
    for key in plain:
        torch.testing.assert_close(lean[key].to(plain[key].dtype), plain[key], rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)


# ---- logprobs_from_logits_v2: the sampled-token log-prob fallback (losses/sampled_logprob.py) ---------


def test_logprobs_fallback_is_read_from_the_module_globals():
    """The patch replaces the module attribute `logprobs_from_logits_v2`; that reaches the engine only while
    upstream's `logprobs_from_logits` reads it from torch_functional's globals (its source: the declaration)."""
    import verl.utils.torch_functional as verl_F

    assert verl_F.logprobs_from_logits.__globals__ is vars(verl_F)


def test_every_binding_of_logprobs_from_logits_reaches_the_patch():
    """`from verl.utils.torch_functional import logprobs_from_logits` copies the function object, not v2:
    each importer (the FSDP engine above all) must hold upstream's function, and nothing in verl may
    bind `logprobs_from_logits_v2` itself (that copy would bypass the patch)."""
    import verl
    import verl.utils.torch_functional as verl_F
    from verl.workers.engine.fsdp import transformer_impl

    assert transformer_impl.logprobs_from_logits is verl_F.logprobs_from_logits
    call = inspect.getsource(transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs)
    assert call.count("log_probs = logprobs_from_logits(") == 2
    root = Path(verl.__file__).parent
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if "logprobs_from_logits_v2" in p.read_text(errors="replace"))
    assert users == ["utils/torch_functional.py"], users
    # The other importers (optional engines: automodel, torchtitan, naive rollout, prefix grouper) import
    # the same function object by name, so they reach the patch too.
    importers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                       if "import logprobs_from_logits" in p.read_text(errors="replace"))
    for rel in importers:
        assert "from verl.utils.torch_functional import logprobs_from_logits\n" in (root / rel).read_text(), rel
    assert "workers/engine/fsdp/transformer_impl.py" in importers


@pytest.mark.parametrize("fast", ["1", "0"])
def test_the_engines_logprobs_call_takes_the_patched_path(monkeypatch, fast):
    """Call the FSDP engine's own binding, as prepare_model_outputs does: on -> the chunked kernel's
    autograd node, off -> upstream's v2. (Where flash-attn is installed, upstream's path wins: skip.)"""
    import torch
    import verl.utils.torch_functional as verl_F
    from verl.workers.engine.fsdp import transformer_impl


    if verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE or verl_F.NPU_CROSS_ENTROPY_LOSS_AVAILABLE:
        pytest.skip("flash-attn or torch_npu installed: upstream's own kernel runs, the fallback is never hit")
    logits = torch.randn(7, 50, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (7,))
    with config.override(fast_logprobs=fast == "1"):
        out = transformer_impl.logprobs_from_logits(logits=logits, labels=labels, inplace_backward=True)
    nodes = [out.grad_fn] + [fn for fn, _ in out.grad_fn.next_functions if fn is not None]
    taken = [type(fn).__name__ for fn in nodes]  # the kernel's node sits under a view
    assert any("SampledLogprob" in name for name in taken) == (fast == "1"), taken
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
