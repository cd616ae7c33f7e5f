"""Dtype names: one canonical spelling (safetensors') for every dtype a checkpoint can hold.

Torch-free on purpose: the reader maps pickle globals (``torch.FloatStorage``, ``torch.float32``)
and safetensors header strings onto these names without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """A tensor element type: canonical name, byte size, torch attribute name, floating or not."""

    name: str  # safetensors spelling, e.g. "F32"
    itemsize: int
    torch_name: str  # attribute of the torch module, e.g. "float32"
    storage_class: str | None  # legacy typed-storage class name in pickles, e.g. "FloatStorage"
    is_floating: bool


# name: safetensors' spelling; size: bytes per element; torch name: the attribute of the torch module;
# storage class: the legacy typed-storage class pickles name ("-": none); floating: a float dtype
_SAFETENSORS_DTYPES = """
# name      size  torch name        storage class         floating
F64            8  float64           DoubleStorage         yes
F32            4  float32           FloatStorage          yes
F16            2  float16           HalfStorage           yes
BF16           2  bfloat16          BFloat16Storage       yes
F8_E4M3        1  float8_e4m3fn     -                     yes
F8_E5M2        1  float8_e5m2       -                     yes
F8_E4M3FNUZ    1  float8_e4m3fnuz   -                     yes
F8_E5M2FNUZ    1  float8_e5m2fnuz   -                     yes
C64            8  complex64         ComplexFloatStorage   no
C128          16  complex128        ComplexDoubleStorage  no
I64            8  int64             LongStorage           no
I32            4  int32             IntStorage            no
I16            2  int16             ShortStorage          no
I8             1  int8              CharStorage           no
U64            8  uint64            -                     no
U32            4  uint32            -                     no
U16            2  uint16            -                     no
U8             1  uint8             ByteStorage           no
BOOL           1  bool              BoolStorage           no
"""
# dtypes torch names as globals (its weights_only set) beyond the safetensors format's: a dtype is
# data. complex32 is a pair of float16; the others have no arithmetic in torch (bit containers,
# packed float4 pairs) or only conversions (float8_e8m0fnu), and are compared as bit patterns.
_TORCH_ONLY_DTYPES = """
# name      size  torch name        storage class         floating
C32            4  complex32         -                     no
F8_E8M0        1  float8_e8m0fnu    -                     yes
F4_E2M1_X2     1  float4_e2m1fn_x2  -                     yes
BITS8          1  bits8             -                     no
BITS16         2  bits16            -                     no
BITS1X8        1  bits1x8           -                     no
BITS2X4        1  bits2x4           -                     no
BITS4X2        1  bits4x2           -                     no
"""


def _parse(table: str) -> tuple[DType, ...]:
    rows = (line.split() for line in table.strip().splitlines() if not line.startswith("#"))
    return tuple(
        DType(name, int(size), torch_name, None if storage == "-" else storage, floating == "yes")
        for name, size, torch_name, storage, floating in rows
    )


_ALL = _parse(_SAFETENSORS_DTYPES) + _parse(_TORCH_ONLY_DTYPES)

BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
BY_TORCH_NAME: dict[str, DType] = {d.torch_name: d for d in _ALL}
BY_STORAGE_CLASS: dict[str, DType] = {d.storage_class: d for d in _ALL if d.storage_class}
# torch also accepts these aliases as attributes (torch.float == torch.float32 ...)
BY_TORCH_NAME.update(
    {
        "float": BY_NAME["F32"],
        "double": BY_NAME["F64"],
        "half": BY_NAME["F16"],
        "long": BY_NAME["I64"],
        "int": BY_NAME["I32"],
        "short": BY_NAME["I16"],
        "cfloat": BY_NAME["C64"],
        "cdouble": BY_NAME["C128"],
        "chalf": BY_NAME["C32"],
    }
)
# compared bit pattern for bit pattern (diff's exact integer path): torch has no values to subtract
BIT_PATTERNS = frozenset({"F8_E8M0", "F4_E2M1_X2", "BITS8", "BITS16", "BITS1X8", "BITS2X4", "BITS4X2"})
# dtypes torch's weights_only load accepts as values (``torch.uint4`` saved in a config), whose
# tensors torch itself cannot build or save: read as dtype records only, never as a tensor's dtype
VALUE_ONLY_TORCH_NAMES = tuple(f"{kind}{bits}" for kind in ("int", "uint") for bits in range(1, 8)) + ("bcomplex32",)
ALIASES = {
    "fp32": "F32",
    "float32": "F32",
    "fp16": "F16",
    "float16": "F16",
    "half": "F16",
    "bf16": "BF16",
    "bfloat16": "BF16",
    "fp64": "F64",
    "float64": "F64",
}


def by_name(name: str) -> DType:
    """Look up a canonical name (``"F32"``) or a friendly alias (``"bf16"``)."""
    key = ALIASES.get(name.lower(), name.upper())
    return BY_NAME[key]
