"""A global is judged by what it resolves to: ``runs_code`` against the real sources and real aliases.

``ckptool.pickles.gadgets`` judges names from tables, the same on every machine; the census's table
(``ckptool/pickles/gadget_table.py``) is written by ``scripts/gadget_census.py``. This file holds the
tables to the torch, numpy and Python installed here, so a release of theirs that adds a gadget fails
until the table is written again:

- a census of their sources (``ast``, nothing imported): every function whose body calls something
  that runs code or reaches the system is dangerous under its own name, and a class whose
  ``__init__``/``__new__``/``__setstate__`` does so is dangerous as the class;
- their aliases (torch and numpy imported): every attribute of every torch, numpy and inert
  standard-library module that *is* such a function, class or code-running module is dangerous under
  that spelling too (``numpy.testing.runstring``, ``torch.serialization.os``);
- the names the trust review found, spelled the ways a pickle can, and no pattern accepts them;
- and no false alarm: every global of every committed real checkpoint is not dangerous.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ckptool
from ckptool.pickles import GlobalResolver, runs_code

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import gadget_census  # noqa: E402 — the census and its table's writer


@pytest.fixture(scope="module")
def flagged() -> set[str]:
    return gadget_census.flagged()


def test_the_census_finds_what_it_looks_for(flagged: set[str]) -> None:
    for package in ("torch.", "numpy.", "subprocess.", "pickle."):
        assert sum(name.startswith(package) for name in flagged) >= 1, package
    assert len(flagged) > 1000
    assert "torch.fx.graph_module._exec_with_source" in flagged and "runpy._run_code" in flagged


def test_every_function_that_runs_code_in_the_sources_is_dangerous(flagged: set[str]) -> None:
    missed = sorted(name for name in flagged if not runs_code(name))
    assert not missed, f"{len(missed)} gadgets judged not dangerous (run scripts/gadget_census.py): {missed}"


def test_every_alias_of_a_gadget_is_dangerous() -> None:
    # in a process of its own: the modules walked are those importing torch and numpy loads, whatever else
    # this process has imported
    done = subprocess.run([sys.executable, gadget_census.__file__, "--check-aliases"], capture_output=True, text=True,
                          timeout=600)
    missed = done.stdout.split()
    assert done.returncode == 0 and not missed, \
        f"{len(missed)} aliases of gadgets judged not dangerous (run scripts/gadget_census.py): {missed} {done.stderr}"


# ---------------------------------------------------------------------------------------------- spellings


ISSUE_NAMES = [
    "builtins.eval.__call__", "builtins.exec.__call__", "builtins.getattr.__self__.eval", "__builtin__.eval.__call__",
    "torch.os.system", "torch.serialization.os.system", "pathlib.os.system", "uuid.os.system", "argparse._os.system",
    "torch.serialization.pickle.loads", "numpy.testing.runstring", "torch.fx.graph_module._exec_with_source",
    "torch.storage._load_from_bytes", "pathlib.PosixPath.write_text", "pathlib.PosixPath.unlink", "torch.os",
    "torch.serialization.os", "collections._sys.modules", "typing.sys.modules", "random._os.system",
    "torch.fx.graph_module.reduce_graph_module", "numpy.core._ufunc_reconstruct", "torch._utils._import_dotted_name",
    "functools.partial.__call__", "collections.OrderedDict.__init__.__globals__", "argparse.FileType",
]
BENIGN_NAMES = [
    "collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch.serialization._get_layout",
    "torch.jit._pickle.build_intlist", "torch.distributed.checkpoint.metadata.Metadata", "argparse.Namespace",
    "pathlib.PosixPath", "typing.Any", "builtins.set", "__builtin__.set", "_codecs.encode",
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray.scalar", "numpy.dtype", "numpy.ndarray",
    "numpy.random._pickle.__randomstate_ctor", "omegaconf.dictconfig.DictConfig", "torch.nn.modules.linear.Linear",
    "torch.nn.parameter.Parameter", "ultralytics.nn.tasks.DetectionModel",
    "mmengine.logging.history_buffer.HistoryBuffer.min", "copyreg._reconstructor", "copy_reg._reconstructor",
    "__main__.Net", "__torch__.torch.nn.modules.linear.___torch_mangle_0.Linear", "functools.partial",
    "builtins.ValueError", "datetime.datetime", "re._compile", "collections.defaultdict", "random.Random",
    "transformers.training_args.TrainingArguments", "transformers.utils.logging.get_logger",
]


@pytest.mark.parametrize("name", ISSUE_NAMES)
def test_a_name_is_judged_by_what_it_resolves_to(name: str) -> None:
    assert runs_code(name)
    # no pattern accepts it, however broad; only its exact name reads it (as inert data)
    top = name.split(".")[0]
    for patterns in (["*"], [f"{top}.*"], [name.rsplit(".", 1)[0] + ".*"]):
        assert not GlobalResolver(patterns).is_allowed(name), patterns
    assert GlobalResolver([name]).is_allowed(name)


@pytest.mark.parametrize("name", BENIGN_NAMES)
def test_data_and_framework_names_are_not_dangerous(name: str) -> None:
    assert not runs_code(name)


def test_no_global_of_a_committed_real_checkpoint_is_dangerous(fixtures_dir: Path) -> None:
    names: set[str] = set()
    for path in sorted(fixtures_dir.rglob("*")):
        if path.is_file() and path.suffix in (".pt", ".pth", ".ckpt", ".bin", ".pkl"):
            try:
                names.update(ckptool.scan(path, allow_globals=["*"]).globals)
            except ckptool.base.errors.CkptError:
                continue
    assert len(names) > 40
    assert not [name for name in names if runs_code(name)]
