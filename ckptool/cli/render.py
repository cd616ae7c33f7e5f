"""The text the commands print: one renderer per report (the --json objects are the reports' own).

Every line goes through :func:`echo`, which escapes whatever came from a file (see :mod:`ckptool.base.text`).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from ckptool.base.text import printable, value_repr

if TYPE_CHECKING:
    from ckptool.ops.diff import DiffReport
    from ckptool.ops.inspect import Summary
    from ckptool.ops.rewrite import WriteReport
    from ckptool.ops.scan import ScanReport
    from ckptool.ops.scan_tree import TreeReport
    from ckptool.verification.verify import VerifyReport


def echo(text: str = "", *, err: bool = False) -> None:
    """One line of text output; whatever came from a file is escaped, never sent to the terminal raw."""
    click.echo(printable(text), err=err)


def human_bytes(size: int) -> str:
    """``size`` in bytes as inspect shows it (``516.3 KB``)."""
    from ckptool.model.describe import human_bytes as human

    return human(size)


def summary(summary: Summary, *, every_tensor: bool = False) -> None:
    """inspect's description of a checkpoint, then its problems and their fixes; with ``every_tensor``
    the tensor listing names every key."""
    echo(f"{summary.path}")
    echo(f"  format         {summary.format}  ({human_bytes(summary.file_bytes)} on disk)")
    folder = summary.training_folder
    if folder is not None:
        chosen = [c["file"] for c in summary.candidates if c["chosen"]]
        read = (
            f": {len(chosen)} components, read together (--weights NAME reads one)"
            if len(chosen) > 1
            else f": weights from {chosen[0]}"
            if chosen
            else ": no model weights"
        )
        echo(f"  folder         {folder.kind}{read}")
    layout = (
        "(top level)"
        if summary.layout == []
        else ("none found" if summary.layout is None else " -> ".join(value_repr(k) for k in summary.layout))
    )
    if summary.module_class is not None:
        layout += f" (whole-model pickle: {summary.module_class}, {summary.tensors} tensors)"
    echo(f"  weights at     {layout}")
    others = [c for c in summary.candidates if "component" not in c]
    if folder is not None and folder.components:
        _components(summary)
    if len(summary.candidates) > 1 and others:  # more than one set of weights: each, and how to pick it
        for candidate in others[:20]:
            what = candidate["kind"] + (f": {candidate['module_class']}" if candidate["module_class"] else "")
            count = (
                f"{candidate['tensors']} tensors"
                if candidate["tensors"] is not None
                else f"unreadable: {candidate.get('problem', '')}"
            )
            mark = "(chosen)" if candidate["chosen"] else f"--weights {shlex.quote(candidate['weights'])}"
            echo(f"  weights set    {candidate['weights']}  ({what}, {count})  {mark}")
        if len(others) > 20:
            echo(f"  weights set    ... and {len(others) - 20} more (--json lists them)")
    echo(f"  wrapper prefix {summary.prefix or '(none)'}")
    dtypes = ", ".join(f"{name}: {count}" for name, count in summary.dtypes.items()) or "-"
    echo(
        f"  tensors        {summary.tensors}  "
        f"({summary.parameters:,} parameters, {human_bytes(summary.bytes)}; {dtypes})"
    )
    if summary.state_dict is None and not (folder is not None and len(folder.components) > 1):
        _module_block(summary)  # (--tensors gives the whole table; a folder's components are listed above)
    devices = ", ".join(f"{tag}: {count}" for tag, count in summary.saved_devices.items()) or "-"
    echo(f"  saved devices  {devices}  (storages per location tag)")
    if summary.tied:
        echo(f"  shared storage {len(summary.tied)} group(s): " + "; ".join(" = ".join(g) for g in summary.tied[:5]))
    for key, entry in summary.entries.items():
        echo(f"  entry          {key}: {entry['summary']}")
    if folder is not None:
        if folder.step is not None:
            echo(f"  step           {folder.step}  ({folder.step_from})")
        for file in folder.files:
            label = file.role if len(file.role) <= 14 else "file"
            echo(f"  {label:<14} {file.file}: {file.summary}")
    if summary.globals:
        echo(f"  pickle globals {', '.join(summary.globals)}")
    for key, value in summary.metadata.items():
        shown = value if len(value) <= 70 else value[:67] + "..."
        echo(f"  metadata       {key} = {shown}")
    if summary.fingerprint:
        echo(f"  fingerprint    {summary.fingerprint}")
    for note in summary.notes:
        echo(f"  note           {note}")
    if summary.state_dict is not None:
        echo("")
        if every_tensor:
            _every_tensor(summary)
        else:
            _grouped_tensors(summary)
    if summary.hints:
        echo("")
        for hint in summary.hints:
            echo(f"  ! {hint.problem}")
            echo(f"    fix: {hint.fix}")


def _components(summary: Summary) -> None:
    """A model folder's components: each one's file, format, counts and variants, and how to take it."""
    folder = summary.training_folder
    cells = []
    for part in folder.components[:40]:
        if part.problem is not None:
            counts = ["", "", f"unreadable: {part.problem}", ""]
        else:
            counts = [
                f"{part.tensors} tensor" + ("" if part.tensors == 1 else "s"),
                f"{part.parameters:,} parameters",
                ", ".join(part.dtypes),
                human_bytes(part.bytes or 0),
            ]
        variants = f"variants: {', '.join(part.variants)}" if part.variants else ""
        together = all(p.chosen for p in folder.components) and len(folder.components) > 1
        mark = "(chosen)" if part.chosen and not together else f"--weights {shlex.quote(part.name)}"
        cells.append([part.name, part.file, part.format or "", *counts, variants, mark])
    for number, line in enumerate(_table(cells, right=(3, 4, 6))):
        echo(f"  {'component' if number == 0 else '':<14} {line}")
    if len(folder.components) > 40:
        echo(f"  {'':<14} ... and {len(folder.components) - 40} more (--json lists them)")
    if folder.variants:
        shown = ", ".join(folder.variants)
        echo(f"  variants       {shown}  (--variant {shlex.quote(folder.variants[0])} reads one)")


MODULE_ROWS = 12  # the modules plain inspect shows; the rest are summed in one line


def _module_block(summary: Summary) -> None:
    """Plain inspect's parameters per top-level module (per component for a model folder's keys),
    when there is more than one."""
    rows, label = (summary.components, "components") if len(summary.components) > 1 else (summary.modules, "modules")
    if len(rows) < 2:
        return
    shown = rows[: MODULE_ROWS - 1] if len(rows) > MODULE_ROWS else rows
    rest = rows[len(shown) :]
    totals = [(row.name, row.tensors, row.parameters, row.bytes) for row in shown]
    if rest:
        totals.append(
            (
                f"... {len(rest)} more",
                sum(row.tensors for row in rest),
                sum(row.parameters for row in rest),
                sum(row.bytes for row in rest),
            )
        )
    counts = max(len(str(count)) for _, count, _, _ in totals)
    numbers = max(len(f"{parameters:,}") for _, _, parameters, _ in totals)
    cells = [
        (
            name,
            f"{count:>{counts}} tensor" + ("" if count == 1 else "s"),
            f"{parameters:>{numbers},} parameters",
            human_bytes(size),
        )
        for name, count, parameters, size in totals
    ]
    for number, line in enumerate(_table(cells, right=(3,))):
        echo(f"  {label if number == 0 else '':<14} {line}")


def _table(cells: Sequence[Sequence[str]], *, right: tuple[int, ...] = ()) -> list[str]:
    """Rows of cells as aligned columns (those in ``right`` aligned right), two spaces apart; a column
    empty in every row is left out."""
    widths = [max(len(row[column]) for row in cells) for column in range(len(cells[0]))] if cells else []
    return [
        "  ".join(
            cell.rjust(width) if column in right else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(row, widths))
            if width
        ).rstrip()
        for row in cells
    ]


def _shape(shape: Any) -> str:
    return "[" + ", ".join("*" if size is None else str(size) for size in shape) + "]"  # *: varies by piece


def _every_tensor(summary: Summary) -> None:
    """--tensors --all: each key as torch's state dict holds it (a sparse tensor whole)."""
    records = summary.state_dict or []
    width = max((len(t.name) for t in records), default=4)
    dtype_width = max((len(t.dtype) for t in records), default=5)  # QUINT4X2 included
    for tensor in records:
        layout = (
            ""
            if tensor.layout == "strided"
            else f"  {tensor.layout}" + (f" {tensor.qscheme}" if tensor.qscheme else "")
        )
        shape = _shape(tensor.shape)
        echo(f"  {tensor.name:<{width}}  {tensor.dtype:<{dtype_width}} {shape:<20} {tensor.device}{layout}")


