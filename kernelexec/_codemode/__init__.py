"""Code mode: host functions that code running in a kernel can import and call.

``AsyncSession.expose`` (and ``host_functions=`` for one call) makes host callables importable
in the kernel (``from tools import search``) with their signatures and docstrings. A call from
kernel code travels over the kernel's own connection: an iopub message to the host, the answer
on the control channel (``_kernel_side.py`` is the kernel's half, a kernel module). Folder layout:
``_session`` (the host half's one watcher of the session's lease, which ``AsyncSession.expose``
and its twin in ``_sync.py`` delegate to and the run pipeline calls around each run),
``_functions`` (one function: schema, checks, running it), ``_exposure`` (a session's modules and
installing them in each kernel), ``_calls`` (one run's calls on the host), ``_stubs`` (a
recording's calls for replay). Nothing in ``_core`` names this folder.
"""
