"""Zip members are located as torch's reader (PyTorchStreamReader over miniz) locates them.

torch goes by the central directory (the local header is read only for the lengths that place the
data: the name it repeats is never compared), does not check CRCs, compares names ignoring ASCII
case, and of several members matching one name reads whichever miniz's unstable sort puts first.
So, for crafted zips generated here from real ``torch.save`` files:

- a pickle torch would run is always examined by ``scan`` (exit 1 naming what it imports), never
  called corrupt — also a ``.pkl`` torch never reads (``archive/data/../x.pkl``);
- a benign variant torch loads is read with torch's values, or (duplicate names, where which one
  torch reads depends on every other name in the archive) refused in one line.
"""

from __future__ import annotations

import io
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import ckptool  # noqa: E402

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
    assert "UNSAFE" in out and "os.system" in out
    code, out, err = run("scan", "--json", path)
    assert code == 1 and '"os.system"' in out
    code, out, err = run("inspect", path)
    if name in ("pickle_behind_dotdot", "pickle_named_like_a_record"):  # torch never reads it: the weights load
        assert code == 0 and assert_agree(path) == "equal"
    else:
        assert code == 3 and len(err.strip().splitlines()) == 1, err
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


@pytest.mark.parametrize("where", ["/data.pkl", "/data/0", "/byteorder"])
def test_duplicate_names_torch_reads_are_refused_in_one_line(tmp_path: Path, where: str) -> None:
    """Which duplicate torch reads depends on miniz's unstable sort of every name: not guessed."""
    members = saved_members(STATE)
    original = members[index_of(members, where)]
    folder, record = original.name.split("/", 1)
    members.append(Member(f"{folder}/{record.upper()}" if where == "/byteorder" else original.name, original.data))
    path = tmp_path / "duplicate.pt"
    path.write_bytes(make_zip(members))
    _torch_loads(path)  # torch reads it (one of the two)
    with pytest.raises(ckptool.CkptError, match="ambiguous") as caught:
        ckptool.load(path)
    assert "\n" not in caught.value.message and where.lstrip("/") in caught.value.message
    code, out, err = run("inspect", path)
    assert code == 3 and len(err.strip().splitlines()) == 1 and "ambiguous" in err
    # nothing unsafe in either duplicate: scan's answer is the load's refusal, after reading both
    code, out, err = run("scan", path)
    assert code == 3 and "ambiguous" in err


def test_duplicates_torch_never_reads_do_not_matter(tmp_path: Path) -> None:
    members = saved_members(STATE)
    members += [Member("archive/notes.txt", b"one"), Member("archive/notes.txt", b"two")]
    path = tmp_path / "notes.pt"
    path.write_bytes(make_zip(members))
    assert assert_agree(path) == "equal"
