"""The kernel half of durable sessions: saving the user's namespace to staged record files and
loading it back. Installed in the kernel as text (a kernel module); standard library only
(``cloudpickle`` is used when the kernel has it, so that functions and classes defined in the
kernel are saved by value).

A checkpoint is a set of records, each one file in the staging directory:

- ``raw``: one name whose value is ``bytes`` of 64 KiB or more, written as is (no copy
  through pickle);
- ``atoms``: every name whose value is an immutable scalar, string or small ``bytes``,
  pickled together (one file, one ``fsync``);
- ``module``: one name bound to an imported module, saved as the import (no file);
- ``group``: every other name, pickled as one graph (objects shared between names stay
  shared), protocol 5 with large buffers written out of band after the pickle.

Incremental: the module remembers what it saved last (per checkpoint generation). A raw name,
or the atoms as a whole, bound to the same objects as then (same ``id``: immutable, and kept
alive by the memory) is not written again; the group is pickled and only written when its
checksum changed. Every record carries its size and CRC-32, checked here
before a value is loaded, so a damaged or truncated file is never loaded as a wrong value.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import socket
import stat
import sys
import threading
import types
import zlib
from typing import Any

MODULE_NAME = "__kernelexec_state__"
"""The name of this module in the kernel's ``sys.modules``."""

RESULT_MIME = "application/vnd.kernelexec.state+json"
"""The mimetype of this module's answers in ``user_expressions``."""

STAGING = ".kernelexec-state"
"""The staging directory's name inside the session's working directory."""

HOOK_KEY = "checkpoint"
"""The key of the after-call checkpoint in the kernel side's report."""

_ATOMS = (bool, int, float, complex, str, type(None))
_REFUSED: tuple[tuple[Any, str], ...] = (
    (io.IOBase, "an open file"),
    (socket.socket, "a socket"),
    (types.GeneratorType, "a generator"),
    (types.CoroutineType, "a coroutine"),
    (types.AsyncGeneratorType, "an async generator"),
    (threading.Thread, "a thread"),
    (type(threading.Lock()), "a lock"),
    (type(threading.RLock()), "a lock"),
    (types.FrameType, "a frame"),
    (types.TracebackType, "a traceback"),
)
_RAW_MIN = 64 * 1024
_last: dict[str, Any] = {"gen": None, "raw": {}, "atoms": None, "group": None, "env": None}


class Refused(Exception):
    """A value kernelexec will not save (it would come back half-working)."""


def _refusal(obj: Any) -> str | None:
    for kind, what in _REFUSED:
        if isinstance(obj, kind):
            return what
    return None


def _pickler_class() -> tuple[Any, str]:
    try:
        import cloudpickle  # type: ignore[import-not-found,import-untyped,unused-ignore]

        base: Any = cloudpickle.Pickler
        name = "cloudpickle"
    except ImportError:
        base, name = pickle.Pickler, "pickle"

    class Pickler(base):  # type: ignore[misc]
        def reducer_override(self, obj: Any) -> Any:
            what = _refusal(obj)
            if what is not None:
                raise Refused(f"holds {what}")
            if name == "pickle" and _made_here(obj):
                raise Refused("defined in the kernel; saving it needs cloudpickle in the kernel")
            parent = getattr(super(), "reducer_override", None)
            return parent(obj) if parent is not None else NotImplemented

    return Pickler, name


def _made_here(obj: Any) -> bool:
    return isinstance(obj, type | types.FunctionType) and getattr(obj, "__module__", "") in (
        "__main__",
        None,
    )


def _user_ns() -> dict[str, Any]:
    from IPython import get_ipython  # type: ignore[attr-defined,unused-ignore]

    return get_ipython().user_ns  # type: ignore[no-any-return]


def _user_names() -> list[str]:
    # the kernel side's own rule (installed in every kernel kernelexec starts)
    return list(sys.modules["__kernelexec__"].user_names())


class _Answer:
    """A JSON answer read back by the host from ``user_expressions``."""

    def __init__(self, data: Any) -> None:
        self._data = data

    def __repr__(self) -> str:
        return "<kernelexec state>"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {RESULT_MIME: json.dumps(self._data)}


# -- saving -----------------------------------------------------------------------------------


