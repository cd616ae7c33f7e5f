"""Runs one framework module (``fw_<name>.py``) inside the frameworks venv and prints JSON.

    VENV/bin/python scripts/frameworks/driver.py write NAME OUT_DIR
    VENV/bin/python scripts/frameworks/driver.py load NAME CASES_JSON OUTPUTS_JSON

``write`` calls ``fw_NAME.write(OUT_DIR)`` and prints ``{"framework", "versions", "cases"}``.
``load`` calls ``fw_NAME.load_back(case, outputs[case["id"]])`` for every case whose ``load_back`` is not None
and prints ``{"framework", "results": [{"id", "ok", "detail"}]}``; one case failing never stops the others.
CASES_JSON is a file holding the list of cases ``write`` printed; OUTPUTS_JSON a file holding
``{case id: {output name: absolute path}}`` (see README.md beside this file for the names).
This file, and every ``fw_*.py``, is imported only by the frameworks venv, never by ckptool or its tests.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the distributions whose versions a run records (those absent from the venv are left out)
RECORDED = ("torch", "torchvision", "lightning", "transformers", "accelerate", "timm", "mmengine", "mmcv",
            "ultralytics", "diffusers", "peft", "huggingface_hub", "safetensors", "numpy", "omegaconf")


def versions() -> dict[str, str]:
    """The installed version of every recorded distribution present here."""
    found = {}
    for name in RECORDED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def framework(name: str):
    """``fw_NAME`` from this folder."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module(f"fw_{name}")


def offline() -> None:
    """No hub, no telemetry: every model is built from a config here."""
    for variable, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                            ("HF_HUB_DISABLE_TELEMETRY", "1"), ("WANDB_DISABLED", "true"), ("WANDB_MODE", "disabled"),
                            ("YOLO_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                            ("OMP_NUM_THREADS", "1")):
        os.environ.setdefault(variable, value)


def write(name: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cases = framework(name).write(out.resolve())
    for case in cases:
        missing = {"id", "path", "allow_globals", "load_back"} - set(case)
        if missing:
            raise ValueError(f"fw_{name}.write: case {case.get('id')!r} lacks {sorted(missing)}")
        if not (out / case["path"]).exists():
            raise FileNotFoundError(f"fw_{name}.write: case {case['id']!r}: {case['path']} was not written")
    return {"framework": name, "versions": versions(), "cases": cases}


def load(name: str, cases: list[dict], outputs: dict[str, dict[str, str]]) -> dict:
    module = framework(name)
    results = []
    for case in cases:
        if case.get("load_back") is None:
            continue
        try:
            detail = module.load_back(case, outputs.get(case["id"], {}))
            results.append({"id": case["id"], "ok": True, "detail": str(detail)})
        except Exception as error:  # noqa: BLE001 — one case's failure is reported, the others still run
            last = traceback.format_exception_only(type(error), error)[-1].strip()
            results.append({"id": case["id"], "ok": False, "detail": last[:600]})
    return {"framework": name, "results": results}


def main(argv: list[str]) -> int:
    offline()
    if len(argv) == 3 and argv[0] == "write":
        report = write(argv[1], Path(argv[2]))
    elif len(argv) == 4 and argv[0] == "load":
        report = load(argv[1], json.loads(Path(argv[2]).read_text()), json.loads(Path(argv[3]).read_text()))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    # the JSON is the last line of stdout: frameworks print their own progress before it
    sys.stdout.flush()
    print("\n" + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
