"""How a load's refusal of globals reads: the globals named, and the fix (or, for code-running ones, none)."""

from __future__ import annotations

from ckptool.base.suggest import Wording, option
from ckptool.pickles.allowlist import RefusedGlobal, runs_code

SHOWN_GLOBALS = 10  # a refusal names this many globals, then "and N more"; past it, its fix uses patterns


def refusal(refused: RefusedGlobal) -> Wording:
    """A load's refusal of every global it refused, in the order the pickle names them, and the fix.

    Unknown globals only: the flags that allow them all (one ``--allow-global`` per name; past
    :data:`SHOWN_GLOBALS`, a pattern per top-level package, and ``'*'``), to add to the same
    command. A global known to run code (:func:`ckptool.pickles.allowlist.runs_code`): no flag at all — the
    file says it runs code, and should not be trusted.
    """
    names = refused.names
    shown = ", ".join(names[:SHOWN_GLOBALS]) + (
        f" and {len(names) - SHOWN_GLOBALS} more" if len(names) > SHOWN_GLOBALS else ""
    )
    partial = "" if refused.complete else " (the read stopped early, so more may follow)"
    dangerous = [name for name in names if runs_code(name) or name in refused.called_on]
    if len(names) == 1 and names[0] in refused.called_on:
        head = (
            f"pickle calls {refused.called_on[names[0]]} on an object of {names[0]} while unpickling, which runs "
            "that class's code"
        )
    elif len(names) == 1:
        head = f"pickle imports {names[0]}, which {'runs' if dangerous else 'could run'} code"
    else:
        head = f"pickle imports {len(names)} globals outside the allowlist: {shown}{partial}"
        partial = ""
    if dangerous:
        which = ", ".join(dangerous[:SHOWN_GLOBALS]) + (" ..." if len(dangerous) > SHOWN_GLOBALS else "")
        cause = "" if len(names) == 1 else f"; {which} {'runs' if len(dangerous) == 1 else 'run'} code"
        return Wording(
            f"{head}{partial} — refused, nothing was executed{cause}: a file naming code-running "
            "globals should not be trusted (do not torch.load it)"
        )
    if len(names) == 1:
        return (
            f"{head}{partial} — refused, nothing was executed (if you trust this file, allow it by name: "
            + option("allow_globals", names)
            + ")"
        )
    fix = Wording("if you trust this file, allow them: ") + option("allow_globals", allow_patterns(names))
    if len(names) > SHOWN_GLOBALS:
        fix = fix + ", or read every global as inert data: " + option("allow_globals", ["*"])
    return f"{head}{partial}, any of which could run code — refused, nothing was executed (" + fix + ")"


def allow_patterns(names: list[str]) -> list[str]:
    """What ``--allow-global`` needs to allow ``names``: the names themselves, up to
    :data:`SHOWN_GLOBALS`; past that, ``package.*`` for each top-level package naming two or more
    (a pattern never allows a code-running global, so ``builtins.*`` stays safe to suggest), or
    just ``*`` when even those are too many."""
    if len(names) <= SHOWN_GLOBALS:
        return list(names)
    packages: dict[str, list[str]] = {}
    for name in names:
        packages.setdefault(name.split(".", 1)[0], []).append(name)
    patterns = [group[0] if len(group) == 1 else f"{package}.*" for package, group in packages.items()]
    return patterns if len(patterns) <= SHOWN_GLOBALS else ["*"]
