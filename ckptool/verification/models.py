"""Model SPECs: the network ``ckptool verify --model`` loads a checkpoint into.

Three kinds:

- ``torchvision:NAME`` — any torchvision model builder, randomly initialised (weights are never
  downloaded: the checkpoint provides them), e.g. ``torchvision:resnet18?num_classes=10``.
- ``FAMILY:NAME`` — a registered model family: its builders take no arguments and it says its
  input shape (and may offer a labelled test set, for an accuracy). Installed packages offer
  families through the entry-point group :data:`ENTRY_POINT_GROUP` (this project's training runs
  offer ``training:lenet|mlp|resnet18`` that way); code can call :func:`register`. ckptool imports
  no family itself: an entry point is loaded only when a SPEC names its family.
- ``package.module:factory`` — the user's own code: the module is imported (from the current
  directory or the installed packages) and ``factory(**kwargs)`` is called. That runs the user's
  code on purpose; the checkpoint itself is still never unpickled.

Keyword arguments follow ``?`` (``?num_classes=10&dropout=0.1``) or come from ``--model-arg k=v``;
values are parsed as int, float, bool or None when they look like one.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptool.base.errors import MissingExtraError, UsageError
from ckptool.base.suggest import Option, Wording, given, option, typed
from ckptool.base.torch_import import INSTALL

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from torch import nn

# Packages offer model families here: `[project.entry-points."ckptool.models"] NAME = "pkg.mod:fn"`,
# the entry point's name being the family's; loading it and calling ``fn()`` must :func:`register` it.
ENTRY_POINT_GROUP = "ckptool.models"
# a model family's labelled test set: test_set(size) -> (inputs, labels)
TestSet = Callable[[int], "tuple[torch.Tensor, torch.Tensor]"]
# torchvision builders by module: the input shape they are usually called with
TORCHVISION_INPUT_SHAPES = {
    "torchvision.models.video": (1, 3, 16, 112, 112),
    "torchvision.models.segmentation": (1, 3, 224, 224),
    "torchvision.models": (1, 3, 224, 224),  # classification
}
# builders that take a list of images or image pairs, not one tensor
UNSUPPORTED_TORCHVISION = (
    "torchvision.models.detection",
    "torchvision.models.optical_flow",
    "torchvision.models.quantization",
)
# builder arguments that would download pretrained weights
DOWNLOAD_ARGUMENTS = ("weights", "weights_backbone", "pretrained", "pretrained_backbone")
_PYTHON_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
HELP = (
    "torchvision:NAME[?k=v&...], training:lenet|mlp|resnet18, or package.module:factory "
    "(your own code, imported and called on purpose)"
)


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``--model`` SPEC: which family, which builder, which keyword arguments.

    Attributes:
        text: the SPEC as given.
        family: ``torchvision``, ``python`` (user code), or a registered family's name (``training``).
        name: the builder's name (``resnet18``) or ``module:factory`` for user code.
        kwargs: keyword arguments for the builder.
        default_input_shape: the input the family's models take (None: ask for ``--input-shape``).
        test_set: a registered family's labelled test set, ``test_set(size)`` -> ``(inputs, labels)``.

    Example:
        >>> spec = parse_model_spec("torchvision:resnet18?num_classes=10")
        >>> spec.family, spec.name, spec.kwargs, spec.default_input_shape
        ('torchvision', 'resnet18', {'num_classes': 10}, (1, 3, 224, 224))
    """

    text: str
    family: str
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    default_input_shape: tuple[int, ...] | None = None
    test_set: TestSet | None = field(default=None, compare=False, repr=False)

    def build(self) -> nn.Module:
        """A fresh model, on CPU (initialisation follows torch's global RNG).

        Raises:
            UsageError: the builder is unknown, rejects the arguments, or does not return a module.
        """
        if self.family == "torchvision":
            model = _build_torchvision(self)
        elif self.family == "python":
            model = _build_python(self)
        else:
            model = _registered_family(self.family, self.text).build(self.name)
        from torch import nn

        if not isinstance(model, nn.Module):
            raise UsageError(
                typed("model_spec", self.text) + f": the factory returned {type(model).__name__}, not a torch.nn.Module"
            )
        return model


def parse_value(text: str) -> Any:
    """``"10"`` -> 10, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"none"`` -> None, anything else stays text."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_kwargs(pairs: Iterable[str], *, where: str | Option | Wording) -> dict[str, Any]:
    """``["num_classes=10", "dropout=0.1"]`` -> ``{"num_classes": 10, "dropout": 0.1}``."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UsageError(where + f" {pair!r} is not NAME=VALUE, e.g. num_classes=10")
        kwargs[key] = parse_value(value)
    return kwargs


