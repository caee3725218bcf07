"""The loader of kernel halves: the code of every install request (``_install.LOADER`` is this
function's text and one call of it).

It runs in the kernel as the request's cell, in the user's namespace: the function is the only
name it defines there (and deletes after the call), and it imports inside, so nothing of it
stays. Standard library only (IPython is the kernel's own).
"""


def __kx_install(key: str, payload: str, filename: str, compiled: str) -> None:
    """For each module of the request's install spec (metadata ``key``), in order: execute it
    from its source as a fresh module under its name where the kernel lacks it or does not
    keep it (a module that fails to execute is not left half-made in ``sys.modules``), then call
    its entry function with the spec's arguments. The answers go back in one ``payload``. A
    source the kernel's fork server compiled already (module ``compiled``'s ``codes``, by text)
    is not compiled again."""
    import sys
    import types
    from typing import Any

    from IPython import get_ipython

    ip: Any = get_ipython()
    spec = ip.kernel.get_parent()["metadata"][key]
    codes = getattr(sys.modules.get(compiled), "codes", None)
    answers = []
    for name, source, keep, entry, args in spec["modules"]:
        mod = sys.modules.get(name)
        if mod is None or not keep:
            mod = sys.modules[name] = types.ModuleType(name)
            code = codes.get(source) if isinstance(codes, dict) else None
            if not isinstance(code, types.CodeType):
                code = compile(source, filename, "exec")
            try:
                exec(code, mod.__dict__)
            except BaseException:
                del sys.modules[name]
                raise
        answers.append(getattr(mod, entry)(*args) if entry else None)
    ip.payload_manager.write_payload({"source": payload, "answers": answers})
