"""Zip members are located as torch's reader (PyTorchStreamReader over miniz) locates them.

torch goes by the central directory (the local header is read only for the lengths that place the
data: the name it repeats is never compared), does not check CRCs, compares names ignoring ASCII
case, and of several members matching one name reads whichever miniz's unstable heap sort and
binary search reach.
So, for crafted zips generated here from real ``torch.save`` files:

- a pickle torch would run is always examined by ``scan`` (exit 1 naming what it imports), never
  called corrupt — also a ``.pkl`` torch never reads (``archive/data/../x.pkl``);
- a benign variant torch loads is read with torch's values; of members sharing a name (ignoring
  case), the one torch's zip library finds, which depends on every other name in the archive.
"""

from __future__ import annotations

import io
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import ckptool

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402 — the corpus generator beside this file
from hostile import Member, call, dct, glob, make_zip, text, whole  # noqa: E402
from test_differential import assert_agree, run  # noqa: E402


def saved_members(obj: Any) -> list[Member]:
    """The members of ``torch.save(obj)``, in the order torch wrote them, ready to be mutated."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        return [Member(info.filename, archive.read(info)) for info in archive.infolist()]


def index_of(members: list[Member], suffix: str) -> int:
    return next(i for i, member in enumerate(members) if member.name.endswith(suffix))


STATE = {"weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "bias": torch.tensor([7, -8], dtype=torch.int64)}


def payload(canary: Path) -> bytes:
    return whole(dct((text("weight"), call(glob("os", "system"), text(f"touch '{canary}'")))))


Change = Callable[[list[Member], bytes], None]  # mutate the members; the bytes are a hostile pickle


def _replace_datapkl(**fields: Any) -> Change:
    def change(members: list[Member], bad: bytes) -> None:
        i = index_of(members, "/data.pkl")
        members[i] = Member(members[i].name, bad, **fields)
    return change


HOSTILE: dict[str, Change] = {
    "local_name_differs": _replace_datapkl(local_name="archive/data.pkx"),
    "local_name_longer": _replace_datapkl(local_name="archive/a-much-longer-name.bin"),
    "bad_crc": _replace_datapkl(crc=0xDEADBEEF),
    "duplicate_datapkl_after": lambda m, bad: m.append(Member(m[index_of(m, "/data.pkl")].name, bad)),
    "duplicate_datapkl_before": lambda m, bad: m.insert(0, Member(m[index_of(m, "/data.pkl")].name, bad)),
    "duplicate_datapkl_other_case": lambda m, bad: m.append(Member("archive/Data.PKL", bad)),
    "datapkl_upper_case": lambda m, bad: m.__setitem__(index_of(m, "/data.pkl"), Member("archive/DATA.PKL", bad)),
    "pickle_behind_dotdot": lambda m, bad: m.append(Member("archive/data/../x.pkl", bad)),
    "pickle_named_like_a_record": lambda m, bad: m.append(Member("archive/extra", bad)),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_pickle_torch_locates_is_scanned_unsafe_not_corrupt(tmp_path: Path, name: str) -> None:
    canary = tmp_path / "canary"
    members = saved_members(STATE)
    HOSTILE[name](members, payload(canary))
    path = tmp_path / f"{name}.pt"
    path.write_bytes(make_zip(members))
    code, out, err = run("scan", path)
    assert code == 1, (out, err)
    assert "DANGEROUS" in out and "os.system" in out
    code, out, err = run("scan", "--json", path)
    assert code == 1 and '"os.system"' in out
    code, out, err = run("inspect", path)
    try:  # the payload where torch never reads it (another name, a duplicate its zip library passes over)
        _torch_loads(path)
    except Exception:  # torch's weights_only loader meets os.system: so does ckptool's
        assert code == 3 and len(err.strip().splitlines()) == 1, err
    else:
        assert code == 0 and assert_agree(path) == "equal"
    assert not canary.exists()


def _torch_loads(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, weights_only=True)


BENIGN: dict[str, Callable[[list[Member]], None]] = {
    "local_name_differs": lambda m: setattr(m[index_of(m, "/data.pkl")], "local_name", "archive/other.pkl"),
    "storage_local_name_differs": lambda m: setattr(m[index_of(m, "/data/0")], "local_name", "archive/data/9"),
    "bad_crcs": lambda m: [setattr(member, "crc", 0x1234) for member in m],
    "crcs_zero": lambda m: [setattr(member, "crc", 0) for member in m],
    "names_in_other_case": lambda m: [setattr(member, "name", member.name.replace("data", "DaTa"))
                                      for member in m if "/data" in member.name],
    "extra_member_behind_dotdot": lambda m: m.append(Member("archive/data/../x.pkl", whole(hostile.integer(1)))),
}


@pytest.mark.parametrize("name", sorted(BENIGN))
def test_a_variant_torch_loads_reads_torchs_values(tmp_path: Path, name: str) -> None:
    members = saved_members(STATE)
    BENIGN[name](members)
    path = tmp_path / f"{name}.pt"
    path.write_bytes(make_zip(members))
    loaded = _torch_loads(path)
    assert torch.equal(loaded["weight"], STATE["weight"]) and torch.equal(loaded["bias"], STATE["bias"])
    assert assert_agree(path) == "equal"
    assert run("scan", path)[0] == 0
    # a rewrite of it is a clean archive torch reads with the same values
    out = tmp_path / "out.pt"
    code, _, err = run("remap", path, "--to", "cpu", "-o", out)
    assert code == 0, err
    rewritten = _torch_loads(out)
    assert all(torch.equal(rewritten[key], STATE[key]) for key in STATE)


def _numbered_pickle(value: int) -> bytes:
    """A data.pkl whose ``v`` tells which duplicate was read; the weight is the saved storage "0"."""
    return whole(dct((text("weight"), hostile.rebuild(numel=6, shape=(6,))), (text("v"), hostile.integer(value))))


def test_of_duplicate_names_the_member_torch_reads_is_read(tmp_path: Path) -> None:
    """miniz heap-sorts the directory (unstable) and binary-searches it, names compared ignoring
    case: which duplicate it finds depends on every name. ckptool reproduces both steps."""
    import random

    rng = random.Random(20261123)  # fixed: the same archives every run
    for trial in range(120):
        members = saved_members({"weight": torch.arange(6.0)})
        members[index_of(members, "/data.pkl")] = Member("archive/data.pkl", _numbered_pickle(0))
        copies = rng.randint(1, 5)
        for value in range(1, copies + 1):
            name = rng.choice(["archive/data.pkl", "archive/DATA.pkl", "archive/Data.Pkl"])
            members.insert(rng.randint(0, len(members)), Member(name, _numbered_pickle(value)))
        for extra in range(rng.randint(0, 6)):
            other = f"archive/{rng.choice(['a', 'data.pk', 'zz', 'dat'])}{extra}"
            members.insert(rng.randint(1, len(members)), Member(other, b"x"))
        if not members[0].name.startswith("archive/"):
            continue
        path = tmp_path / f"dup{trial}.pt"
        path.write_bytes(make_zip(members))
        assert ckptool.load(path).container["v"] == _torch_loads(path)["v"], trial


@pytest.mark.parametrize("where", ["/data/0", "/byteorder"])
def test_duplicate_records_read_the_one_torch_reads(tmp_path: Path, where: str) -> None:
    members = saved_members(STATE)
    original = members[index_of(members, where)]
    folder, record = original.name.split("/", 1)
    changed = b"big" if where == "/byteorder" else bytes(len(original.data))
    for position in (0, len(members)):
        variant = list(members)
        variant.insert(position, Member(f"{folder}/{record.upper()}", changed))
        path = tmp_path / f"duplicate{position}.pt"
        path.write_bytes(make_zip(variant))
        assert assert_agree(path) in ("equal", "ckptool refuses")  # a big-endian mark is refused, one line
        assert run("scan", path)[0] in (0, 3)


def test_a_duplicate_torch_does_not_read_is_still_scanned(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    members = saved_members(STATE)  # a benign data.pkl first, two hostile copies after: torch reads the first
    members += [Member(members[index_of(members, "/data.pkl")].name, payload(canary)) for _ in range(2)]
    path = tmp_path / "dup.pt"
    path.write_bytes(make_zip(members))
    assert torch.equal(_torch_loads(path)["bias"], STATE["bias"])
    assert assert_agree(path) == "equal"
    code, out, _ = run("scan", path)
    assert code == 1 and "os.system" in out
    assert not canary.exists()


def test_duplicates_torch_never_reads_do_not_matter(tmp_path: Path) -> None:
    members = saved_members(STATE)
    members += [Member("archive/notes.txt", b"one"), Member("archive/notes.txt", b"two")]
    path = tmp_path / "notes.pt"
    path.write_bytes(make_zip(members))
    assert assert_agree(path) == "equal"