def parse_input_shape(text: str) -> tuple[int, ...]:
    """``"1,3,224,224"`` (or ``1x3x224x224``) -> ``(1, 3, 224, 224)``."""
    parts = [p.strip() for p in re.split(r"[,x×]", text.strip()) if p.strip()]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(given("input_shape", text) + " is not a list of positive sizes, e.g. 1,3,224,224")
    return shape


def parse_model_spec(spec: str, model_args: Iterable[str] = ()) -> ModelSpec:
    """Parse and check a ``--model`` SPEC (nothing is built; user code is imported only by ``build``).

    Raises:
        UsageError: the SPEC is malformed or names a model that does not exist.
    """
    text = spec.strip()
    head, _, query = text.partition("?")
    family, sep, name = head.partition(":")
    family, name = family.strip(), name.strip()
    if not sep or not family or not name:
        raise UsageError(given("model_spec", spec) + f" is not a model SPEC — use {HELP}")
    kwargs = parse_kwargs(query.split("&") if query else [], where=given("model_spec", spec) + ": argument")
    kwargs.update(parse_kwargs(model_args, where=option("model_args", None)))
    if family == "torchvision":
        return _torchvision_spec(text, name, kwargs)
    registered = _find_family(family, text)
    if registered is not None:
        return registered.spec(text, name, kwargs)
    if not _PYTHON_NAME.match(family) or not _PYTHON_NAME.match(name):
        raise UsageError(given("model_spec", spec) + f": {family}:{name} is not package.module:factory — use {HELP}")
    return ModelSpec(text=text, family="python", name=f"{family}:{name}", kwargs=kwargs)


# ------------------------------------------------------------------------------------------- families


@dataclass(frozen=True)
class ModelFamily:
    """Models a package offers under ``FAMILY:NAME`` (see :func:`register`).

    Attributes:
        name: the family's SPEC prefix (``training``).
        builders: model name -> a function of no arguments returning a fresh ``nn.Module`` on CPU.
        input_shape: the input the family's models take, batch dimension included.
        test_set: ``test_set(size)`` -> ``(inputs, labels)``, a fixed labelled set the models were
            trained for; verify reports the accuracy on it (None: no accuracy).
    """

    name: str
    builders: Mapping[str, Callable[[], nn.Module]]
    input_shape: tuple[int, ...] | None = None
    test_set: TestSet | None = None

    def spec(self, text: str, name: str, kwargs: Mapping[str, Any]) -> ModelSpec:
        """The SPEC ``text`` naming this family's model ``name`` (checked to exist; no arguments)."""
        if name not in self.builders:
            raise UsageError(
                typed("model_spec", text) + f": unknown {self.name} model {name!r} — choose one of: "
                f"{', '.join(self.builders)}"
            )
        if kwargs:
            raise UsageError(
                typed("model_spec", text) + f": {self.name} models take no arguments (got {', '.join(kwargs)})"
            )
        return ModelSpec(
            text=text,
            family=self.name,
            name=name,
            kwargs={},
            default_input_shape=self.input_shape,
            test_set=self.test_set,
        )

    def build(self, name: str) -> nn.Module:
        return self.builders[name]()


_FAMILIES: dict[str, ModelFamily] = {}
_RESERVED = ("torchvision", "python")


def register(
    family: str,
    builders: Mapping[str, Callable[[], nn.Module]],
    *,
    input_shape: tuple[int, ...] | None = None,
    test_set: TestSet | None = None,
) -> None:
    """Offer ``builders`` as ``FAMILY:NAME`` model SPECs (registering a family again replaces it).

    A package calls this from the function its ``ckptool.verification.models`` entry point names (so that an
    installed package is found without anyone importing it), or when it is imported.

    Args:
        family: the SPEC prefix, a Python identifier other than ``torchvision`` and ``python``.
        builders: model name -> a function of no arguments returning a fresh model on CPU.
        input_shape: the models' input shape with the batch dimension, e.g. ``(1, 1, 28, 28)``.
        test_set: ``test_set(size)`` -> ``(inputs, labels)`` for an accuracy (optional).

    Raises:
        ValueError: ``family`` is not an identifier, or is one of the built-in kinds.

    Example:
        >>> register("mine", {"tiny": lambda: torch.nn.Linear(3, 2)}, input_shape=(1, 3))  # doctest: +SKIP
        >>> parse_model_spec("mine:tiny").default_input_shape                              # doctest: +SKIP
        (1, 3)
    """
    if not family.isidentifier() or family in _RESERVED:
        raise ValueError(f"model family {family!r}: the name must be an identifier other than {', '.join(_RESERVED)}")
    _FAMILIES[family] = ModelFamily(
        family, dict(builders), None if input_shape is None else tuple(input_shape), test_set
    )


def registered_family(name: str) -> ModelFamily | None:
    """The family registered (or offered by an installed package) under ``name``; None if there is none."""
    return _find_family(name, name)


