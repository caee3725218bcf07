"""A session's working directory copied: the one rule for what of it a copy carries.

Three jobs copy a working directory, every one through :mod:`kernelexec._trees` (descriptors,
nothing followed, bounded): a snapshot or a fork copies it into another directory and a restore
copies that back (:data:`SNAPSHOT`), ``hibernate()`` archives it (:data:`ARCHIVE`), and a capped
directory moves between the host's disk and a tmpfs (:data:`CAPPED`; :mod:`._sandbox._disk`).
What each one carries is declared here, side by side, so the differences are deliberate:

=====================  ===========  ================  =====================
entry                  snapshot     archive           capped
=====================  ===========  ================  =====================
directories, files     copied       archived          copied
symbolic links         as links     left out (named)  as links
whiteouts (char 0:0)   left out     left out (named)  kept (overlayfs's)
the host's folders     left out     the state's out   kept (same directory)
past the depth bound   refused      left out (named)  left out (named)
=====================  ===========  ================  =====================

The host's folders at a working directory's top are :data:`LAYERS` (the layers of directories
lent to its kernels, which belong to the kernel's mount namespace) and :data:`STATE` (durable
state's staging folder, where the archive itself is written). A capped directory is the same
directory on another medium, so it keeps both.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kernelexec import _trees

log = logging.getLogger("kernelexec")

LAYERS = ".kx-lent"
"""The folder of a working directory holding the layers of the directories lent to its kernels
copy on write (:mod:`kernelexec._sandbox._lend`): it stays the host's, 0700, and only the upper
layers inside it change hands."""

STATE = ".kernelexec-state"
"""Durable state's staging folder in a working directory (the kernel half's ``STAGING``; a
test checks they agree: that half is sent to kernels as text and imports nothing)."""

_OPAQUE = "trusted.overlay.opaque"
"""Overlayfs's mark on a directory that hides what the lower layer has there (one the kernel
removed and made again): kept by a capped directory's copy. Overlayfs sets it; a tenant cannot
set it by hand, and it only ever hides the lower layer in that tenant's own view."""


@dataclass(frozen=True)
class Rule:
    """What one job's copy of a working directory carries (see the module's table).

    Attributes:
        skip_top: Names at the top left out.
        whiteouts: Overlayfs's whiteouts and its opaque mark on directories kept.
        leave_too_deep: What lies past the depth bound left out and named (else refused with
            a :class:`~kernelexec.TreeLimitError`).
    """

    skip_top: frozenset[str]
    whiteouts: bool
    leave_too_deep: bool


SNAPSHOT = Rule(frozenset({LAYERS}), whiteouts=False, leave_too_deep=False)
"""Snapshots, forks and restores: into another directory, the lent layers left out (they are
their kernel's, in the mount namespace a branch shares; overlayfs's own entries there are no
files)."""
ARCHIVE = Rule(frozenset({STATE}), whiteouts=False, leave_too_deep=True)
"""``hibernate()``'s archive: directories and plain files with one link (:func:`walk`)."""
CAPPED = Rule(frozenset(), whiteouts=True, leave_too_deep=True)
"""A capped directory between the disk and its tmpfs: everything, as it is."""


def copy(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    rule: Rule,
    *,
    outside_links: bool = True,
) -> dict[str, str]:
    """Copy the working directory ``source`` into the existing directory ``target`` as
    ``rule`` says; what was left out (path: why). With ``outside_links=False`` a file that also
    has links outside the tree is left out (a link planted to a host file never reaches a
    kernel's user).

    Raises:
        TreeLimitError: the directory passes a bound the rule does not leave out.
    """
    src = _trees.open_top(source)
    try:
        dst = _trees.open_top(target)
        try:
            done = _trees.copy(
                src,
                dst,
                where=os.fspath(source),
                skip_top=rule.skip_top,
                outside_links=outside_links,
                whiteouts=rule.whiteouts,
                xattrs=(_OPAQUE,) if rule.whiteouts else (),
                skip_too_deep=rule.leave_too_deep,
            )
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return done.skipped


def replace(source: Path, target: Path) -> None:
    """Make ``target``'s content a copy of ``source``'s (a restore's working directory) by
    :data:`SNAPSHOT`; the host's lent layers in ``target`` stay.

    Raises:
        TreeLimitError: the copy passes a bound of the walk.
    """
    dst = _trees.open_top(target)
    try:
        _trees.clear(dst, keep=SNAPSHOT.skip_top)
    finally:
        os.close(dst)
    skipped = copy(source, target, SNAPSHOT)
    if skipped:
        log.info("left out of the copy of %s: %r", source, skipped)


def walk(top: int, workdir: Path, skipped: dict[str, str]) -> Iterator[_trees.Entry]:
    """The entries :data:`ARCHIVE` reads from the working directory open at ``top``; what lies
    past the depth bound is named in ``skipped``. (The archive itself keeps only directories
    and plain files with one link, checked once each is open.)"""

    def deep(entry: _trees.Entry) -> None:
        skipped[entry.rel + "/"] = "deeper than the walk goes (not saved)"

    return _trees.walk(top, where=str(workdir), skip_top=ARCHIVE.skip_top, too_deep=deep)


def signature(workdir: Path) -> tuple[tuple[str, int, int], ...]:
    """What the working directory holds as :data:`ARCHIVE` sees it, cheaply: (path, size,
    mtime) of every entry.

    Raises:
        TreeLimitError: the directory passes a bound of the walk.
    """
    top = _trees.open_top(workdir)
    try:
        return _trees.signature(
            top, where=str(workdir), skip_top=ARCHIVE.skip_top, too_deep=_trees.leave
        )
    finally:
        os.close(top)
