"""verify: prove a checkpoint's weights load, and evaluate identically on CPU and every device.

With a model (``--model SPEC``) the checkpoint is loaded strictly — keys as stored, so a
``module.`` prefix fails with the command that fixes it — then evaluated in eval mode on a fixed
seeded input (and, for ``training:`` models, the project's synthetic test set). The CPU run is the
reference; on each requested device the weights must come back bit-identical after the transfer
and the outputs must agree within the tolerance of the model's dtype. Without a model, every
weight is materialized and sent to each device and back, and NaN/Inf are counted; on CPU alone the
bytes are streamed from the file without torch, and with ``against`` counted in the same pass as the
diff reads them (the checkpoint is read once). ``against`` compares with a second checkpoint in any
format (keys, dtypes, shapes, values; and, with a model, outputs).

Settings are deterministic while verifying (TF32 off for matmul and cuDNN, cuDNN deterministic,
no benchmark autotuning) and restored afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import devices as devices_
from .checkpoint import Checkpoint
from .comparison import (
    ChunkCallback,
    DiffReport,
    OpenFiles,
    diff,
    json_float,
    tensor_chunks,
)
from .errors import UsageError
from .materialize import LoadMismatchError, load_into, to_state_dict
from .models import ModelSpec, parse_model_spec
from .reader import load
from .refs import TensorRef, check_expansion

if TYPE_CHECKING:  # pragma: no cover - typing only; torch is imported lazily at run time
    import torch
    from torch import nn

# (atol, rtol) by the dtype the model computes in; outputs agree when |a - b| <= atol + rtol * |b|
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "F64": (1e-10, 1e-7),
    "F32": (1e-5, 1e-4),
    "F16": (1e-3, 1e-2),
    "BF16": (1e-2, 5e-2),
}
INPUT_SEED = 0  # the seeded input every device sees
TEST_SET_SEED = 0  # the training runs' default seed: the synthetic test split they evaluate on
TEST_SET_SIZE = 1000
EVAL_BATCH = 250


# ---------------------------------------------------------------------------------------------- reports


@dataclass
class DeviceResult:
    """One device's verdict.

    Attributes:
        weights_identical: every weight is bit-identical after the round trip to the device.
        max_abs_err / max_rel_err: largest output difference against the CPU reference
            (relative to ``|reference|``); None without a model.
        argmax_agreement: share of output rows whose argmax matches the reference (classification).
        accuracy: on the synthetic test set (``training:`` models).
        nonfinite: ``{name: {"nan": n, "inf": m}}`` for weights holding NaN/Inf (counted on the device).
    """

    device: str
    ok: bool
    weights_identical: bool
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    argmax_agreement: float | None = None
    accuracy: float | None = None
    within_tolerance: bool | None = None
    differing_weights: list[str] = field(default_factory=list)
    nonfinite: dict[str, dict[str, int]] = field(default_factory=dict)
    error: str | None = None

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


@dataclass
class AgainstResult:
    """The comparison with ``--against``: the weight diff and, with a model, both models' outputs."""

    path: str
    format: str
    ok: bool
    diff: DiffReport
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    within_tolerance: bool | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "ok": self.ok,
            "identical": self.diff.identical,
            "weights": self.diff.to_json(),
            "outputs": None if self.within_tolerance is None else {
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
        failure: one line saying what failed first (None when ok).
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

    def to_json(self) -> dict[str, Any]:
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
            "failure": self.failure,
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------- device hooks


def _to_device(value: Any, device: str) -> Any:
    """Move a module or tensor to ``device`` (tests substitute this to run a "cuda:N" row on CPU)."""
    return value.to(device)


def _synchronize(tensors: Iterator[torch.Tensor] | Sequence[torch.Tensor]) -> None:
    """Wait for the devices the tensors live on, so a kernel's failure surfaces here and not later."""
    import torch

    waited: set[str] = set()
    for tensor in tensors:
        device = tensor.device
        if str(device) in waited:
            continue
        waited.add(str(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "mps":
            torch.mps.synchronize()


def resolve_devices(devices: str | Sequence[str]) -> list[str]:
    """``"all"`` -> every available device; ``"cpu,cuda:0"`` -> that list, each checked to exist here.

    Raises:
        UsageError: a device is malformed or not available on this machine.
    """
    available = list(devices_.available_devices())
    if isinstance(devices, str):
        requested = [part.strip() for part in devices.split(",") if part.strip()]
    else:
        requested = [str(part).strip() for part in devices]
    if not requested:
        raise UsageError("--devices is empty — pass all, or a list like cpu,cuda:0")
    if requested == ["all"]:
        return available
    resolved: list[str] = []
    for device in requested:
        tag = devices_.normalize_location(device)
        if tag in ("cuda", "xpu"):
            tag += ":0"
        if tag not in available:
            raise UsageError(f"--devices: {tag} is not available on this machine (available: {', '.join(available)})")
        if tag not in resolved:
            resolved.append(tag)
    return resolved


# ---------------------------------------------------------------------------------------------- determinism


def _precision_attributes() -> list[tuple[Any, str]]:
    import torch

    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9: reading the legacy flags may raise
        owners = [backends.cuda.matmul, getattr(backends.cudnn, "conv", None), getattr(backends.cudnn, "rnn", None)]
        return [(owner, "fp32_precision") for owner in owners if hasattr(owner, "fp32_precision")]
    return [(backends.cuda.matmul, "allow_tf32"), (backends.cudnn, "allow_tf32")]


def determinism_state() -> dict[str, Any]:
    """The settings :func:`deterministic_settings` changes, as they are now."""
    import torch

    state = {f"{type(owner).__name__}.{name}": getattr(owner, name) for owner, name in _precision_attributes()}
    state["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    state["cudnn.deterministic"] = torch.backends.cudnn.deterministic
    state["cudnn.benchmark"] = torch.backends.cudnn.benchmark
    return state


@contextlib.contextmanager
def deterministic_settings() -> Iterator[None]:
    """TF32 off (matmul and cuDNN), cuDNN deterministic, no benchmark autotuning; restored on exit."""
    import torch

    attributes = _precision_attributes()
    saved = [getattr(owner, name) for owner, name in attributes]
    saved_precision = torch.get_float32_matmul_precision()
    saved_deterministic = torch.backends.cudnn.deterministic
    saved_benchmark = torch.backends.cudnn.benchmark
    try:
        torch.set_float32_matmul_precision("highest")
        for owner, name in attributes:
            setattr(owner, name, "ieee" if name == "fp32_precision" else False)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        yield
    finally:
        torch.set_float32_matmul_precision(saved_precision)
        for (owner, name), value in zip(attributes, saved):
            setattr(owner, name, value)
        torch.backends.cudnn.deterministic = saved_deterministic
        torch.backends.cudnn.benchmark = saved_benchmark


# ---------------------------------------------------------------------------------------------- tensors


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included), unlike ``torch.equal``."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(a.detach().contiguous().reshape(-1).view(_byte_view(a)).equal(
        b.detach().contiguous().reshape(-1).view(_byte_view(b))))


def _byte_view(tensor: torch.Tensor) -> torch.dtype:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(tensor.element_size(), torch.uint8)


def flatten_outputs(output: Any, name: str = "output") -> dict[str, torch.Tensor]:
    """Every tensor in a model's output (tensor, tuple, namedtuple, dict), named by its path."""
    import torch

    if isinstance(output, torch.Tensor):
        return {name: output}
    flat: dict[str, torch.Tensor] = {}
    if isinstance(output, Mapping):
        for key, value in output.items():
            flat.update(flatten_outputs(value, f"{name}.{key}"))
    elif isinstance(output, list | tuple):
        for index, value in enumerate(output):
            flat.update(flatten_outputs(value, f"{name}[{index}]"))
    return flat


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


def compare_outputs(outputs: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], *, atol: float,
                    rtol: float) -> Comparison:
    """Max abs/rel error, allclose-style tolerance (NaN equals NaN) and argmax agreement."""
    import torch

    result = Comparison()
    for name, expected in reference.items():
        actual = outputs.get(name)
        if actual is None or actual.shape != expected.shape:
            result.within = False
            got = "nothing" if actual is None else f"shape {list(actual.shape)}"
            result.problems.append(f"{name}: expected shape {list(expected.shape)}, got {got}")
            continue
        if not (expected.is_floating_point() or expected.is_complex()):
            equal = torch.equal(actual.cpu(), expected)
            result.within &= equal
            if not equal:
                result.max_abs_err = max(result.max_abs_err, float((actual.double() - expected.double()).abs().max()))
            continue
        a, b = actual.double(), expected.double()
        difference = (a - b).abs()
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        difference = torch.where(same, torch.zeros_like(difference), difference)
        difference = torch.nan_to_num(difference, nan=float("inf"))
        if difference.numel():
            result.max_abs_err = max(result.max_abs_err, float(difference.max()))
            scale = b.abs().clamp_min(torch.finfo(torch.float64).tiny)
            relative = torch.where(difference > 0, difference / scale, torch.zeros_like(difference))
            result.max_rel_err = max(result.max_rel_err, float(relative.max()))
            result.within &= bool((difference <= atol + rtol * b.abs().nan_to_num(nan=0.0)).all())
        if expected.dim() >= 2 and expected.shape[-1] >= 2 and not expected.is_complex():
            agree = actual.argmax(dim=-1) == expected.argmax(dim=-1)
            result.agree += int(agree.sum())
            result.rows += agree.numel()
    return result


