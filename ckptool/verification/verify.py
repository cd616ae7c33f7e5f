"""verify: prove a checkpoint's weights load, and evaluate identically on CPU and every device.

With a model (``--model SPEC``) the checkpoint is loaded strictly — keys as stored, so a
``module.`` prefix fails with the command that fixes it — then evaluated in eval mode on a fixed
seeded input (and, for a model family with a test set such as ``training:``, that set). The CPU run
is the reference; on each requested device the weights must come back bit-identical after the
transfer and the outputs must agree within the tolerance of the model's dtype. Without a model,
every weight is materialized and sent to each device and back, and NaN/Inf are counted; on CPU
alone the bytes are streamed from the file without torch, and with ``against`` counted in the same
pass as the diff reads them (the checkpoint is read once). ``against`` compares with a second
checkpoint in any format (keys, dtypes, shapes, values; and, with a model, outputs).

The work is three steps: a :class:`VerifyPlan` settles everything from the arguments (the checkpoints
read, the SPEC, the input shape, the devices) and refuses bad ones before anything runs; the weight
checks (:mod:`ckptool.verification.weight_checks`) or the model checks (:mod:`ckptool.verification.model_checks`) fill a
:class:`VerifyReport`; then the ``against`` check, and :func:`~ckptool.verification.report.conclude`
states the verdict. Settings are deterministic while checking (:mod:`ckptool.verification.determinism`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ckptool.base import progress
from ckptool.base.errors import UsageError
from ckptool.base.suggest import Metavar, option, typed
from ckptool.base.torch_import import import_torch
from ckptool.files.byteio import use_storage_options
from ckptool.files.inputs import located
from ckptool.io.reader import load
from ckptool.model.checkpoint import Checkpoint
from ckptool.model.devices import Device, TorchDevice, open_devices, resolve_devices  # noqa: F401  (re-exported)
from ckptool.ops.diff import DiffReport, diff
from ckptool.ops.load_into import LoadMismatchError, LoadReport, load_into, model_name, to_state_dict
from ckptool.tensors.refs import check_expansion
from ckptool.verification.determinism import determinism_state, deterministic_settings  # noqa: F401  (re-exported)
from ckptool.verification.model_checks import (
    DEFAULT_TOLERANCES,
    Reference,
    check_device_with_model,
    compare_outputs,
    make_inputs,
    model_dtype,
    run_model,
)
from ckptool.verification.models import ModelSpec, parse_input_shape, parse_model_spec
from ckptool.verification.report import AgainstResult, DeviceResult, VerifyReport, conclude  # noqa: F401  (re-exported)
from ckptool.verification.weight_checks import (
    check_cpu_weights,
    check_cpu_weights_against,
    check_device_weights,
    nonfinite_in_state,
)

if TYPE_CHECKING:  # pragma: no cover - typing only; torch is imported lazily at run time
    from torch import nn

TEST_SET_SIZE = 1000  # samples of a model family's test set each device evaluates
MODEL_SEED = 0  # buffers a checkpoint does not hold (non-persistent) come out the same in every build

# How each checkpoint's keys meet the model. The checkpoint under test loads "strict" (keys as
# stored): verify proves it loads as it is, and a wrapper prefix is a finding, named with its fix.
# The --against checkpoint only supplies outputs to compare with, so its keys are fitted ("fix":
# a wrapper prefix stripped or added, as load_into does) and only a real mismatch is reported.
KeyPolicy = Literal["strict", "fix"]
CHECKPOINT_KEYS: KeyPolicy = "strict"
AGAINST_KEYS: KeyPolicy = "fix"


@dataclass(frozen=True)
class VerifyPlan:
    """What :func:`verify` checks, settled from its arguments before anything runs (:func:`run_plan` runs it).

    Attributes:
        checkpoint: the checkpoint under test, read (lazily: no tensor bytes yet).
        devices: where to check; ``cpu`` is the reference.
        spec: the model (None: the weights alone).
        input_shape: the seeded input's shape (with a model).
        against: the second checkpoint, read.
        atol, rtol: output tolerances (None: by the model's dtype); ``atol`` also bounds the
            ``against`` weight values (None: exact).
        allow_nonfinite: see :func:`verify`.
        test_set_size: samples of the model family's test set to evaluate (when it has one).
    """

    checkpoint: Checkpoint
    devices: list[Device]
    spec: ModelSpec | None = None
    input_shape: tuple[int, ...] | None = None
    against: Checkpoint | None = None
    atol: float | None = None
    rtol: float | None = None
    allow_nonfinite: bool | Sequence[str] = False
    test_set_size: int = 0

    @property
    def needs_torch(self) -> bool:
        """Weights-only on CPU needs no torch at all: it streams the bytes (the common pipeline check)."""
        return self.spec is not None or any(device.name != "cpu" for device in self.devices)

    @property
    def fuses_against(self) -> bool:
        """Weights only, CPU only, with --against: one pass over the checkpoint counts NaN/Inf and diffs."""
        return self.spec is None and self.against is not None and [d.name for d in self.devices] == ["cpu"]


def _is_folder(path: Path | str) -> bool:
    where = located(path)
    return not isinstance(where, Path) or where.is_dir()


def read_checked(
    path: Path | str,
    *,
    allow_globals: Sequence[str] = (),
    allow_expansion: bool = False,
    weights: str | None = None,
    variant: str | None = None,
) -> Checkpoint:
    """A checkpoint to verify, read (lazily: no tensor bytes yet); views expanding their storage are
    refused unless ``allow_expansion``, and so is a sparse or nested tensor torch.load refuses (its index
    parts read: :func:`ckptool.tensors.refs.check_wholes`)."""
    checkpoint = load(path, allow_globals=tuple(allow_globals), weights=weights, variant=variant)
    check_expansion(
        checkpoint.tensors if checkpoint.has_weights else {},
        allow=allow_expansion,
        path=checkpoint.path,
        doing="verify",
    )
    return checkpoint


def plan_model(
    model_spec: str | ModelSpec | None, model_args: Sequence[str] = (), input_shape: tuple[int, ...] | str | None = None
) -> tuple[ModelSpec | None, tuple[int, ...] | None]:
    """The model and the seeded input's shape (the family's default unless given), checked.

    Raises:
        UsageError: a bad SPEC or shape, model options without a model, or no shape for a model
            whose family has no default.
    """
    if model_spec is not None:
        import_torch("verifying a model")  # before a family's own module (which imports torch) is looked up
    spec = (
        model_spec
        if isinstance(model_spec, ModelSpec) or model_spec is None
        else parse_model_spec(model_spec, model_args)
    )
    if spec is None and (model_args or input_shape is not None):
        raise UsageError(
            option("model_args" if model_args else "input_shape", None)
            + " needs "
            + option("model_spec", Metavar("SPEC"))
        )
    shape = parse_input_shape(input_shape) if isinstance(input_shape, str) else input_shape
    if spec is not None and shape is None:
        shape = spec.default_input_shape
        if shape is None:
            raise UsageError(
                typed("model_spec", spec.text)
                + ": say the input shape with "
                + option("input_shape", None)
                + ", e.g. 1,3,224,224"
            )
    return spec, tuple(shape) if shape is not None else None


def verify(
    path: Path | str,
    *,
    model_spec: str | ModelSpec | None = None,
    model_args: Sequence[str] = (),
    devices: str | Sequence[str | Device] = "all",
    against: Path | str | None = None,
    input_shape: tuple[int, ...] | str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    allow_globals: tuple[str, ...] | list[str] = (),
    allow_expansion: bool = False,
    allow_nonfinite: bool | Sequence[str] = False,
    weights: str | None = None,
    against_weights: str | None = None,
    variant: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Prove a checkpoint loads and evaluates identically on CPU and every device.

    Args:
        path: any checkpoint ckptool reads.
        model_spec: ``torchvision:NAME``, ``training:NAME`` (a registered family) or
            ``package.module:factory`` (see :mod:`ckptool.verification.models`); without one only the weights are
            checked.
        model_args: extra ``k=v`` keyword arguments for the model builder.
        devices: ``"all"`` (:func:`ckptool.model.devices.available_devices`), a list like ``"cpu,cuda:0"``,
            or a sequence of names and :class:`~ckptool.model.devices.Device` objects (a device of your
            own, used as given: it moves the model and tensors there and waits for them).
        against: a second checkpoint (any format) that must hold the same weights.
        input_shape: the seeded input's shape (default: the model family's).
        atol, rtol: output tolerances (default: by the model's dtype, see :data:`DEFAULT_TOLERANCES`);
            ``atol`` is also the value tolerance of the ``against`` weight comparison (default exact).
        allow_globals: extra pickle globals to accept by name.
        allow_expansion: read views that expand their storage (stride 0, overlaps) past
            :data:`ckptool.tensors.refs.EXPANSION_FACTOR` in full; without it such a checkpoint is refused.
        allow_nonfinite: weights holding NaN or Inf fail the check unless allowed: ``True`` for
            all, or shell patterns of the keys that may (``["*.mask"]``: -inf attention masks).
        weights, against_weights: which set of weights of the checkpoint / of ``against`` to check
            (``"state_dict_ema"``; see :func:`ckptool.load`); None: the default one.
        variant: a model folder's weights variant to read in both (``"fp16"``; see :func:`ckptool.load`).

    Returns:
        A :class:`VerifyReport`; ``ok`` is False when the load or any check failed (weights
        holding NaN/Inf included, unless allowed). Unreadable input, a bad SPEC or an unknown
        device raise instead.

    Example:
        >>> report = ckptool.verify("model.pt", model_spec="training:lenet", devices="cpu")  # doctest: +SKIP
        >>> report.ok, report.devices[0].max_abs_err                                        # doctest: +SKIP
        (True, 0.0)
    """
    # the plan, in the order its arguments are judged: the checkpoint, the model, the devices, the other
    use_storage_options(storage_options)
    checkpoint = read_checked(
        path, allow_globals=allow_globals, allow_expansion=allow_expansion, weights=weights, variant=variant
    )
    spec, shape = plan_model(model_spec, model_args, input_shape)
    device_list = open_devices(devices)
    other = (
        read_checked(
            against,
            allow_globals=allow_globals,
            allow_expansion=allow_expansion,
            weights=against_weights,
            variant=variant if _is_folder(against) else None,  # a folder's variant; a file has none
        )
        if against is not None
        else None
    )
    return run_plan(
        VerifyPlan(
            checkpoint=checkpoint,
            devices=device_list,
            spec=spec,
            input_shape=shape,
            against=other,
            atol=atol,
            rtol=rtol,
            allow_nonfinite=allow_nonfinite,
            test_set_size=TEST_SET_SIZE,
        )
    )