def _grouped_tensors(summary: Summary) -> None:
    """--tensors: one row per repeated tensor (``layers.{0..31}.q.weight  ×32``), then the parameters per module."""
    groups = summary.tensor_groups()
    cells = []
    for group in groups:
        kind = "" if group.layout == "strided" else group.layout + (f" {group.qscheme}" if group.qscheme else "")
        if group.device == "meta":
            kind = (kind + " meta").strip()
        cells.append(
            (
                group.pattern,
                f"×{group.count}" if group.count > 1 else "",
                group.dtype,
                _shape(group.shape),
                "-" if group.device == "meta" else human_bytes(group.bytes),
                kind,
            )
        )
    for line in _table(cells, right=(1, 4)):
        echo(f"  {line}")
    if len(groups) < len(summary.state_dict or []):
        echo(f"  ({len(summary.state_dict or [])} keys in {len(groups)} rows; --all lists every key)")
    if len(summary.modules) >= len(summary.state_dict or []):  # (each key its own module: the rows say it all)
        return
    echo("")
    rows = [("module", "tensors", "parameters", "size")]
    components = {row.name: row for row in summary.components}
    last = None
    for module in summary.modules:
        if module.component is not None and module.component != last:
            last = module.component
            whole = components[last]
            rows.append((f"{last}/", str(whole.tensors), f"{whole.parameters:,}", human_bytes(whole.bytes)))
        name = module.name if module.component is None else f"  {module.name}"
        rows.append((name, str(module.tensors), f"{module.parameters:,}", human_bytes(module.bytes)))
    for line in _table(rows, right=(1, 2, 3)):
        echo(f"  {line}")