# ---------------------------------------------------------------------------------------------- evaluation


@dataclass
class _Inputs:
    """What every device runs on: the seeded input, and the test set when there is one."""

    seeded: torch.Tensor
    images: torch.Tensor | None = None
    labels: torch.Tensor | None = None


def model_dtype(model: nn.Module) -> str:
    """The floating dtype the model computes in (``F32`` if it has no floating parameters)."""
    from .materialize import dtype_name

    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_floating_point():
            return dtype_name(tensor)
    return "F32"


def make_inputs(model: nn.Module, shape: tuple[int, ...], *, test_set: bool) -> _Inputs:
    """A seeded input of ``shape`` (token ids if the model starts with an embedding) and the test set."""
    import torch
    from torch import nn

    generator = torch.Generator().manual_seed(INPUT_SEED)
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if isinstance(first, nn.Embedding):
        seeded = torch.randint(0, first.num_embeddings, shape, generator=generator)
    else:
        dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float32)
        seeded = torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    inputs = _Inputs(seeded=seeded)
    if test_set:
        from training.data import synthetic_digits

        images, labels = synthetic_digits(TEST_SET_SIZE, seed=TEST_SET_SEED, train=False).tensors
        inputs.images, inputs.labels = images.to(seeded.dtype), labels
    return inputs