def run_plan(plan: VerifyPlan) -> VerifyReport:
    """Run the checks a :class:`VerifyPlan` settled: the weight or the model checks, then ``against``."""
    with deterministic_settings() if plan.needs_torch else contextlib.nullcontext():
        reference: Reference | None = None
        weights: DiffReport | None = None
        if plan.spec is None:
            report, weights = _weight_checks(plan)
        else:
            report, reference = _model_checks(plan, plan.spec)
        if plan.against is not None and report.load.get("ok", False):
            report.against = _against_check(plan, plan.against, reference, weights)
    conclude(report, plan.allow_nonfinite)
    return report


# ---------------------------------------------------------------------------------------------- checks


def _weight_checks(plan: VerifyPlan) -> tuple[VerifyReport, DiffReport | None]:
    """Every device's weight row; with :attr:`VerifyPlan.fuses_against`, also the ``against`` weight
    diff, made in the same pass as the CPU row (returned, for :func:`_against_check`)."""
    checkpoint = plan.checkpoint
    tensors = checkpoint.tensors
    report = VerifyReport(
        path=str(checkpoint.path),
        format=checkpoint.format,
        ok=False,
        model=None,
        model_class=None,
        input_shape=None,
        dtype=None,
        atol=None,
        rtol=None,
        load={
            "ok": True,
            "tensors": len(tensors),
            "layout": list(checkpoint.layout or ()),
            "prefix": checkpoint.prefix,
        },
    )
    weights: DiffReport | None = None
    state_dict = to_state_dict(tensors) if plan.needs_torch else None
    for device in plan.devices:
        if device.name == "cpu" and plan.fuses_against:
            assert plan.against is not None
            with _reading(checkpoint, plan.against):
                row, weights = check_cpu_weights_against(checkpoint, plan.against, plan.atol)
            report.devices.append(row)
        elif device.name == "cpu":
            with _reading(checkpoint):
                report.devices.append(check_cpu_weights(tensors))
        else:
            assert state_dict is not None
            report.devices.append(check_device_weights(state_dict, device))
    nonfinite = {name for result in report.devices for name in result.nonfinite}
    if nonfinite:
        report.notes.append(f"{len(nonfinite)} weight tensor(s) hold NaN or Inf: {', '.join(sorted(nonfinite)[:5])}")
    return report, weights