def scan(report: ScanReport) -> None:
    """scan's verdict (safe, unknown or dangerous), its globals (each one outside the allowlist marked:
    ``! `` unknown, ``!!`` dangerous) and its notes, closing with what the verdict means for loading."""
    verdict = report.verdict if report.verdict == "safe" else report.verdict.upper()
    echo(
        f"{report.path}: {verdict} ({report.format}; {len(report.pickles)} pickle(s), "
        f"{sum(report.opcodes.values())} opcodes)"
    )
    unsafe, dangerous = set(report.unsafe), set(report.dangerous)  # a flood of names is listed in linear time
    for name, count in report.globals.items():
        mark = "  " if name not in unsafe else "!!" if name in dangerous else "! "
        echo(f"  {mark}{name}" + (f" x{count}" if count > 1 else "") + ("  (runs code)" if mark == "!!" else ""))
    for problem in report.problems:
        echo(f"  note: {problem}")
    if not report.unsafe:
        return
    unknown = len(report.unsafe) - len(report.dangerous)
    if unknown:
        # a framework's own classes: torch.load imports and builds them, so they need trust, not alarm
        read = (
            "ckptool reads the file with them as inert placeholders"
            if report.readable
            else "ckptool reads them as inert data only with --allow-global (if you trust the file)"
        )
        echo(
            f"  {unknown} unknown global(s) (! ) outside the allowlist, none known to run code: loading the file "
            f"with torch would import or compile their code and run it, so trust it first; {read}"
        )
    if report.dangerous:
        read = (
            "ckptool reads them as inert data only because you named them"
            if report.readable
            else "ckptool refuses to load this file"
        )
        echo(
            f"  {len(report.dangerous)} dangerous global(s) (!!) known to run code or reach the system: "
            f"do not torch.load this file; {read}"
        )


SKIPPED_SHOWN = 10  # skipped files named in the text summary (--json lists more)