def run_model(model: nn.Module, inputs: _Inputs, device: str, *, move: bool) -> dict[str, torch.Tensor]:
    """Outputs on CPU, named: ``output...`` for the seeded input, ``test_logits`` for the test set."""
    import torch

    def place(tensor: torch.Tensor) -> torch.Tensor:
        return _to_device(tensor, device) if move else tensor

    with torch.no_grad():
        produced = flatten_outputs(model(place(inputs.seeded)))
        _synchronize(produced.values())
        outputs = {name: tensor.detach().cpu() for name, tensor in produced.items()}
        if inputs.images is not None:
            batches = []
            for start in range(0, len(inputs.images), EVAL_BATCH):
                logits = model(place(inputs.images[start:start + EVAL_BATCH]))
                batches.append(logits)
            _synchronize(batches)
            outputs["test_logits"] = torch.cat([batch.detach().cpu() for batch in batches])
    return outputs


def _accuracy(outputs: Mapping[str, torch.Tensor], labels: torch.Tensor | None) -> float | None:
    logits = outputs.get("test_logits")
    if labels is None or logits is None or logits.dim() != 2:
        return None
    return round(float((logits.argmax(dim=1) == labels).float().mean()), 6)


def _check_device_with_model(model: nn.Module, reference_state: Mapping[str, torch.Tensor], inputs: _Inputs,
                             reference: Mapping[str, torch.Tensor], device: str, *, atol: float,
                             rtol: float) -> DeviceResult:
    result = DeviceResult(device=device, ok=False, weights_identical=False)
    try:
        moved = _to_device(copy.deepcopy(model), device)
        moved.eval()
        state = moved.state_dict()
        _synchronize(state.values())
        result.differing_weights = [name for name, tensor in state.items()
                                    if name not in reference_state or not bits_equal(tensor.cpu(), reference_state[name])]
        result.differing_weights += [name for name in reference_state if name not in state]
        result.weights_identical = not result.differing_weights
        outputs = run_model(moved, inputs, device, move=True)
        del moved, state
    except (RuntimeError, TypeError, ValueError, AssertionError) as e:  # device out of memory, unsupported dtype...
        result.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        return result
    comparison = compare_outputs(outputs, reference, atol=atol, rtol=rtol)
    result.max_abs_err, result.max_rel_err = comparison.max_abs_err, comparison.max_rel_err
    result.argmax_agreement = comparison.argmax_agreement
    result.within_tolerance = comparison.within
    result.accuracy = _accuracy(outputs, inputs.labels)
    if comparison.problems:
        result.error = "; ".join(comparison.problems)
    result.ok = result.weights_identical and comparison.within
    return result