def _reading(*checkpoints: Checkpoint) -> contextlib.AbstractContextManager[progress.Task]:
    """The progress of the CPU row: every weight byte of ``checkpoints`` streamed from the files."""
    total = sum(
        tensor.nbytes for checkpoint in checkpoints if checkpoint.has_weights for tensor in checkpoint.tensors.values()
    )
    return progress.task(total, "verify")


def _model_checks(plan: VerifyPlan, spec: ModelSpec) -> tuple[VerifyReport, Reference | None]:
    """Load strictly, run the CPU reference, then each device; None for the reference if the load failed."""
    checkpoint, shape = plan.checkpoint, plan.input_shape
    assert shape is not None
    model = _build(spec)
    report = VerifyReport(
        path=str(checkpoint.path),
        format=checkpoint.format,
        ok=False,
        model=spec.text,
        model_class=model_name(model),
        input_shape=shape,
        dtype=None,
        atol=plan.atol,
        rtol=plan.rtol,
        load={},
    )
    try:
        load_report = _load(model, checkpoint, CHECKPOINT_KEYS)
    except LoadMismatchError as e:
        report.load = {"ok": False, "diagnosis": e.diagnosis.to_json(), "error": str(e)}
        report.failure = str(e)
        return report, None
    report.load = load_report.to_json()
    if load_report.casts:
        report.notes.append(
            "the model converted weights on load: "
            + ", ".join(f"{count} {cast}" for cast, count in load_report.casts.items())
        )
    dtype = model_dtype(model)
    default_atol, default_rtol = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["F32"])
    report.dtype = dtype
    report.atol = default_atol if plan.atol is None else plan.atol
    report.rtol = default_rtol if plan.rtol is None else plan.rtol
    inputs = make_inputs(model, shape, test_set=spec.test_set, test_set_size=plan.test_set_size)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    try:
        outputs = run_model(model, inputs)
    except (RuntimeError, TypeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            typed("model_spec", spec.text) + ": the model fails on an input of shape "
            f"{','.join(map(str, shape))} ({first}) — pass the right " + option("input_shape", None)
        ) from e
    reference = Reference(inputs, outputs, state, report.atol, report.rtol)
    report.devices = [check_device_with_model(model, reference, device) for device in plan.devices]
    if report.devices:  # the loaded weights themselves, counted once on the CPU copy
        report.devices[0].nonfinite.update(nonfinite_in_state(state))
    return report, reference


