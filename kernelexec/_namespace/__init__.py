"""What a session's namespace holds and what a run changed in it: the kernel half
(``_kernel_namespace.py``, a kernel module) and the host half that reads its answers (``_view``)."""
