"""The one registry of bps_tf's hooks into Keras and TensorFlow.

Keras 3 knows nothing of multi-worker jobs outside TensorFlow's own
MultiWorkerMirroredStrategy, so a few of its behaviours must change under
``BytePSStrategy`` (rank-0 checkpoints, every row from ``predict``, the
overlap's flushes...). What the ``tf.distribute`` contract can express is
done by the strategy itself; the rest is a *hook*: a method or property of a
Keras or TensorFlow class replaced by a wrapper that calls the original.

Every hook is declared here, in one form (:func:`register`), with

* ``locate``: how its target is found -- by *role* where the name is private
  (the class in ``keras.Model``'s MRO that defines ``make_train_function``,
  the epoch-iterator class of that class's module), by public name
  otherwise -- raising :class:`HookMissing` with what it looked for;
* what it changes, why no public API can do it, and the versions it was
  verified on (``docs/dependencies.md`` prints this table);
* ``when_missing``: what bps_tf does when a future release moves the target
  (:data:`POLICIES`): fall back to a documented safe path with one warning
  naming the Keras version and the hook, refuse with a clear error, or go
  on without a cosmetic change. Never an ``AttributeError`` from inside
  bps_tf, never a silently different result.

:func:`install` installs a group's hooks once per process under one lock;
each replacement carries the hook's name, so nothing is wrapped twice.
No TensorFlow or Keras is imported by this module itself.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

log = logging.getLogger("bps_tf")

# The oldest Keras 3 every hook was verified on (docs/dependencies.md).
# 3.8 and 3.9 keep metric variables synchronized on write, not on read, and
# evaluate()'s global metrics came out wrong with them (docs/dependencies.md).
MIN_KERAS = (3, 10)
VERIFIED_KERAS = "3.10.0-3.15.1, 3.16.0.dev2026102704"
VERIFIED_TF = "2.16.2-2.21.0, 2.22.0rc0"

# What bps_tf does when a hook's target cannot be found.
POLICIES = {
    "fallback": "falls back to the documented safe path, with one warning",
    "error": "refuses, with an error naming the hook and the Keras version",
    "cosmetic": "goes on without it (what it changes is not a result)",
}

_MARK = "__bps_tf_hook__"


class HookMissing(LookupError):
    """A hook's target was not found where its role says it is."""


class HookError(RuntimeError):
    """A feature needs a hook whose target this Keras/TensorFlow moved."""


@dataclasses.dataclass
class Hook:
    name: str                                  # the target, as docs and errors show it
    group: str                                 # installed together (install(group))
    locate: Callable[[], Tuple[Any, str]]      # -> (owner, attribute)
    wrap: Optional[Callable[[Any], Any]]       # original -> replacement; None: a probe
    changes: str
    why: str
    when_missing: str
    private: bool                              # the target's own name is private
    verified: str = ""
    found_by: str = ""                         # how locate finds it, for the docs


_hooks: Dict[str, Hook] = {}
_missing: Dict[str, str] = {}     # hook name -> why its target was not found
_installed: set = set()
_lock = threading.RLock()
_warned: set = set()


def register(name: str, group: str, locate, *, changes: str, why: str,
             when_missing: str, private: bool = False, verified: str = "",
             found_by: str = ""):
    """Declares a hook; used as a decorator over its ``wrap(original)``.
    A name declared twice is a bug (two wrappers of one target)."""
    if when_missing not in POLICIES:
        raise ValueError(f"hook {name}: when_missing={when_missing!r} is not one of "
                         f"{sorted(POLICIES)}")

    def decorate(wrap):
        with _lock:
            if name in _hooks:
                raise ValueError(f"hook {name} is declared twice")
            _hooks[name] = Hook(name, group, locate, wrap, changes, why, when_missing, private,
                                verified or f"Keras {VERIFIED_KERAS}; TensorFlow {VERIFIED_TF}",
                                found_by or getattr(locate, "found_by", ""))
        return wrap
    return decorate


def probe(name: str, group: str, locate, *, changes: str, why: str, when_missing: str,
          private: bool = True, found_by: str = "") -> None:
    """Declares a target that bps_tf uses without replacing it (e.g. an
    optimizer method the overlap calls per instance): checked like a hook."""
    register(name, group, locate, changes=changes, why=why, when_missing=when_missing,
             private=private, found_by=found_by)(None)