def _check_device_weights(state_dict: Mapping[str, torch.Tensor], device: str) -> DeviceResult:
    import torch

    result = DeviceResult(device=device, ok=False, weights_identical=False)
    try:
        for name, tensor in state_dict.items():  # one tensor at a time: device memory stays bounded
            moved = _to_device(tensor, device)
            _synchronize([moved])
            if moved.is_floating_point() or moved.is_complex():
                nan, inf = int(torch.isnan(moved).sum()), int(torch.isinf(moved).sum())
                if nan or inf:
                    result.nonfinite[name] = {"nan": nan, "inf": inf}
            if not bits_equal(moved.cpu(), tensor):
                result.differing_weights.append(name)
            del moved
    except (RuntimeError, TypeError, ValueError, AssertionError) as e:
        result.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        return result
    result.weights_identical = not result.differing_weights
    result.ok = result.weights_identical
    return result


def _device_failure(result: DeviceResult, atol: float | None, rtol: float | None) -> str:
    if result.error and not result.weights_identical and not result.differing_weights:
        return f"{result.device}: {result.error}"
    if result.differing_weights:
        names = ", ".join(result.differing_weights[:3]) + (", ..." if len(result.differing_weights) > 3 else "")
        return f"{result.device}: weights changed in the transfer to the device ({names})"
    if result.error:
        return f"{result.device}: {result.error}"
    return (f"{result.device}: outputs differ from the CPU reference beyond atol {atol:g} / rtol {rtol:g} "
            f"(max abs err {result.max_abs_err:.3g}) — rerun with --atol/--rtol if that is expected")


# ---------------------------------------------------------------------------------------------- verify