def scan_tree(report: TreeReport, fail_on: str = "unknown") -> None:
    """scan's summary of many files: the counts by verdict, each dangerous, unknown and unreadable
    item with its globals or reason, the first skipped files, and what the verdict means."""
    counts = report.counts
    judged = counts["safe"] + counts["unknown"] + counts["dangerous"]
    echo(
        f"scanned {len(report.roots)} path(s): {judged} judged ({counts['safe']} safe, {counts['unknown']} unknown, "
        f"{counts['dangerous']} dangerous), {counts['unreadable']} unreadable, {counts['skipped']} skipped"
    )
    from ckptool.ops.scan_tree import SKIPPED_KEPT

    for verdict in ("dangerous", "unknown", "unreadable"):
        for item in report.items:
            if item.verdict != verdict:
                continue
            where = f"{item.path} ({item.format})" if item.format else item.path
            if verdict == "unreadable":
                echo(f"  UNREADABLE  {where}: {item.reason}")
                continue
            names = item.dangerous if verdict == "dangerous" else item.unknown
            shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
            echo(f"  {verdict.upper():<10}  {where}: {shown}")
            if verdict == "dangerous" and item.unknown:
                echo(f"              and unknown: {', '.join(item.unknown[:6])}")
    for item in report.skipped[:SKIPPED_SHOWN]:
        echo(f"  skipped     {item.path}: {item.reason}")
    if counts["skipped"] > SKIPPED_SHOWN:
        listed = "lists them all" if counts["skipped"] <= SKIPPED_KEPT else f"lists the first {SKIPPED_KEPT}"
        echo(f"  skipped     ... {counts['skipped'] - SKIPPED_SHOWN} more (--json {listed})")
    if report.missing:
        echo(f"  {len(report.missing)} path(s) do not exist — check them")
    elif not judged:
        echo("  nothing was judged: no checkpoint or pickle could be read")
    if counts["dangerous"]:
        echo(
            "  dangerous files (DANGEROUS) name globals known to run code or reach the system: do not torch.load "
            "them; delete them or get them from a trusted source"
        )
    if counts["unknown"]:
        note = " (not failing: --fail-on dangerous)" if fail_on == "dangerous" else ""
        echo(
            "  unknown files (UNKNOWN) name globals outside the allowlist, none known to run code: loading them with "
            f"torch runs that code, so trust their source first; ckptool scan FILE shows one in full{note}"
        )


def write(report: WriteReport, headline: str) -> None:
    """A write command's ``headline``, then what the check proved and the notes."""
    if report.saved.dry_run:
        echo(f"dry run, nothing written: {headline}")
        for file in report.saved.files:
            echo(f"  would write {file}")
    else:
        echo(headline)
        echo(
            f"  checked: all {report.saved.checked} tensors re-read from the output, identical (names, dtypes, shapes, "
            "CRC32)"
        )
    if report.saved.fingerprint:
        echo(f"  fingerprint {report.saved.fingerprint}")
    for note in report.notes:
        echo(f"  note: {note}")