def _write(
    staging: str, data: Any, buffers: tuple[Any, ...] = ()
) -> tuple[str, int, int, list[int]]:
    """Write ``data`` (and ``buffers`` after it) to a new file; its name, size, CRC-32 and
    part sizes."""
    crc, size, parts = 0, 0, []
    fd, path = _new_file(staging)
    with os.fdopen(fd, "wb") as f:
        for part in (data, *buffers):
            view = memoryview(part).cast("B")
            f.write(view)
            crc = zlib.crc32(view, crc)
            size += view.nbytes
            parts.append(view.nbytes)
    return os.path.basename(path), size, crc, parts


def _new_file(staging: str) -> tuple[int, str]:
    path = os.path.join(staging, f"r{os.urandom(12).hex()}.rec")
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), path


def _pickle_group(values: dict[str, Any], pickler: Any) -> tuple[bytes, list[Any]]:
    buffers: list[Any] = []
    out = io.BytesIO()
    pickler(out, protocol=5, buffer_callback=buffers.append).dump(values)
    return out.getvalue(), [b.raw() for b in buffers]


def _split(ns: dict[str, Any], names: list[str]) -> tuple[dict[str, Any], ...]:
    raw, atoms, modules, group = {}, {}, {}, {}
    for name in names:
        value = ns[name]
        if type(value) is bytes and len(value) >= _RAW_MIN:
            raw[name] = value
        elif type(value) in _ATOMS or type(value) is bytes:
            atoms[name] = value
        elif isinstance(value, types.ModuleType) and getattr(value, "__name__", None):
            modules[name] = value
        else:
            group[name] = value
    return raw, atoms, modules, group


def save(staging: str, base_gen: int | None, new_gen: int, limit: int, full: bool) -> _Answer:
    """Save the user's namespace as records staged in ``staging``.

    Args:
        staging: Where new record files go (the host moves them into the state directory).
        base_gen: The generation the host has on disk; records remembered from it are reused.
        new_gen: The generation this save becomes once the host commits it.
        limit: Most bytes of new and reused records together.
        full: Whether to answer when nothing changed (False: ``None`` then, the fast path).
    """
    return _Answer(_save(staging, base_gen, new_gen, limit, full))


def _save(staging: str, base_gen: int | None, new_gen: int, limit: int, full: bool) -> Any:
    ns = _user_ns()
    names = _user_names()
    reuse = base_gen is not None and _last["gen"] == base_gen
    old_raw: dict[str, Any] = _last["raw"] if reuse else {}
    old_atoms = _last["atoms"] if reuse else None
    old_group = _last["group"] if reuse else None
    raw, atoms, modules, group = _split(ns, names)
    pickler, serialiser = _pickler_class()
    unsaved: dict[str, str] = {}
    records: list[dict[str, Any]] = []
    pending: list[tuple[str, Any]] = []  # new raw records to write: (name, value)
    kept_raw: dict[str, Any] = {}
    for name, value in raw.items():
        prev = old_raw.get(name)
        if prev is not None and prev[0] is value:
            records.append(prev[1])
            kept_raw[name] = prev
        else:
            pending.append((name, value))
    atoms_key = tuple((n, id(v)) for n, v in atoms.items())
    atoms_same = old_atoms is not None and old_atoms[0] == atoms_key
    for name, module in modules.items():
        records.append({"kind": "module", "names": [name], "module": module.__name__})
    data, group_names = b"", sorted(group)
    buffers: list[Any] = []
    if group:
        data, buffers, group_names = _group_bytes(group, pickler, unsaved)
    group_crc = _crc(data, buffers)
    group_same = old_group is not None and old_group[0] == (group_crc, tuple(group_names))
    env = _environ()
    shape = (tuple(names), tuple((n, m.__name__) for n, m in modules.items()), tuple(unsaved))
    same = reuse and not pending and (group_same or not group_names) and env == _last["env"]
    same = same and (atoms_same or not atoms)
    if not full and same and shape == _last.get("shape"):
        return None  # nothing changed since the last checkpoint: the fast path
    os.makedirs(staging, exist_ok=True)
    _check_staging(staging)
    sizes = {r["names"][0]: r.get("size", 0) for r in records if r["kind"] == "raw"}
    for name, value in pending:
        file, size, crc, _ = _write(staging, value)
        rec = {"kind": "raw", "names": [name], "file": file, "size": size, "crc": crc}
        records.append(rec)
        kept_raw[name] = (value, rec)
        sizes[name] = size
    new_atoms = None
    if atoms:
        if atoms_same and old_atoms is not None:
            rec = old_atoms[2]
        else:
            file, size, crc, _ = _write(staging, pickle.dumps(atoms, protocol=5))
            rec = {"kind": "atoms", "names": list(atoms), "file": file, "size": size, "crc": crc}
        records.append(rec)
        new_atoms = (atoms_key, tuple(atoms.values()), rec)
    new_group = None
    if group_names:
        if group_same and old_group is not None:
            rec = old_group[1]
        else:
            file, size, crc, parts = _write(staging, data, tuple(buffers))
            rec = {"kind": "group", "names": group_names, "file": file, "size": size}
            rec.update(crc=crc, parts=parts)
        records.append(rec)
        new_group = ((group_crc, tuple(group_names)), rec)
    total = sum(int(r.get("size", 0)) for r in records)
    if total > limit:
        for name in group_names:
            sizes[name] = _size_of(group[name], pickler)
        for name, value in atoms.items():
            sizes[name] = len(pickle.dumps(value, protocol=5))
        biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
        return {"too_large": total, "limit": limit, "biggest": biggest, "records": records}
    _last.update(gen=new_gen, raw=kept_raw, atoms=new_atoms, group=new_group, env=env)
    _last["shape"] = shape
    return {
        "gen": new_gen,
        "records": records,
        "unsaved": unsaved,
        "environ": env,
        "serialiser": serialiser,
        "cwd": os.getcwd(),
    }