def verify(
    path: Path | str,
    *,
    model_spec: str | ModelSpec | None = None,
    model_args: Sequence[str] = (),
    devices: str | Sequence[str] = "all",
    against: Path | str | None = None,
    input_shape: tuple[int, ...] | str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    allow_globals: tuple[str, ...] | list[str] = (),
    allow_expansion: bool = False,
    allow_nonfinite: bool | Sequence[str] = False,
) -> VerifyReport:
    """Prove a checkpoint loads and evaluates identically on CPU and every device.

    Args:
        path: any checkpoint ckptool reads.
        model_spec: ``torchvision:NAME``, ``training:NAME`` or ``package.module:factory`` (see
            :mod:`ckptool.models`); without one only the weights are checked.
        model_args: extra ``k=v`` keyword arguments for the model builder.
        devices: ``"all"`` (:func:`ckptool.devices.available_devices`) or a list like ``"cpu,cuda:0"``.
        against: a second checkpoint (any format) that must hold the same weights.
        input_shape: the seeded input's shape (default: the model family's).
        atol, rtol: output tolerances (default: by the model's dtype, see :data:`DEFAULT_TOLERANCES`);
            ``atol`` is also the value tolerance of the ``against`` weight comparison (default exact).
        allow_globals: extra pickle globals to accept by name.
        allow_expansion: read views that expand their storage (stride 0, overlaps) past
            :data:`ckptool.refs.EXPANSION_FACTOR` in full; without it such a checkpoint is refused.
        allow_nonfinite: weights holding NaN or Inf fail the check unless allowed: ``True`` for
            all, or shell patterns of the keys that may (``["*.mask"]``: -inf attention masks).

    Returns:
        A :class:`VerifyReport`; ``ok`` is False when the load or any check failed (weights
        holding NaN/Inf included, unless allowed). Unreadable input, a bad SPEC or an unknown
        device raise instead.

    Example:
        >>> report = ckptool.verify("model.pt", model_spec="training:lenet", devices="cpu")  # doctest: +SKIP
        >>> report.ok, report.devices[0].max_abs_err                                        # doctest: +SKIP
        (True, 0.0)
    """
    checkpoint = load(path, allow_globals=allow_globals)
    check_expansion(checkpoint.tensors if checkpoint.has_weights else {}, allow=allow_expansion,
                    path=checkpoint.path, doing="verify")
    spec = model_spec if isinstance(model_spec, ModelSpec) or model_spec is None else \
        parse_model_spec(model_spec, model_args)
    if spec is None and (model_args or input_shape is not None):
        raise UsageError(f"{'--model-arg' if model_args else '--input-shape'} needs --model SPEC")
    shape = input_shape
    if isinstance(shape, str):
        from .models import parse_input_shape

        shape = parse_input_shape(shape)
    if spec is not None and shape is None:
        shape = spec.default_input_shape
        if shape is None:
            raise UsageError(f"--model {spec.text}: say the input shape with --input-shape, e.g. 1,3,224,224")
    device_list = resolve_devices(devices)
    other = load(against, allow_globals=allow_globals) if against is not None else None
    if other is not None:
        check_expansion(other.tensors if other.has_weights else {}, allow=allow_expansion, path=other.path,
                        doing="verify")
    # weights-only on CPU needs no torch at all: it streams the bytes (the common pipeline check)
    needs_torch = spec is not None or any(device != "cpu" for device in device_list)
    with deterministic_settings() if needs_torch else contextlib.nullcontext():
        evaluation: _Evaluation | None = None
        if spec is None:
            # weights only, CPU only, --against: one pass over A does the NaN/Inf count and the diff
            fused = other if device_list == ["cpu"] else None
            report = _verify_weights(checkpoint, device_list, against=fused, atol=atol)
        else:
            report, evaluation = _verify_model(checkpoint, spec, tuple(shape), device_list, atol, rtol)
        if other is not None and report.load.get("ok", False) and report.against is None:
            report.against = _against(checkpoint, other, report, evaluation, atol=atol)
    _conclude(report, allow_nonfinite)
    return report


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _count_nonfinite(chunk: bytes | bytearray | memoryview, name: str) -> tuple[int, int]:
    """``(nan, inf)`` in a chunk of whole elements of the floating dtype ``name`` (numpy; no torch)."""
    import numpy as np

    if name == "BF16":  # no numpy bf16: an all-ones exponent is NaN (mantissa set) or Inf
        bits = np.frombuffer(chunk, dtype=np.uint16)
        if not bits.size or int((bits & 0x7FFF).max()) < 0x7F80:  # the usual case: one cheap pass
            return 0, 0
        special = (bits & 0x7F80) == 0x7F80
        mantissa = (bits & 0x007F) != 0
        return int(np.count_nonzero(special & mantissa)), int(np.count_nonzero(special & ~mantissa))
    values = np.frombuffer(chunk, dtype={"F64": np.float64, "F32": np.float32, "F16": np.float16}[name])
    if np.isfinite(values).all():  # the usual case: one cheap pass
        return 0, 0
    return int(np.count_nonzero(np.isnan(values))), int(np.count_nonzero(np.isinf(values)))


def _nonfinite_on_cpu(tensor: TensorRef, files: OpenFiles | None = None) -> dict[str, int] | None:
    """NaN/Inf counts of a floating tensor read straight from the file (numpy, chunk by chunk; no torch)."""
    name = tensor.dtype.name
    if name not in _FLOAT_DTYPES:
        return None
    nan = inf = 0
    for chunk in tensor_chunks(tensor, files=files):
        more_nan, more_inf = _count_nonfinite(chunk, name)
        nan, inf = nan + more_nan, inf + more_inf
    return {"nan": nan, "inf": inf} if nan or inf else None


