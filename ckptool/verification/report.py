"""What ``verify`` found: one row per device, the ``--against`` comparison, and the verdict with the
one line that says what failed first (:func:`conclude`)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptool.base.suggest import Metavar, Option, Wording, keyword, option
from ckptool.ops.diff import DiffReport, json_float


@dataclass
class Comparison:
    """Outputs of one run against the reference."""

    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    within: bool = True
    agree: int = 0
    rows: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def argmax_agreement(self) -> float | None:
        return self.agree / self.rows if self.rows else None


@dataclass(kw_only=True)
class OutputAgreement:
    """How far a run's outputs are from the reference's (None: no model was run).

    Attributes:
        max_abs_err / max_rel_err: largest output difference (relative to ``|reference|``).
        within_tolerance: every output within ``atol + rtol * |reference|``.
        error: what went wrong, when something did.
    """

    max_abs_err: float | None = None
    max_rel_err: float | None = None
    within_tolerance: bool | None = None
    error: str | None = None

    def record(self, comparison: Comparison) -> None:
        """Take the errors and the verdict of an output comparison."""
        self.max_abs_err, self.max_rel_err = comparison.max_abs_err, comparison.max_rel_err
        self.within_tolerance = comparison.within


@dataclass(kw_only=True)
class DeviceResult(OutputAgreement):
    """One device's verdict.

    Attributes:
        weights_identical: every weight is bit-identical after the round trip to the device.
        max_abs_err / max_rel_err: largest output difference against the CPU reference
            (relative to ``|reference|``); None without a model.
        argmax_agreement: share of output rows whose argmax matches the reference (classification).
        accuracy: on the model family's test set (``training:`` models).
        nonfinite: ``{name: {"nan": n, "inf": m}}`` for weights holding NaN/Inf (counted on the device).
    """

    device: str
    ok: bool
    weights_identical: bool
    argmax_agreement: float | None = None
    accuracy: float | None = None
    differing_weights: list[str] = field(default_factory=list)
    nonfinite: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "ok": self.ok,
            "weights_identical": self.weights_identical,
            "max_abs_err": json_float(self.max_abs_err),
            "max_rel_err": json_float(self.max_rel_err),
            "argmax_agreement": self.argmax_agreement,
            "accuracy": self.accuracy,
            "within_tolerance": self.within_tolerance,
            "differing_weights": list(self.differing_weights),
            "nonfinite": dict(self.nonfinite),
            "error": self.error,
        }


@dataclass(kw_only=True)
class AgainstResult(OutputAgreement):
    """The comparison with ``--against``: the weight diff and, with a model, both models' outputs."""

    path: str
    format: str
    ok: bool
    diff: DiffReport

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "ok": self.ok,
            "identical": self.diff.identical,
            "weights": self.diff.to_json(),
            "outputs": None
            if self.within_tolerance is None
            else {
                "max_abs_err": json_float(self.max_abs_err),
                "max_rel_err": json_float(self.max_rel_err),
                "within_tolerance": self.within_tolerance,
            },
            "error": self.error,
        }


