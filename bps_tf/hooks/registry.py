"""The one registry of bps_tf's hooks into Keras and TensorFlow.

Keras 3 knows nothing of multi-worker jobs outside TensorFlow's own
MultiWorkerMirroredStrategy, so a few of its behaviours must change under
``BytePSStrategy`` (rank-0 checkpoints, every row from ``predict``, the
overlap's flushes...). What the ``tf.distribute`` contract can express is
done by the strategy itself; the rest touches names that Keras or
TensorFlow do not promise to keep, and every such name is an *entry* here:

* a **hook** (:func:`register`): a method or property of a class replaced by
  a wrapper that calls the original;
* a **use** (:func:`probe`): a private method called, or overridden by a
  subclass of bps_tf, without replacing it;
* a **private attribute** read or written on instances, a **per-instance
  patch** and a **TensorFlow internal** (bps_tf.hooks.entries): each with
  a handle that is the only way bps_tf touches it.

Every entry is declared in one form, with

* ``locate``: how its target is found -- by *role* where the name is private
  (the class in ``keras.Model``'s MRO that defines ``make_train_function``,
  the class whose own code sets an attribute), by public name otherwise --
  raising :class:`HookMissing` with what it looked for;
* what it changes, why no public API can do it, and the versions it was
  verified on (``docs/dependencies.md`` prints this table);
* ``when_missing``: what bps_tf does when a release moves the target
  (:data:`POLICIES`): fall back to a documented safe path with one warning
  naming the versions and the entry, refuse with a clear error, or go on
  without a cosmetic change; ``feature``: what is refused (by default the
  whole group's feature, checked when the group is installed; otherwise that
  feature alone, when it is used). Never an ``AttributeError`` from inside
  bps_tf, never a silently different result.

:func:`install` installs a group's entries once per process under one lock;
each replacement carries the entry's name, so nothing is wrapped twice.
This module imports no TensorFlow or Keras itself (bps_tf.hooks.versions
reads their versions).
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from bps_tf.hooks.errors import HookError, HookMissing
from bps_tf.hooks.versions import (VERIFIED_KERAS, VERIFIED_TF, keras_version,  # noqa: F401
                                   tensorflow_version)

log = logging.getLogger("bps_tf")

# What bps_tf does when an entry's target cannot be found.
POLICIES = {
    "fallback": "falls back to the documented safe path, with one warning",
    "error": "refuses, with an error naming the hook and the Keras version",
    "cosmetic": "goes on without it (what it changes is not a result)",
}
KINDS = ("wraps", "uses", "reads", "patches", "imports")

_MARK = "__bps_tf_hook__"


@dataclasses.dataclass
class Hook:
    name: str                                  # the target, as docs and errors show it
    group: str                                 # installed together (install(group))
    locate: Callable[[], Tuple[Any, str]]      # -> (owner, attribute)
    wrap: Optional[Callable[[Any], Any]]       # original -> replacement; None: no wrapper
    changes: str
    why: str
    when_missing: str
    private: bool                              # the target's own name is private
    verified: str = ""
    found_by: str = ""                         # how locate finds it, for the docs
    kind: str = "wraps"                        # one of KINDS
    feature: str = ""                          # refused alone when missing ("": the group's)
    keras_name: str = ""                       # the name a Keras release could rename


_hooks: Dict[str, Hook] = {}
_missing: Dict[str, str] = {}     # entry name -> why its target was not found
_installed: set = set()
_lock = threading.RLock()
_warned: set = set()


def register(name: str, group: str, locate, *, changes: str, why: str,
             when_missing: str, private: bool = False, verified: str = "",
             found_by: str = "", kind: str = "wraps", feature: str = "",
             keras_name: str = ""):
    """Declares an entry; used as a decorator over its ``wrap(original)``
    (None for an entry that replaces nothing). A name declared twice is a
    bug (two wrappers of one target)."""
    if when_missing not in POLICIES:
        raise ValueError(f"hook {name}: when_missing={when_missing!r} is not one of "
                         f"{sorted(POLICIES)}")
    if kind not in KINDS:
        raise ValueError(f"hook {name}: kind={kind!r} is not one of {KINDS}")

    def decorate(wrap):
        with _lock:
            if name in _hooks:
                raise ValueError(f"hook {name} is declared twice")
            _hooks[name] = Hook(name, group, locate, wrap, changes, why, when_missing, private,
                                verified or f"Keras {VERIFIED_KERAS}; TensorFlow {VERIFIED_TF}",
                                found_by or getattr(locate, "found_by", ""), kind, feature,
                                keras_name or _keras_name(name, locate))
        return wrap
    return decorate


def _keras_name(name: str, locate) -> str:
    """The identifier a Keras release would rename (tests/test_hook_renames.py)."""
    explicit = getattr(locate, "keras_name", None)
    if explicit is not None:
        return explicit
    if not name.startswith("keras"):
        return ""
    return name.rsplit(".", 1)[-1].split(" ")[0]


def probe(name: str, group: str, locate, *, changes: str, why: str, when_missing: str,
          private: bool = True, found_by: str = "", kind: str = "uses",
          feature: str = "") -> None:
    """Declares a target that bps_tf uses without replacing it (e.g. an
    optimizer method the overlap calls per instance): checked like a hook."""
    register(name, group, locate, changes=changes, why=why, when_missing=when_missing,
             private=private, found_by=found_by, kind=kind, feature=feature)(None)


def install(group: str) -> Dict[str, str]:
    """Installs the entries of ``group`` not installed yet (once per
    process); returns {entry name: why its target is missing} for the group."""
    with _lock:
        for hook in [h for h in _hooks.values() if h.group == group]:
            locate_entry(hook.name)
        return missing(group)


def locate_entry(name: str) -> bool:
    """Finds (and, for a hook, wraps) the target of entry ``name`` once;
    whether it is there."""
    with _lock:
        hook = _hooks[name]
        if hook.name in _installed:
            return True
        if hook.name in _missing:
            return False
        try:
            owner, attr = hook.locate()
            if hook.wrap is not None:
                _replace(hook, owner, attr)
            _installed.add(hook.name)
            return True
        except HookMissing as exc:
            _missing[hook.name] = str(exc)
            if hook.when_missing == "cosmetic":
                log.debug("bps_tf: hook %s not installed (%s)", hook.name, exc)
            return False


def check(name: str) -> str:
    """Looks for entry ``name``'s target afresh (nothing cached, nothing
    wrapped): "" when it is there, else why not. For tests that move a
    target the way a release would."""
    try:
        _hooks[name].locate()
        return ""
    except HookMissing as exc:
        return str(exc) or "missing"


def mark_missing(name: str, why: str) -> None:
    """An entry found at install whose target an instance lacks at run time
    (a private attribute that moved): missing from now on."""
    with _lock:
        _installed.discard(name)
        _missing.setdefault(name, why)


def _replace(hook: Hook, owner, attr: str) -> None:
    import inspect
    current = inspect.getattr_static(owner, attr)
    if getattr(_unwrapped(current), _MARK, None) == hook.name:
        return     # this module was loaded twice (e.g. reloaded): already wrapped
    replacement = hook.wrap(current)
    target = replacement.fget if isinstance(replacement, property) else replacement
    try:
        setattr(target, _MARK, hook.name)
    except (AttributeError, TypeError):    # a builtin or a frozen value: nothing to mark
        pass
    setattr(owner, attr, replacement)


def _unwrapped(value):
    return value.fget if isinstance(value, property) else value


def missing(group: Optional[str] = None, policy: Optional[str] = None) -> Dict[str, str]:
    """{entry name: reason} of the entries whose target was not found (of
    ``group``, with the ``when_missing`` ``policy``, when given)."""
    with _lock:
        return {name: why for name, why in _missing.items()
                if (group is None or _hooks[name].group == group)
                and (policy is None or _hooks[name].when_missing == policy)}


def is_installed(name: str) -> bool:
    with _lock:
        return name in _installed


def hooks(group: Optional[str] = None) -> List[Hook]:
    with _lock:
        return [h for h in _hooks.values() if group is None or h.group == group]


def entry(name: str) -> Hook:
    with _lock:
        return _hooks[name]


def warn_fallback(groups, what: str) -> None:
    """One warning for ``groups`` (a group or a tuple of groups): ``what``
    bps_tf does instead, naming the missing entries and the versions."""
    groups = (groups,) if isinstance(groups, str) else tuple(groups)
    gone = {}
    for group in groups:
        gone.update(missing(group, "fallback"))
    if not gone or groups in _warned:
        return
    _warned.add(groups)
    log.warning("bps_tf: %s: this Keras (%s) / TensorFlow (%s) moved what bps_tf hooks "
                "(%s; verified on Keras %s). Please report it.", what, keras_version(),
                tensorflow_version(), "; ".join(f"{n}: {w}" for n, w in sorted(gone.items())),
                VERIFIED_KERAS)


def _refusal(names, feature: str) -> HookError:
    reasons = [_missing[n] for n in sorted(names)]
    return HookError(
        f"{feature} needs bps_tf's hook(s) {', '.join(sorted(names))}, which this Keras "
        f"({keras_version()}) / TensorFlow ({tensorflow_version()}) no longer has "
        f"({'; '.join(reasons)}). Last verified: Keras {VERIFIED_KERAS}, "
        f"TensorFlow {VERIFIED_TF}. Install a verified Keras (pip install 'keras==3.15.1') "
        f"or report it.")


def require(group: str, feature: str, policy: Optional[str] = "error") -> None:
    """Raises :class:`HookError` if an entry of ``group`` (whose policy is
    ``policy``; None: any) is missing: ``feature`` cannot run without it.
    Entries that refuse a feature of their own (``feature=``) are left to
    :func:`require_entry`, called when that feature is used."""
    gone = [n for n in missing(group, policy) if not _hooks[n].feature]
    if gone:
        raise _refusal(gone, feature)


def require_entry(name: str, feature: str = "") -> None:
    """Raises :class:`HookError` if entry ``name`` is missing: its feature
    (``feature``, else the one it was declared with) cannot run."""
    require_entries([name], feature)


def require_entries(names, feature: str = "") -> None:
    """Raises one :class:`HookError` naming every one of ``names`` that is
    missing (``feature``: what cannot run; else the first one's)."""
    gone = [name for name in names if not locate_entry(name)]
    if gone:
        first = _hooks[gone[0]]
        raise _refusal(gone, feature or first.feature or first.group)


# --------------------------------------------------------------------------
# Locators
# --------------------------------------------------------------------------
def defining_class(root, attr: str):
    """The class in ``root``'s MRO that defines ``attr`` itself."""
    for cls in getattr(root, "__mro__", ()):
        if attr in vars(cls):
            return cls
    raise HookMissing(f"no class in {getattr(root, '__name__', root)}'s MRO defines {attr!r}")


def public(path: str):
    """The object at a public dotted path (``keras.callbacks.ModelCheckpoint``)."""
    module_name, _, rest = path.partition(".")
    try:
        value = importlib.import_module(module_name)
    except ImportError as exc:
        raise HookMissing(f"{module_name} cannot be imported ({exc})") from None
    for part in rest.split(".") if rest else ():
        try:
            value = getattr(value, part)
        except AttributeError:
            raise HookMissing(f"{path} does not exist") from None
    return value


def attribute_of(owner_path: str, attr: str, defined_by_role: bool = False):
    """A locator of ``attr`` on the public class at ``owner_path``; with
    ``defined_by_role``, on the class of its MRO that defines it (for a
    private attribute whose defining class may be renamed)."""
    def locate():
        owner = public(owner_path)
        if defined_by_role:
            return defining_class(owner, attr), attr
        if not hasattr(owner, attr):
            raise HookMissing(f"{owner_path}.{attr} does not exist")
        return owner, attr
    locate.found_by = (f"role: the class of {owner_path}'s MRO that defines {attr}"
                       if defined_by_role else f"public name {owner_path}.{attr}")
    return locate


def module_attribute(module_path: str, attr: str):
    """A locator of a module-level name (a TensorFlow internal)."""
    def locate():
        try:
            module = importlib.import_module(module_path)
        except ImportError as exc:
            raise HookMissing(f"{module_path} cannot be imported ({exc})") from None
        if not hasattr(module, attr):
            raise HookMissing(f"{module_path} has no {attr}")
        return module, attr
    locate.found_by = f"module attribute {module_path}.{attr}"
    locate.keras_name = ""
    return locate


def markdown_table() -> str:
    """The registry as a markdown table (docs/dependencies.md)."""
    rows = ["| entry | found by | changes | why not through a public API | if missing |",
            "|---|---|---|---|---|"]
    for hook in sorted(_hooks.values(), key=lambda h: (h.group, h.name)):
        refused = f" ({hook.feature} only)" if hook.feature else ""
        rows.append(f"| `{hook.name}` ({hook.group}; {hook.kind}) | {hook.found_by} | "
                    f"{hook.changes} | {hook.why} | {hook.when_missing}: "
                    f"{POLICIES[hook.when_missing]}{refused} |")
    return "\n".join(rows)