def _check_cpu_weights(tensors: Mapping[str, TensorRef],
                       counted: Mapping[str, dict[str, int] | None] | None = None) -> DeviceResult:
    """The CPU row without torch: weights on CPU are the file's bytes, so only NaN/Inf are counted.

    Every byte is read once (a truncated or unreadable file fails here), one chunk at a time.
    ``counted``: NaN/Inf counts (None: none) of tensors already read, by :func:`_check_cpu_weights_against`.
    """
    result = DeviceResult(device="cpu", ok=True, weights_identical=True)
    with contextlib.closing(OpenFiles()) as files:
        for name, tensor in tensors.items():
            if counted is not None and name in counted:
                counts = counted[name]
            elif tensor.dtype.name in _FLOAT_DTYPES:
                counts = _nonfinite_on_cpu(tensor, files)
            else:
                counts = None
                for _ in tensor_chunks(tensor, files=files):
                    pass  # other dtypes: still prove the bytes are there
            if counts:
                result.nonfinite[name] = counts
    return result


def _check_cpu_weights_against(checkpoint: Checkpoint, other: Checkpoint,
                               atol: float | None) -> tuple[DeviceResult, DiffReport]:
    """The CPU row and the --against weight diff with A read once: every chunk of A the diff reads is
    also counted for NaN/Inf (while it is in cache); only the tensors the diff does not read (keys only
    in A, other shapes) are read afterwards. The same results as :func:`_check_cpu_weights`, then ``diff``."""
    tensors = checkpoint.tensors
    tallies: dict[str, list[int] | None] = {}  # A's key -> [nan, inf] (None: not floating), for each tensor read

    def hook(key: str, tensor: TensorRef) -> ChunkCallback | None:
        name = tensor.dtype.name
        if name not in _FLOAT_DTYPES:
            tallies[key] = None
            return None
        tally = tallies[key] = [0, 0]

        def count(chunk: bytes | bytearray) -> None:
            nan, inf = _count_nonfinite(chunk, name)
            tally[0] += nan
            tally[1] += inf

        return count

    try:
        weights = diff(checkpoint, other, atol=atol or 0.0, align_prefixes=True, chunk_hook=hook)
    except Exception:
        _check_cpu_weights(tensors)  # A's own error first, as when A was read whole before the diff
        raise
    counted = {key: {"nan": tally[0], "inf": tally[1]} if tally and (tally[0] or tally[1]) else None
               for key, tally in tallies.items()}
    return _check_cpu_weights(tensors, counted), weights


def _verify_weights(checkpoint: Checkpoint, device_list: list[str], *, against: Checkpoint | None = None,
                    atol: float | None = None) -> VerifyReport:
    tensors = checkpoint.tensors
    report = VerifyReport(path=str(checkpoint.path), format=checkpoint.format, ok=False, model=None, model_class=None,
                          input_shape=None, dtype=None, atol=None, rtol=None,
                          load={"ok": True, "tensors": len(tensors), "layout": list(checkpoint.layout or ()),
                                "prefix": checkpoint.prefix})
    state_dict = to_state_dict(tensors) if any(device != "cpu" for device in device_list) else None
    for device in device_list:
        if device == "cpu" and against is not None:
            row, weights = _check_cpu_weights_against(checkpoint, against, atol)
            report.devices.append(row)
            report.against = _against(checkpoint, against, report, None, atol=atol, weights=weights)
        elif device == "cpu":
            report.devices.append(_check_cpu_weights(tensors))
        else:
            assert state_dict is not None
            report.devices.append(_check_device_weights(state_dict, device))
    nonfinite = {name for result in report.devices for name in result.nonfinite}
    if nonfinite:
        report.notes.append(f"{len(nonfinite)} weight tensor(s) hold NaN or Inf: {', '.join(sorted(nonfinite)[:5])}")
    return report


@dataclass
class _Evaluation:
    """The CPU reference run, kept to evaluate the --against checkpoint on the same inputs."""

    spec: ModelSpec
    inputs: _Inputs
    reference: dict[str, torch.Tensor]
    atol: float
    rtol: float


