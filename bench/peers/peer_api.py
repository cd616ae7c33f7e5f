"""One peer scanner's library verdict on one path, as one JSON line; runs in the peers' venv.

    /work/peers-venv/bin/python bench/peers/peer_api.py picklescan PATH
    /work/peers-venv/bin/python bench/peers/peer_api.py fickling PATH
    /work/peers-venv/bin/python bench/peers/peer_api.py SCANNER --import-only    # start-up cost

picklescan: ``scan_file_path`` / ``scan_directory_path``, exactly what its CLI calls, read with each
global's safety level (the CLI prints only counts). fickling: its CLI reads a file as one stack of
pickles and has no zip support for local files, so this calls what its Hugging Face scan does per
file: ``loader.scan_zip_archive`` for a zip (every ``.pkl``/``.pickle``/``.bin`` member), else
``loader.scan_file``; a folder is every file under it. Nothing here imports ckptool or torch.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile


def picklescan(path: str) -> dict:
    from picklescan.scanner import SafetyLevel, scan_directory_path, scan_file_path

    result = scan_directory_path(path) if os.path.isdir(path) else scan_file_path(path)
    dangerous = sorted({f"{g.module}.{g.name}" for g in result.globals if g.safety == SafetyLevel.Dangerous})
    suspicious = sorted({f"{g.module}.{g.name}" for g in result.globals if g.safety == SafetyLevel.Suspicious})
    if result.issues_count:
        grade = "malicious"
    elif result.scan_err:
        grade = "error"
    elif not result.scanned_files:
        grade = "error"
    elif suspicious:
        grade = "lower"
    else:
        grade = "clean"
    detail = ("dangerous: " + ", ".join(dangerous[:5]) if dangerous else
              "suspicious: " + ", ".join(suspicious[:5]) if suspicious else "")
    if result.scan_err:
        detail = (detail + "; " if detail else "") + "scan error"
    if not result.scanned_files:
        detail = (detail + "; " if detail else "") + "no file scanned (type not recognised)"
    return {"grade": grade, "raw": f"issues={result.issues_count} suspicious={len(suspicious)} "
                                   f"scan_err={result.scan_err} scanned={result.scanned_files}", "detail": detail}


def fickling(path: str) -> dict:
    from fickling.analysis import Severity
    from fickling.loader import scan_file, scan_zip_archive

    files = [os.path.join(root, name) for root, _, names in sorted(os.walk(path)) for name in sorted(names)] \
        if os.path.isdir(path) else [path]
    results = []
    for file in files:
        if not os.path.isfile(file):
            continue
        if zipfile.is_zipfile(file):
            results += list(scan_zip_archive(file, graceful=True).values())
        else:
            results.append(scan_file(file, graceful=True))
    findings = [finding for r in results for analysis in r.results for finding in analysis.results]
    errors = [e for r in results for e in r.errors]
    worst = max((r.severity for r in results), default=Severity.LIKELY_SAFE, key=lambda s: s.value[0])
    analysed_worst = max((f.severity for f in findings), default=Severity.LIKELY_SAFE, key=lambda s: s.value[0])
    if analysed_worst >= Severity.LIKELY_OVERTLY_MALICIOUS:
        grade = "malicious"
    elif analysed_worst > Severity.LIKELY_SAFE:
        grade = "lower"
    elif errors or not results:
        grade = "error"  # fickling grades a pickle it cannot parse SUSPICIOUS: that is a failed scan, not a finding
    else:
        grade = "clean"
    texts = [str(f) for f in findings if f.severity == analysed_worst and analysed_worst > Severity.LIKELY_SAFE]
    detail = "; ".join(t.replace("\n", " ")[:160] for t in texts[:2])
    if errors:
        detail = (detail + "; " if detail else "") + errors[0][:160]
    if not results:
        detail = "no pickle found (a zip without .pkl/.pickle/.bin member)"
    return {"grade": grade, "raw": f"severity={worst.name} analysed={analysed_worst.name} errors={len(errors)}",
            "detail": detail}


SCANNERS = {"picklescan": picklescan, "fickling": fickling}


def main(argv: list[str]) -> int:
    scanner, path = argv[1], argv[2]
    if path == "--import-only":
        __import__("picklescan.scanner" if scanner == "picklescan" else "fickling.loader")
        return 0
    try:
        verdict = SCANNERS[scanner](path)
    except Exception as e:  # a crash of the scanner is its verdict on this file
        verdict = {"grade": "error", "raw": "exception", "detail": f"{type(e).__name__}: {str(e)[:200]}"}
    sys.stdout.write(json.dumps(verdict) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
