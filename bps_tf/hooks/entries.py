"""Registry entries with a handle: the only way bps_tf touches a private
attribute of Keras objects, patches one object, or imports a TensorFlow
internal (bps_tf.hooks.registry declares them like hooks; the docs table
lists them).

* :class:`PrivateAttribute`: an attribute Keras sets on its own objects
  (the epoch iterator's ``_num_batches``), read or written through
  ``get``/``set``/``swapped``. Found by role: some method of the class (in
  its MRO) that the role names must use the attribute in its own code, so a
  release that renames it is seen before any object exists.
* :class:`InstancePatch`: a method replaced on one object only (a layer's
  ``call``, an optimizer's ``_backend_update_step``); the class must define
  it. :class:`Method`: a private method called, found the same way.
* :class:`Internal`: a module of ``tensorflow.python`` and the names used
  from it, for what TensorFlow offers no public API for.

A handle never lets an ``AttributeError`` out: when its target is missing
(at install, or an instance that lacks the attribute at run time), it raises
:class:`HookError` naming the entry and the versions for an ``error`` entry,
and otherwise answers ``available() == False`` (or a default) so the caller
takes its documented fallback.
"""
from __future__ import annotations

import contextlib
import importlib
import types
from typing import Callable, Sequence

from bps_tf.hooks import registry
from bps_tf.hooks.registry import HookError, HookMissing  # noqa: F401  (raised through here)

_ABSENT = object()


def code_names(function) -> set:
    """The attribute and global names the code of ``function`` uses,
    nested functions and comprehensions included."""
    function = getattr(function, "fget", function)
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    names, todo = set(), [code] if code is not None else []
    while todo:
        current = todo.pop()
        names.update(current.co_names)
        todo += [c for c in current.co_consts if isinstance(c, types.CodeType)]
    return names


def used_by(owner: Callable[[], type], attr: str, methods: Sequence[str], role: str):
    """A locator of private attribute ``attr`` of the class ``owner()``
    returns: found when one of ``methods`` defined in that class's MRO
    names it in its own code."""
    def locate():
        cls = owner()
        for klass in cls.__mro__:
            for method in methods:
                if method in vars(klass) and attr in code_names(vars(klass)[method]):
                    return klass, attr
        raise HookMissing(f"no {'/'.join(methods)} of {cls.__name__}'s MRO uses {attr!r}")
    locate.found_by = f"role: {role}, whose {'/'.join(methods)} sets or reads {attr}"
    return locate


def defined_by(owner: Callable[[], type], attr: str, role: str):
    """A locator of method ``attr``: the class of ``owner()``'s MRO that
    defines it."""
    def locate():
        return registry.defining_class(owner(), attr), attr
    locate.found_by = f"role: the class of {role}'s MRO that defines {attr}"
    return locate


class _Handle:
    def __init__(self, name: str):
        self.name = name

    def available(self) -> bool:
        """Whether the target is there (found now, once per process)."""
        return registry.locate_entry(self.name)

    def require(self, feature: str = "") -> None:
        """Raises HookError when the target is missing."""
        registry.require_entry(self.name, feature)

    def _gone(self, why: str, feature: str = "") -> None:
        registry.mark_missing(self.name, why)
        if registry.entry(self.name).when_missing == "error":
            self.require(feature)


class PrivateAttribute(_Handle):
    """A private attribute of Keras objects; see the module's docstring."""

    def __init__(self, name, group, owner, attr, methods, role, *, changes, why,
                 when_missing, feature=""):
        super().__init__(name)
        self.attr = attr
        registry.probe(name, group, used_by(owner, attr, methods, role), changes=changes,
                       why=why, when_missing=when_missing, kind="reads", feature=feature)

    def get(self, obj, default=None, feature: str = ""):
        """``obj``'s value, or ``default`` when the attribute moved (after
        HookError for an ``error`` entry)."""
        if not self.available():
            self.require(feature) if registry.entry(self.name).when_missing == "error" else None
            return default
        value = getattr(obj, self.attr, _ABSENT)
        if value is _ABSENT:
            self._gone(f"a {type(obj).__name__} has no {self.attr!r}", feature)
            return default
        return value

    def set(self, obj, value, feature: str = "") -> bool:
        """Sets it on ``obj``; False (or HookError) when the attribute moved."""
        if not self.available():
            self.require(feature) if registry.entry(self.name).when_missing == "error" else None
            return False
        if not hasattr(obj, self.attr):
            self._gone(f"a {type(obj).__name__} has no {self.attr!r}", feature)
            return False
        object.__setattr__(obj, self.attr, value)
        return True

    @contextlib.contextmanager
    def swapped(self, obj, value, feature: str = ""):
        """``obj``'s attribute reads ``value`` inside the block."""
        saved = self.get(obj, _ABSENT, feature)
        if saved is _ABSENT:
            yield False
            return
        object.__setattr__(obj, self.attr, value)
        try:
            yield True
        finally:
            object.__setattr__(obj, self.attr, saved)


class InstancePatch(_Handle):
    """A method replaced on single objects; see the module's docstring."""

    kind = "patches"

    def __init__(self, name, group, owner, attr, role, *, changes, why, when_missing,
                 private=None, feature=""):
        super().__init__(name)
        self.attr = attr
        registry.probe(name, group, defined_by(owner, attr, role), changes=changes, why=why,
                       when_missing=when_missing, kind=self.kind, feature=feature,
                       private=attr.startswith("_") if private is None else private)

    def original(self, obj):
        """``obj``'s method as its class defines it (bound)."""
        self.require()
        return getattr(obj, self.attr)

    def apply(self, obj, replacement) -> bool:
        """``obj.<attr>`` becomes ``replacement`` (this object only)."""
        if not self.available():
            self.require() if registry.entry(self.name).when_missing == "error" else None
            return False
        try:
            object.__setattr__(obj, self.attr, replacement)
        except (AttributeError, TypeError) as exc:    # a class with __slots__
            self._gone(f"a {type(obj).__name__} takes no attribute {self.attr!r} ({exc})")
            return False
        return True

    def remove(self, obj) -> None:
        """Back to the class's method."""
        try:
            object.__delattr__(obj, self.attr)
        except (AttributeError, TypeError):
            pass


class Method(InstancePatch):
    """A private method bps_tf calls (``original(obj)``), patching nothing."""

    kind = "uses"


class Internal(_Handle):
    """A TensorFlow internal module; ``handle.Name`` is the module's
    ``Name`` (one of ``uses``), or HookError when it moved."""

    def __init__(self, name, group, module, uses, *, changes, why, when_missing="error",
                 feature=""):
        super().__init__(name)
        object.__setattr__(self, "_module_path", module)
        object.__setattr__(self, "_uses", tuple(uses))

        def locate():
            try:
                found = importlib.import_module(module)
            except ImportError as exc:
                raise HookMissing(f"{module} cannot be imported ({exc})") from None
            gone = [u for u in uses if not hasattr(found, u)]
            if gone:
                raise HookMissing(f"{module} has no {', '.join(gone)}")
            return found, uses[0]
        locate.found_by = f"module {module} ({', '.join(uses)})"
        locate.keras_name = ""
        registry.probe(name, group, locate, changes=changes, why=why,
                       when_missing=when_missing, kind="imports", feature=feature)

    def __getattr__(self, attr):
        if attr.startswith("__") or attr not in self._uses:
            raise AttributeError(attr)   # a bug of bps_tf: every name used is declared
        if not self.available():
            self.require()
            return None
        return getattr(importlib.import_module(self._module_path), attr)