def _find_family(name: str, text: str) -> ModelFamily | None:
    """The family ``name``: registered already, or offered by an entry point (loaded now, that one only)."""
    if name in _FAMILIES:
        return _FAMILIES[name]
    from importlib.metadata import entry_points

    for entry_point in entry_points(group=ENTRY_POINT_GROUP, name=name):
        try:
            entry_point.load()()
        except Exception as e:  # the package's code failed: a usage problem of this SPEC, not a ckptool bug
            raise UsageError(
                typed("model_spec", text) + f": the {name} models could not be loaded from "
                f"{entry_point.value} ({type(e).__name__}: {e}) — reinstall the package that "
                "offers them"
            ) from e
        if name not in _FAMILIES:
            raise UsageError(
                typed("model_spec", text)
                + f": {entry_point.value} did not register the {name} models — reinstall the package "
                "that offers them"
            )
        return _FAMILIES[name]
    return None


def _registered_family(name: str, text: str) -> ModelFamily:
    found = _find_family(name, text)
    if found is None:
        raise UsageError(typed("model_spec", text) + f": no model family {name!r} is installed")
    return found


# ------------------------------------------------------------------------------------------- torchvision


def _torchvision_builder(text: str, name: str) -> Any:
    try:
        from torchvision import models  # type: ignore[import-untyped]  # torchvision ships no type information
    except ImportError as e:
        raise MissingExtraError(typed("model_spec", text) + f": torchvision is not installed — {INSTALL}") from e
    try:
        return models.get_model_builder(name)
    except ValueError:
        close = difflib.get_close_matches(name, models.list_models(), n=3)
        hint = f" — did you mean {', '.join(close)}?" if close else " — see torchvision.models.list_models()"
        raise UsageError(typed("model_spec", text) + f": torchvision has no model {name!r}{hint}") from None


def _torchvision_spec(text: str, name: str, kwargs: dict[str, Any]) -> ModelSpec:
    builder = _torchvision_builder(text, name)
    module = builder.__module__
    if module.startswith(UNSUPPORTED_TORCHVISION):
        raise UsageError(
            typed("model_spec", text) + f": {module.split('.')[2]} models take lists of images, not one tensor — "
            "verify supports models called with one input tensor"
        )
    downloads = [key for key in DOWNLOAD_ARGUMENTS if kwargs.get(key) not in (None, False)]
    if downloads:
        raise UsageError(
            typed("model_spec", text) + f": {downloads[0]}= would download weights — the checkpoint provides them; "
            f"drop {downloads[0]}"
        )
    shape = next(shape for prefix, shape in TORCHVISION_INPUT_SHAPES.items() if module.startswith(prefix))
    return ModelSpec(text=text, family="torchvision", name=name, kwargs=kwargs, default_input_shape=shape)


def _build_torchvision(spec: ModelSpec) -> nn.Module:
    builder = _torchvision_builder(spec.text, spec.name)
    parameters = inspect.signature(builder).parameters
    kwargs = dict(spec.kwargs)
    for key in DOWNLOAD_ARGUMENTS:
        if key in parameters:
            kwargs.setdefault(key, None)  # never download: random init, the checkpoint fills it
    try:
        return builder(**kwargs)
    except (TypeError, ValueError) as e:
        raise UsageError(
            typed("model_spec", spec.text) + f": torchvision's {spec.name} rejected the arguments ({e})"
        ) from e


# ------------------------------------------------------------------------------------------- user code


def _build_python(spec: ModelSpec) -> nn.Module:
    module_name, _, attribute = spec.name.partition(":")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:  # `ckptool` is a console script: make the user's own package importable from where they are
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(
            typed("model_spec", spec.text) + f": cannot import {module_name} ({e}) — run from the directory "
            "holding it or install it"
        ) from e
    except Exception as e:  # the user's module failed while importing
        raise UsageError(
            typed("model_spec", spec.text) + f": importing {module_name} failed: {type(e).__name__}: {e}"
        ) from e
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    factory: Any = module
    for part in attribute.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            hint = ""
            if "." not in module_name:  # FAMILY:NAME read as module:function because no such family is installed
                hint = (
                    f" — and no model family {module_name!r} is installed (families come from installed "
                    f"packages' {ENTRY_POINT_GROUP!r} entry points); name a function as package.module:function"
                )
            raise UsageError(typed("model_spec", spec.text) + f": {module_name} has no {attribute}{hint}")
    if not callable(factory):
        raise UsageError(typed("model_spec", spec.text) + f": {module_name}.{attribute} is not callable")
    try:
        return factory(**spec.kwargs)
    except Exception as e:
        raise UsageError(typed("model_spec", spec.text) + f": {attribute}(...) failed: {type(e).__name__}: {e}") from e