def _group_bytes(
    group: dict[str, Any], pickler: Any, unsaved: dict[str, str]
) -> tuple[bytes, list[Any], list[str]]:
    """The group pickled as one graph; names that cannot be pickled are left out (with why)."""
    try:
        data, buffers = _pickle_group(group, pickler)
        return data, buffers, sorted(group)
    except Exception:
        pass
    for name in sorted(group):
        try:
            _pickle_group({name: group[name]}, pickler)
        except Exception as exc:
            unsaved[name] = _why(exc)
    kept = {n: v for n, v in group.items() if n not in unsaved}
    try:
        data, buffers = _pickle_group(kept, pickler)
    except Exception as exc:  # only the names together fail: none of them is saved
        for name in kept:
            unsaved[name] = _why(exc)
        return b"", [], []
    return data, buffers, sorted(kept)


def _why(exc: BaseException) -> str:
    if isinstance(exc, Refused):
        return str(exc)
    return f"cannot be pickled: {type(exc).__name__}: {exc}"[:300]


def _crc(data: bytes, buffers: list[Any]) -> int:
    crc = zlib.crc32(data)
    for b in buffers:
        crc = zlib.crc32(b, crc)
    return crc


def _size_of(value: Any, pickler: Any) -> int:
    try:
        data, buffers = _pickle_group({"v": value}, pickler)
    except Exception:
        return 0
    return len(data) + sum(memoryview(b).nbytes for b in buffers)


def _check_staging(staging: str) -> None:
    st = os.lstat(staging)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{staging} is not a directory")


def forget() -> None:
    """Drop what was remembered of the last save (the next save writes everything)."""
    _last.update(gen=None, raw={}, atoms=None, group=None, env=None, shape=None)


# -- restoring --------------------------------------------------------------------------------


def restore(staging: str, cwd: str, records: list[dict[str, Any]], gen: int) -> _Answer:
    """Load ``records`` (files in ``staging``) into the user's namespace; answer which names
    came back and why the others did not."""
    if cwd:
        os.makedirs(cwd, exist_ok=True)
        os.chdir(cwd)  # first: modules imported from the working directory load from there
    ns = _user_ns()
    restored: list[str] = []
    lost: dict[str, str] = {}
    raw: dict[str, Any] = {}
    atoms = group = None
    for rec in records:
        names = [str(n) for n in rec.get("names", [])]
        try:
            values = _load(staging, rec)
        except Exception as exc:
            for name in names:
                lost[name] = f"not restored: {type(exc).__name__}: {exc}"[:300]
            continue
        ns.update(values)
        restored.extend(values)
        if rec["kind"] == "raw":
            raw[names[0]] = (values[names[0]], rec)
        elif rec["kind"] == "atoms":
            atoms = (tuple((n, id(values[n])) for n in names), tuple(values.values()), rec)
        elif rec["kind"] == "group":
            group = ((int(rec["crc"]), tuple(names)), rec)
    _last.update(gen=gen if not lost else None, raw=raw, atoms=atoms, group=group, env=None)
    _last["shape"] = None
    return _Answer({"restored": sorted(restored), "lost": lost})