def install(group: str) -> Dict[str, str]:
    """Installs the hooks of ``group`` not installed yet (once per process);
    returns {hook name: why its target is missing} for the group."""
    with _lock:
        for hook in [h for h in _hooks.values() if h.group == group]:
            if hook.name in _installed or hook.name in _missing:
                continue
            try:
                owner, attr = hook.locate()
                if hook.wrap is not None:
                    _replace(hook, owner, attr)
                _installed.add(hook.name)
            except HookMissing as exc:
                _missing[hook.name] = str(exc)
                if hook.when_missing == "cosmetic":
                    log.debug("bps_tf: hook %s not installed (%s)", hook.name, exc)
        return missing(group)


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
    """{hook name: reason} of the hooks whose target was not found (of
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


def warn_fallback(groups, what: str) -> None:
    """One warning for ``groups`` (a group or a tuple of groups): ``what``
    bps_tf does instead, naming the missing hooks and the Keras version."""
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


def require(group: str, feature: str, policy: Optional[str] = "error") -> None:
    """Raises :class:`HookError` if a hook of ``group`` (whose policy is
    ``policy``; None: any) is missing: ``feature`` cannot run without it."""
    gone = missing(group, policy)
    if gone:
        raise HookError(
            f"{feature} needs bps_tf's hook(s) {', '.join(sorted(gone))}, which this Keras "
            f"({keras_version()}) / TensorFlow ({tensorflow_version()}) no longer has "
            f"({'; '.join(sorted(gone.values()))}). Last verified: Keras {VERIFIED_KERAS}, "
            f"TensorFlow {VERIFIED_TF}. Install a verified Keras (pip install 'keras==3.15.1') "
            f"or report it.")


def keras_version() -> str:
    module = sys.modules.get("keras")
    return getattr(module, "__version__", "not loaded") if module else "not loaded"


def tensorflow_version() -> str:
    module = sys.modules.get("tensorflow")
    return getattr(module, "__version__", "not loaded") if module else "not loaded"


def check_keras_version() -> None:
    """Raises if the loaded Keras 3 is older than every verified one."""
    version = keras_version()
    try:
        parts = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return     # a development build without a plain number: the hooks decide
    if parts[0] == 3 and parts < MIN_KERAS:
        raise HookError(
            f"BytePSStrategy needs Keras >= {'.'.join(map(str, MIN_KERAS))} (found {version}): "
            f"older Keras 3 releases lack what bps_tf relies on (before 3.10 metric variables "
            f"are synchronized on write, and evaluate()'s global metrics would be wrong; "
            f"before 3.8 the epoch iterator cannot be reset). pip install "
            f"'keras>={'.'.join(map(str, MIN_KERAS))}'.")


# --------------------------------------------------------------------------
# Lookups by role
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
    return locate


def markdown_table() -> str:
    """The registry as a markdown table (docs/dependencies.md)."""
    rows = ["| hook | found by | changes | why not through a public API | if missing |",
            "|---|---|---|---|---|"]
    for hook in sorted(_hooks.values(), key=lambda h: (h.group, h.name)):
        kind = "uses" if hook.wrap is None else "wraps"
        rows.append(f"| `{hook.name}` ({hook.group}; {kind}) | {hook.found_by} | {hook.changes} "
                    f"| {hook.why} | {hook.when_missing}: {POLICIES[hook.when_missing]} |")
    return "\n".join(rows)


def backend_trainer():
    """The Keras backend trainer class: the class of ``keras.Model``'s MRO
    that defines ``make_train_function`` (TensorFlowTrainer up to Keras 3.15,
    Trainer in 3.16)."""
    return defining_class(public("keras.Model"), "make_train_function")


def epoch_iterator_class():
    """The TensorFlow epoch iterator Keras' backend trainer makes for fit,
    evaluate and predict: the class of the backend trainer's module that
    derives from an ``EpochIterator`` (TFEpochIterator in Keras 3.8-3.16)."""
    module = sys.modules[backend_trainer().__module__]
    found = [value for value in vars(module).values()
             if isinstance(value, type) and value.__module__ == module.__name__
             and any(base.__name__ == "EpochIterator" for base in value.__mro__[1:])]
    if len(found) != 1:
        raise HookMissing(f"{module.__name__} defines {len(found)} EpochIterator classes, not 1")
    return found[0]


def dataset_adapter_class():
    """The Keras data adapter class that serves a ``tf.data.Dataset`` as given."""
    import tensorflow as tf
    try:
        from keras.src.trainers.data_adapters import get_data_adapter  # role: Keras' own choice
    except ImportError as exc:
        raise HookMissing(f"keras' get_data_adapter cannot be imported ({exc})") from None
    return type(get_data_adapter(tf.data.Dataset.range(1)))
