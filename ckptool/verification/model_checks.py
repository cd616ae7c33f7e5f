"""verify's model checks: seeded inputs, running a model on a device, and comparing its outputs
(and its weights after the transfer) with the CPU reference."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptool.model.devices import Device
from ckptool.verification.models import TestSet
from ckptool.verification.report import Comparison, DeviceResult, error_line
from ckptool.verification.weight_checks import DEVICE_ERRORS, bits_equal

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
EVAL_BATCH = 250


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


def compare_outputs(
    outputs: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], *, atol: float, rtol: float
) -> Comparison:
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


# ---------------------------------------------------------------------------------------------- inputs and runs


@dataclass
class Inputs:
    """What every device runs on: the seeded input, and the test set when there is one."""

    seeded: torch.Tensor
    images: torch.Tensor | None = None
    labels: torch.Tensor | None = None


def model_dtype(model: nn.Module) -> str:
    """The floating dtype the model computes in (``F32`` if it has no floating parameters)."""
    from ckptool.ops.load_into import dtype_name

    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_floating_point():
            return dtype_name(tensor)
    return "F32"


def make_inputs(
    model: nn.Module, shape: tuple[int, ...], *, test_set: TestSet | None = None, test_set_size: int = 0
) -> Inputs:
    """A seeded input of ``shape`` (token ids if the model starts with an embedding), and
    ``test_set(test_set_size)`` (a model family's labelled set) when there is one."""
    import torch
    from torch import nn

    generator = torch.Generator().manual_seed(INPUT_SEED)
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if isinstance(first, nn.Embedding):
        seeded = torch.randint(0, first.num_embeddings, shape, generator=generator)
    else:
        dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float32)
        seeded = torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    inputs = Inputs(seeded=seeded)
    if test_set is not None and test_set_size > 0:
        images, labels = test_set(test_set_size)
        inputs.images, inputs.labels = images.to(seeded.dtype), labels
    return inputs


def run_model(model: nn.Module, inputs: Inputs, device: Device | None = None) -> dict[str, torch.Tensor]:
    """Outputs on CPU, named: ``output...`` for the seeded input, ``test_logits`` for the test set.

    ``device``: where the model was moved; the inputs are moved there too (None: the model runs
    where it is, on the inputs as they are — the CPU reference).
    """
    import torch

    def place(tensor: torch.Tensor) -> torch.Tensor:
        return device.move(tensor) if device is not None else tensor

    def wait(tensors: Any) -> None:
        if device is not None:
            device.synchronize(tensors)

    with torch.no_grad():
        produced = flatten_outputs(model(place(inputs.seeded)))
        wait(produced.values())
        outputs = {name: tensor.detach().cpu() for name, tensor in produced.items()}
        if inputs.images is not None:
            batches = []
            for start in range(0, len(inputs.images), EVAL_BATCH):
                logits = model(place(inputs.images[start : start + EVAL_BATCH]))
                batches.append(logits)
            wait(batches)
            outputs["test_logits"] = torch.cat([batch.detach().cpu() for batch in batches])
    return outputs


def _accuracy(outputs: Mapping[str, torch.Tensor], labels: torch.Tensor | None) -> float | None:
    logits = outputs.get("test_logits")
    if labels is None or logits is None or logits.dim() != 2:
        return None
    return round(float((logits.argmax(dim=1) == labels).float().mean()), 6)


@dataclass
class Reference:
    """The CPU run every device (and the ``--against`` model) is compared with."""

    inputs: Inputs
    outputs: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]  # the loaded weights, as the CPU model holds them
    atol: float
    rtol: float


def check_device_with_model(model: nn.Module, reference: Reference, device: Device) -> DeviceResult:
    """A copy of ``model`` moved to ``device``: its weights bit-identical to the reference's, and its
    outputs within tolerance."""
    result = DeviceResult(device=device.name, ok=False, weights_identical=False)
    try:
        moved = device.move(copy.deepcopy(model))
        moved.eval()
        state = moved.state_dict()
        device.synchronize(state.values())
        result.differing_weights = [
            name
            for name, tensor in state.items()
            if name not in reference.state or not bits_equal(tensor.cpu(), reference.state[name])
        ]
        result.differing_weights += [name for name in reference.state if name not in state]
        result.weights_identical = not result.differing_weights
        outputs = run_model(moved, reference.inputs, device)
        del moved, state
    except DEVICE_ERRORS as e:  # device out of memory, unsupported dtype...
        result.error = error_line(e)
        return result
    comparison = compare_outputs(outputs, reference.outputs, atol=reference.atol, rtol=reference.rtol)
    result.record(comparison)
    result.argmax_agreement = comparison.argmax_agreement
    result.accuracy = _accuracy(outputs, reference.inputs.labels)
    if comparison.problems:
        result.error = "; ".join(comparison.problems)
    result.ok = result.weights_identical and comparison.within
    return result