@dataclass
class VerifyReport:
    """Everything ``ckptool verify`` found; ``ok`` only if the load and every check passed.

    Attributes:
        load: :meth:`LoadReport.to_json` on success; ``{"ok": false, "diagnosis": ...}`` on a mismatch.
        failure: one line saying what failed first (None when ok), an option it asks for spelled
            as the API's keyword argument; :meth:`failure_text` spells it another way (the CLI's flag).
    """

    path: str
    format: str
    ok: bool
    model: str | None
    model_class: str | None
    input_shape: tuple[int, ...] | None
    dtype: str | None
    atol: float | None
    rtol: float | None
    load: dict[str, Any]
    devices: list[DeviceResult] = field(default_factory=list)
    against: AgainstResult | None = None
    failure: str | None = None
    notes: list[str] = field(default_factory=list)
    failure_wording: Wording | None = field(default=None, repr=False)

    def fail(self, failure: str | Wording) -> None:
        """Record ``failure`` as the first thing that failed."""
        self.failure = str(failure)
        self.failure_wording = failure if isinstance(failure, Wording) else None

    def failure_text(self, spell: Callable[[Option], str] = keyword) -> str | None:
        """:attr:`failure` with each option it asks for spelled by ``spell``."""
        return self.failure_wording.render(spell) if self.failure_wording is not None else self.failure

    def to_json(self, spell: Callable[[Option], str] = keyword) -> dict[str, Any]:
        """The --json object; ``spell`` spells the options the failure asks for."""
        return {
            "ok": self.ok,
            "path": self.path,
            "format": self.format,
            "model": self.model,
            "model_class": self.model_class,
            "input_shape": list(self.input_shape) if self.input_shape else None,
            "dtype": self.dtype,
            "atol": self.atol,
            "rtol": self.rtol,
            "load": self.load,
            "devices": [result.to_json() for result in self.devices],
            "against": self.against.to_json() if self.against is not None else None,
            "failure": self.failure_text(spell),
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------- the verdict


def conclude(report: VerifyReport, allow_nonfinite: bool | Sequence[str] = False) -> None:
    """Set ``report.ok`` and ``report.failure`` (the first failure: a device, ``--against``, no device,
    then weights holding NaN/Inf that ``allow_nonfinite`` does not allow)."""
    if not report.load.get("ok", False):
        report.ok = False
        return
    failures = [_device_failure(result, report.atol, report.rtol) for result in report.devices if not result.ok]
    if report.against is not None and not report.against.ok:
        failures.append(_against_failure(report.against))
    if not report.devices:
        failures.append("no device to verify on")
    nonfinite = _nonfinite_failure(report, allow_nonfinite)
    if nonfinite is not None:
        failures.append(nonfinite)
    report.ok = not failures
    if failures:
        report.fail(failures[0])


_PATTERN = Metavar("PATTERN")


def _nonfinite_failure(report: VerifyReport, allow: bool | Sequence[str]) -> Wording | None:
    """The failure line for weights holding NaN/Inf that the caller did not allow (None: none)."""
    if allow is True:
        return None
    patterns = () if allow is False else tuple(allow)
    counts: dict[str, dict[str, int]] = {}
    for result in report.devices:
        for name, count in result.nonfinite.items():
            if not any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
                counts.setdefault(name, count)
    if not counts:
        return None
    names = sorted(counts)
    shown = ", ".join(f"{name} ({counts[name]['nan']} NaN, {counts[name]['inf']} Inf)" for name in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (
        f"{len(names)} weight tensor(s) hold NaN or Inf: {shown}{more} — the weights are broken, or pass "
        + option("allow_nonfinite")
        + " (or "
        + option("allow_nonfinite", [_PATTERN])
        + ") if they hold them "
        "on purpose, e.g. -inf masks"
    )


def _device_failure(result: DeviceResult, atol: float | None, rtol: float | None) -> str | Wording:
    if result.error and not result.weights_identical and not result.differing_weights:
        return f"{result.device}: {result.error}"
    if result.differing_weights:
        names = ", ".join(result.differing_weights[:3]) + (", ..." if len(result.differing_weights) > 3 else "")
        return f"{result.device}: weights changed in the transfer to the device ({names})"
    if result.error:
        return f"{result.device}: {result.error}"
    return (
        f"{result.device}: outputs differ from the CPU reference beyond atol {atol:g} / rtol {rtol:g} "
        f"(max abs err {result.max_abs_err:.3g}) — rerun with "
        + option("atol", None)
        + "/"
        + option("rtol", None)
        + " if that is expected"
    )


def _against_failure(result: AgainstResult) -> str:
    weights = result.diff
    if result.error:
        return f"against {result.path}: {result.error}"
    if weights.only_in_a or weights.only_in_b:
        return (
            f"against {result.path}: the weight keys differ ({len(weights.only_in_a)} only in this checkpoint, "
            f"{len(weights.only_in_b)} only in the other)"
        )
    if weights.changed:
        change = weights.changed[0]
        what = " and ".join(change.kinds)
        detail = f", max abs diff {change.max_abs_diff:.3g}" if change.max_abs_diff is not None else ""
        more = f" (and {len(weights.changed) - 1} more)" if len(weights.changed) > 1 else ""
        return f"against {result.path}: {change.name} differs in {what}{detail}{more}"
    return (
        f"against {result.path}: the model's outputs differ beyond the tolerance (max abs err {result.max_abs_err:.3g})"
    )


def error_line(error: BaseException) -> str:
    """A device's failure as one line: ``RuntimeError: CUDA out of memory...`` (the first line only)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
