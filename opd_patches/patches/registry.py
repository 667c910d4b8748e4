"""The one way a run-time patch is applied, and the record of every patch applied in this process.

`apply(patch, owner, attribute, wrap)` sets `owner.attribute` (a module, class or instance attribute; with
`key`, the entry `key` of the dict `owner.attribute`) to `wrap(original)` and records it. Applying the same
patch to the same target again returns the existing record and wraps nothing twice. `swapped(...)` is the
temporary form (a context manager that restores the original on the way out), recorded the same way.
`patch` is the `__name__` of the patch's file in opd_patches/patches/: the file name is the patch's name.

Each patch file also declares, as `Upstream` entries, what it changes (`CHANGES`) and what of upstream's
code it relies on (`RELIES_ON`): tests/test_upstream_patches.py checks every declaration against the
installed upstream and checks, in a fresh process, that every change opd_patches makes to upstream's
modules is one of these records.
"""

import contextlib
import dataclasses
import sys
import types
from typing import Any, Callable, Hashable

MARK = "_opd_patched"  # set on every replacement function (tests read it in fresh processes)


class _Sentinel:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return self.name


MISSING = _Sentinel("MISSING")  # the original of a dict entry that upstream does not have
NO_KEY = _Sentinel("NO_KEY")  # the target is the attribute itself, not an entry of it


@dataclasses.dataclass(frozen=True)
class Upstream:
    """An upstream symbol as a patch was written against it (checked by tests/test_upstream_patches.py).

    `qualname` is dotted within `module`; with `instances`, its last part is an attribute set on instances
    of the class before it (a class attribute, or one its `__init__` assigns). `key`: an entry of the dict
    at `qualname`. `params`: the function's parameter names (ending in "...": its leading ones). `source`: text
    its source still holds."""

    module: str
    qualname: str
    key: Hashable = NO_KEY
    params: tuple[str, ...] | None = None
    source: tuple[str, ...] = ()
    instances: bool = False

    def __str__(self):
        return f"{self.module}.{self.qualname}" + ("" if self.key is NO_KEY else f"[{self.key!r}]")


@dataclasses.dataclass
class Record:
    """One applied patch: `owner.attribute` (or its entry `key`) went from `original` to `replacement`."""

    name: str  # the patch: its file opd_patches/patches/<name>.py
    owner: Any
    attribute: str
    key: Any
    original: Any
    replacement: Any
    file: str
    temporary: bool = False
    own: bool = True  # the attribute was the owner's own (else inherited from its class: revert deletes it)

    def targets(self, owner, attribute, key) -> bool:
        return self.owner is owner and self.attribute == attribute and _same_key(self.key, key)


_RECORDS: list[Record] = []


def records() -> list[Record]:
    """Every patch applied in this process (a copy)."""
    return list(_RECORDS)


def _same_key(a, b) -> bool:
    return a is b or (a is not NO_KEY and b is not NO_KEY and a == b)


def _get(owner, attribute, key):
    if key is NO_KEY:
        return getattr(owner, attribute)
    return getattr(owner, attribute).get(key, MISSING)


def _own(owner, attribute, key) -> bool:
    return key is not NO_KEY or attribute in getattr(owner, "__dict__", {attribute: None})


def _set(owner, attribute, key, value) -> None:
    if key is NO_KEY:
        setattr(owner, attribute, value)
    elif value is MISSING:
        getattr(owner, attribute).pop(key, None)
    else:
        getattr(owner, attribute)[key] = value


def _name_and_file(patch: str) -> tuple[str, str]:
    package, _, name = patch.rpartition(".")
    if package != __name__.rpartition(".")[0]:
        raise ValueError(f"{patch}: a run-time patch lives in its own file of opd_patches/patches/")
    return name, getattr(sys.modules.get(patch), "__file__", None) or f"{name}.py"


def _find(owner, attribute, key) -> Record | None:
    return next((r for r in _RECORDS if r.targets(owner, attribute, key)), None)


def _mark(value) -> None:
    if isinstance(value, types.FunctionType):
        setattr(value, MARK, True)


def apply(patch: str, owner, attribute: str, wrap: Callable[[Any], Any], *, key: Hashable = NO_KEY) -> Record:
    """Set `owner.attribute` (or its dict entry `key`) to `wrap(original)`, once; return the record.

    Applied again while in place: the same record, nothing wrapped twice. Replaced meanwhile (a test put
    the original back by hand): `wrap` applies to what is there now and the record follows."""
    name, file = _name_and_file(patch)
    current = _get(owner, attribute, key)
    found = _find(owner, attribute, key)
    if found is not None:
        if found.name != name:
            raise RuntimeError(f"{attribute}: already patched by {found.name}; two patches may not share a target")
        if current is found.replacement:
            return found
        _RECORDS.remove(found)
    own = _own(owner, attribute, key) if found is None else found.own
    replacement = wrap(current)
    _mark(replacement)
    _set(owner, attribute, key, replacement)
    record = Record(name, owner, attribute, key, current, replacement, file, own=own)
    _RECORDS.append(record)
    return record


@contextlib.contextmanager
def swapped(patch: str, owner, attribute: str, replacement):
    """While inside, `owner.attribute` is `replacement`; on the way out, what it was. Recorded once per target
    (the record keeps the first original and the latest replacement)."""
    name, file = _name_and_file(patch)
    before = getattr(owner, attribute)
    record = _find(owner, attribute, NO_KEY)
    if record is None:
        record = Record(name, owner, attribute, NO_KEY, before, replacement, file, temporary=True,
                        own=_own(owner, attribute, NO_KEY))
        _RECORDS.append(record)
    elif record.name != name:
        raise RuntimeError(f"{attribute}: already patched by {record.name}; two patches may not share a target")
    record.replacement = replacement
    setattr(owner, attribute, replacement)
    try:
        yield record
    finally:
        setattr(owner, attribute, before)


def original(owner, attribute: str, key: Hashable = NO_KEY):
    """What `owner.attribute` (or its entry `key`) was before a patch applied in this process; else what it is."""
    record = _find(owner, attribute, key)
    return record.original if record is not None else _get(owner, attribute, key)


def revert(record: Record) -> None:
    """Put the original back (an inherited attribute: inherited again) and forget the record (tests)."""
    if record.own:
        _set(record.owner, record.attribute, record.key, record.original)
    else:
        delattr(record.owner, record.attribute)
    _RECORDS.remove(record)