def _fmt_err(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return "0" if value == 0 else f"{value:.3g}"


def _fmt_fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _key_groups(groups: dict[str, list[str]]) -> str:
    shown = [f"{module} ({len(keys)})" for module, keys in list(groups.items())[:8]]
    return ", ".join(shown) + (", ..." if len(groups) > 8 else "")


def _diagnosis(diagnosis: dict[str, Any]) -> None:
    echo(f"  load     FAILED: {diagnosis['problem']}")
    echo(f"           fix: {diagnosis['fix']}")
    for label, groups in (("missing", diagnosis["missing"]), ("unexpected", diagnosis["unexpected"])):
        if groups:
            count = sum(len(keys) for keys in groups.values())
            echo(f"           {label} ({count} keys, by module): {_key_groups(groups)}")
    for mismatch in diagnosis["mismatched"][:5]:
        echo(
            f"           shape differs: {mismatch['key']} {mismatch['checkpoint_shape']} in the checkpoint, "
            f"{mismatch['model_shape']} in the model"
        )
    after = diagnosis["after_rewrite"]
    if diagnosis["rewrite"] and (after["missing"] or after["unexpected"] or after["mismatched"]):
        echo(f"           after {diagnosis['rewrite']}: {after['matched']} of {diagnosis['model_keys']} keys fit")


def verify(report: VerifyReport) -> None:
    """verify's table: the load, each device's run, the comparison with --against, the verdict."""
    head = f"verify {report.path} ({report.format})"
    if report.model:
        head += f" with {report.model} ({report.model_class})"
        if report.input_shape:
            head += f", input {'x'.join(map(str, report.input_shape))}"
        if report.dtype:
            head += f", {report.dtype} atol {report.atol:g} rtol {report.rtol:g}"
    echo(head)
    load = report.load
    if not load.get("ok"):
        _diagnosis(load["diagnosis"])
    else:
        keys = load.get("rewrite") or "keys as stored"
        count = load.get("matched", load.get("tensors"))
        echo(f"  load     ok — {count} tensors, {keys}")
    if report.devices:
        echo(f"  {'device':<9}{'result':<8}{'weights':<11}{'max abs err':<13}{'max rel err':<13}{'argmax':<8}accuracy")
        for row in report.devices:
            weights = (
                "identical"
                if row.weights_identical
                else ("-" if row.error and not row.differing_weights else "CHANGED")
            )
            echo(
                f"  {row.device:<9}{'ok' if row.ok else 'FAILED':<8}{weights:<11}{_fmt_err(row.max_abs_err):<13}"
                f"{_fmt_err(row.max_rel_err):<13}{_fmt_fraction(row.argmax_agreement):<8}"
                f"{_fmt_fraction(row.accuracy)}"
            )
            if row.differing_weights:
                echo(f"           changed on {row.device}: {', '.join(row.differing_weights[:5])}")
            if row.error:
                echo(f"           error on {row.device}: {row.error}")
            for name, counts in list(row.nonfinite.items())[:5]:
                echo(f"           {name}: {counts['nan']} NaN, {counts['inf']} Inf")
    against = report.against
    if against is not None:
        compared = against.diff
        if compared.identical:
            text = f"weights identical ({compared.byte_identical} of {compared.compared} tensors byte-identical)"
        else:
            text = (
                f"weights DIFFER: {len(compared.changed)} changed, {len(compared.only_in_a)} only here, "
                f"{len(compared.only_in_b)} only there"
            )
        if against.within_tolerance is not None:
            text += f"; outputs max abs err {_fmt_err(against.max_abs_err)}" + (
                "" if against.within_tolerance else " (beyond tolerance)"
            )
        echo(f"  against  {against.path} ({against.format}): {text}")
        for change in compared.changed[:5]:
            echo(
                f"           {change.name}: {' and '.join(change.kinds)}"
                + (f", max abs diff {_fmt_err(change.max_abs_diff)}" if change.max_abs_diff is not None else "")
            )
        if against.error:
            echo(f"           {against.error}")
        for note in compared.notes:
            echo(f"           note: {note}")
    for note in report.notes:
        echo(f"  note     {note}")
    if report.ok:
        where = ", ".join(row.device for row in report.devices)
        echo(f"verified: ok on {where}" + (" and against " + report.against.path if report.against else ""))
    else:
        echo("verify FAILED")


def diff(report: DiffReport) -> None:
    """diff's two sides, each changed tensor, and the verdict."""
    echo(f"A  {report.a} ({report.a_format}, {report.a_tensors} tensors)")
    echo(f"B  {report.b} ({report.b_format}, {report.b_tensors} tensors)")
    for label, names in (("only in A", report.only_in_a), ("only in B", report.only_in_b)):
        if names:
            echo(f"  {label:<10} {len(names)}: {', '.join(names[:6])}{', ...' if len(names) > 6 else ''}")
    for change in report.changed:
        parts = []
        if "dtype" in change.kinds:
            parts.append(f"dtype {change.a_dtype} -> {change.b_dtype}")
        if "shape" in change.kinds:
            parts.append(f"shape {list(change.a_shape)} -> {list(change.b_shape)}")
        if change.max_abs_diff is not None and change.differing:
            parts.append(
                f"max abs diff {_fmt_err(change.max_abs_diff)} ({change.beyond_atol} of "
                f"{_numel(change.a_shape)} elements beyond atol {report.atol:g})"
            )
        echo(f"  changed    {change.name}: {'; '.join(parts)}")
    if report.compared:
        echo(
            f"  same       {report.byte_identical} of {report.compared} common tensors byte-identical"
            + (f"; max abs diff {_fmt_err(report.max_abs_diff)}" if report.max_abs_diff else "")
        )
    for note in report.notes:
        echo(f"  note       {note}")
    if report.identical:
        echo(
            f"identical: {report.compared} tensors"
            + (" byte for byte" if report.byte_identical == report.compared else f" within atol {report.atol:g}")
        )
    else:
        echo(
            f"different: {len(report.changed)} changed, {len(report.only_in_a)} only in A, "
            f"{len(report.only_in_b)} only in B"
        )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