def _against_check(
    plan: VerifyPlan, other: Checkpoint, reference: Reference | None, weights: DiffReport | None
) -> AgainstResult:
    """The weight diff with ``other`` (unless the weight checks made it already) and, with a model,
    ``other`` loaded into a second copy and run on the reference's inputs."""
    if weights is None:
        weights = diff(plan.checkpoint, other, atol=plan.atol or 0.0, align_prefixes=True)
    result = AgainstResult(path=str(other.path), format=other.format, ok=weights.identical, diff=weights)
    if reference is None or plan.spec is None:
        return result
    model = _build(plan.spec)
    try:
        _load(model, other, AGAINST_KEYS)
    except LoadMismatchError as e:
        result.ok, result.error = False, f"does not load into {e.diagnosis.model}: {e.diagnosis.message}"
        return result
    comparison = compare_outputs(
        run_model(model, reference.inputs), reference.outputs, atol=reference.atol, rtol=reference.rtol
    )
    result.record(comparison)
    result.ok = result.ok and comparison.within
    return result


def _build(spec: ModelSpec) -> nn.Module:
    import torch

    torch.manual_seed(MODEL_SEED)
    return spec.build()


def _load(model: nn.Module, checkpoint: Checkpoint, keys: KeyPolicy) -> LoadReport:
    """Load ``checkpoint`` into ``model`` as ``keys`` says (see :data:`CHECKPOINT_KEYS`), ready to evaluate.

    Raises:
        LoadMismatchError: the keys or shapes do not fit.
    """
    report = load_into(model, checkpoint, fix=keys == "fix")
    model.eval()
    return report
