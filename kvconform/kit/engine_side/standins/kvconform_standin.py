"""What kvconform's stand-in packages share (torchvision here, sgl_kernel beside the SGLang
server adapter): a package every `import pkg` / `import pkg.<anything>` of which succeeds, whose
names are placeholders, and whose placeholders raise when called. Loaded as a top-level module
from this folder, which is on the engine's path whenever a stand-in is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import NoReturn

Refusal = Callable[[str], RuntimeError]  # the error a call of the named symbol raises


class Placeholder:
    """A name of a stand-in package: importable, inspectable, never usable."""

    def __init__(self, qualname: str, refuse: Refusal) -> None:
        self._qualname = qualname
        self._refuse = refuse

    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._qualname}.{attr}", self._refuse)

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        raise self._refuse(self._qualname)

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)  # `class X(pkg.Y)` at import time

    def __repr__(self) -> str:
        return f"<kvconform stand-in {self._qualname}>"


def module_getattr(module_name: str, refuse: Refusal) -> Callable[[str], Placeholder]:
    """A module's `__getattr__` (PEP 562) that answers every name with a placeholder."""

    def __getattr__(attr: str) -> Placeholder:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{module_name}.{attr}", refuse)

    return __getattr__


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Synthesises any `<package>.<sub>` module as a package of placeholders."""

    def __init__(self, package: str, refuse: Refusal) -> None:
        self.package = package
        self.refuse = refuse

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = module_getattr(spec.name, self.refuse)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def stand_in(package: str, refuse: Refusal) -> Callable[[str], Placeholder]:
    """Make `package`'s submodules stand-ins too; returns the package's own `__getattr__`."""
    if not any(isinstance(f, _Submodules) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(_Submodules(package, refuse))
    return module_getattr(package, refuse)