def _verify_model(checkpoint: Checkpoint, spec: ModelSpec, shape: tuple[int, ...], device_list: list[str],
                  atol: float | None, rtol: float | None) -> tuple[VerifyReport, _Evaluation | None]:
    import torch

    torch.manual_seed(0)  # buffers a checkpoint does not hold (non-persistent) come out the same every run
    model = spec.build()
    from .materialize import model_name

    report = VerifyReport(path=str(checkpoint.path), format=checkpoint.format, ok=False, model=spec.text,
                          model_class=model_name(model), input_shape=shape, dtype=None, atol=atol, rtol=rtol, load={})
    try:
        load_report = load_into(model, checkpoint, fix=False)
    except LoadMismatchError as e:
        report.load = {"ok": False, "diagnosis": e.diagnosis.to_json(), "error": str(e)}
        report.failure = str(e)
        return report, None
    report.load = load_report.to_json()
    if load_report.casts:
        report.notes.append("the model converted weights on load: "
                            + ", ".join(f"{count} {cast}" for cast, count in load_report.casts.items()))
    model.eval()
    dtype = model_dtype(model)
    default_atol, default_rtol = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["F32"])
    report.dtype = dtype
    report.atol = default_atol if atol is None else atol
    report.rtol = default_rtol if rtol is None else rtol
    inputs = make_inputs(model, shape, test_set=spec.family == "training")
    reference_state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    try:
        reference = run_model(model, inputs, "cpu", move=False)
    except (RuntimeError, TypeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--model {spec.text}: the model fails on an input of shape "
                         f"{','.join(map(str, shape))} ({first}) — pass the right --input-shape") from e
    report.devices = [_check_device_with_model(model, reference_state, inputs, reference, device, atol=report.atol,
                                               rtol=report.rtol) for device in device_list]
    if report.devices:  # the loaded weights themselves, counted once on the CPU copy
        report.devices[0].nonfinite.update(_nonfinite_in_state(reference_state))
    return report, _Evaluation(spec, inputs, reference, report.atol, report.rtol)


def _against(checkpoint: Checkpoint, other: Checkpoint, report: VerifyReport, evaluation: _Evaluation | None, *,
             atol: float | None, weights: DiffReport | None = None) -> AgainstResult:
    if weights is None:  # else the weight diff was already made (in the same pass as the CPU row)
        weights = diff(checkpoint, other, atol=atol or 0.0, align_prefixes=True)
    result = AgainstResult(path=str(other.path), format=other.format, ok=weights.identical, diff=weights)
    if evaluation is None:
        return result
    import torch

    torch.manual_seed(0)
    model = evaluation.spec.build()
    try:
        load_into(model, other, fix=True)
    except LoadMismatchError as e:
        result.ok, result.error = False, f"does not load into {e.diagnosis.model}: {e.diagnosis.message}"
        return result
    model.eval()
    outputs = run_model(model, evaluation.inputs, "cpu", move=False)
    comparison = compare_outputs(outputs, evaluation.reference, atol=evaluation.atol, rtol=evaluation.rtol)
    result.max_abs_err, result.max_rel_err = comparison.max_abs_err, comparison.max_rel_err
    result.within_tolerance = comparison.within
    result.ok = result.ok and comparison.within
    return result


def _nonfinite_in_state(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, int]]:
    import torch

    found = {}
    for name, tensor in state.items():
        if tensor.is_floating_point() or tensor.is_complex():
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            if nan or inf:
                found[name] = {"nan": nan, "inf": inf}
    return found


def _nonfinite_failure(report: VerifyReport, allow: bool | Sequence[str]) -> str | None:
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
    return (f"{len(names)} weight tensor(s) hold NaN or Inf: {shown}{more} — the weights are broken, or pass "
            "--allow-nonfinite (or --allow-nonfinite-key PATTERN) if they hold them on purpose, e.g. -inf masks")


def _conclude(report: VerifyReport, allow_nonfinite: bool | Sequence[str] = False) -> None:
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
    report.failure = failures[0] if failures else None


def _against_failure(result: AgainstResult) -> str:
    weights = result.diff
    if result.error:
        return f"against {result.path}: {result.error}"
    if weights.only_in_a or weights.only_in_b:
        return (f"against {result.path}: the weight keys differ ({len(weights.only_in_a)} only in this checkpoint, "
                f"{len(weights.only_in_b)} only in the other)")
    if weights.changed:
        change = weights.changed[0]
        what = " and ".join(change.kinds)
        detail = f", max abs diff {change.max_abs_diff:.3g}" if change.max_abs_diff is not None else ""
        more = f" (and {len(weights.changed) - 1} more)" if len(weights.changed) > 1 else ""
        return f"against {result.path}: {change.name} differs in {what}{detail}{more}"
    return f"against {result.path}: the model's outputs differ beyond the tolerance (max abs err {result.max_abs_err:.3g})"
