"""``SessionDirs``: the sessions' working directories inside an executor's working directory,
one per session, never shared."""

from __future__ import annotations

from pathlib import Path, PurePath

from kernelexec._notebooks._io import safe_filename


class SessionDirs:
    """The names in use under the executor's working directory, and those this executor made
    (it may use a directory again only if it made it)."""

    def __init__(self) -> None:
        self._used: set[str] = set()
        self._made: set[str] = set()

    def take(self, workdir: PurePath, agent_id: str) -> PurePath:
        """A session's directory: ``<workdir>/<agent id>``, or ``<agent id>-2``... when that
        name is in use. On the host's filesystem the directory is made here: one that exists
        already (another executor sharing the workdir, or an earlier run) is never taken over,
        so two executors never share a session's files."""
        base = safe_filename(agent_id)
        n = 1
        while True:
            name = base if n == 1 else f"{base}-{n}"
            n += 1
            if name in self._used:
                continue
            path = workdir / name
            if isinstance(path, Path) and name not in self._made:
                try:
                    path.mkdir()
                except FileExistsError:
                    continue
                self._made.add(name)
            self._used.add(name)
            return path

    def give_back(self, path: PurePath | str) -> None:
        """The session of ``path`` is gone: its name may be used again."""
        self._used.discard(PurePath(path).name)