def _environ() -> dict[str, str]:
    """``os.environ`` without a run's own variables (``env_vars=`` of one call, set only
    while it runs, and undone only after its report, where an after-call checkpoint is made)."""
    env = dict(os.environ)
    helper = sys.modules.get("__kernelexec__")
    overlay = getattr(helper, "_state", {}).get("env_saved") or {}
    for key, old in overlay.items():
        if old is None:
            env.pop(key, None)
        else:
            env[key] = old
    return env


def set_environ(environ: dict[str, str], keep: Any = ()) -> None:
    """Make ``os.environ`` what was saved (keys the saved environment lacks are removed),
    except the names in ``keep``: the executor's ``env_vars``, whose fresh values win."""
    keep = set(keep)
    for key in list(os.environ):
        if key not in environ and key not in keep:
            del os.environ[key]
    os.environ.update({k: v for k, v in environ.items() if k not in keep})


def _load(staging: str, rec: dict[str, Any]) -> dict[str, Any]:
    kind = rec["kind"]
    names = rec["names"]
    if kind == "module":
        return {names[0]: importlib.import_module(str(rec["module"]))}
    data = _read(os.path.join(staging, os.path.basename(str(rec["file"]))), rec)
    if kind == "raw":
        return {names[0]: bytes(data)}
    if kind == "atoms":
        values = pickle.loads(data)
        if not isinstance(values, dict) or list(values) != list(names):
            raise ValueError("the checkpoint's atoms do not match its manifest")
        return values
    parts = [int(p) for p in rec["parts"]]
    view = memoryview(data)
    head, offset, buffers = view[: parts[0]], parts[0], []
    for size in parts[1:]:
        buffers.append(view[offset : offset + size])
        offset += size
    values = pickle.loads(head, buffers=buffers)
    if not isinstance(values, dict):
        raise ValueError("the checkpoint holds no namespace")
    return values


def _read(path: str, rec: dict[str, Any]) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError("the record is not a regular file")
        data = f.read(int(rec["size"]))  # exactly: a longer read would be shrunk by a copy
        longer = f.read(1)
    if longer or len(data) != int(rec["size"]) or zlib.crc32(data) != int(rec["crc"]):
        raise ValueError("the checkpoint record is damaged (size or checksum differ)")
    return data


def after_call_hook(staging: str, limit: int) -> Any:
    """The kernel side's report hook: a checkpoint of what changed since the last one, or
    None when nothing did."""

    def hook() -> Any:
        gen = _last["gen"]
        try:
            return _save(staging, gen, (gen or 0) + 1, limit, full=gen is None)
        except Exception as exc:
            forget()
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}

    return hook


def handle() -> _Answer:
    """Serve one request of the host (its operation and arguments ride in the metadata)."""
    from IPython import get_ipython  # type: ignore[attr-defined,unused-ignore]

    meta = get_ipython().kernel.get_parent()["metadata"]["kernelexec_state"]
    hook = meta.get("hook")
    if hook is not None:
        hooks = sys.modules["__kernelexec__"]._state.setdefault("report_hooks", {})
        hooks.pop(HOOK_KEY, None)
        if hook.get("on"):
            hooks[HOOK_KEY] = after_call_hook(str(hook["staging"]), int(hook["limit"]))
    op, args = meta["op"], meta["args"]
    try:
        if op == "save":
            return save(args["staging"], args["base"], args["gen"], args["limit"], args["full"])
        if op == "restore":
            answer = restore(args["staging"], args["cwd"], args["records"], args["gen"])
            set_environ(args["environ"], args.get("keep", ()))
            return answer
        if op == "forget":
            forget()
        return _Answer({})
    except Exception as exc:
        forget()
        return _Answer({"error": f"{type(exc).__name__}: {exc}"[:500]})
