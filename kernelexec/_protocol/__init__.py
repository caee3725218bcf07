"""kernelexec's protocol over Jupyter messaging: the kernel-side helper and its host half.

``_host`` builds requests and reads replies on the host; ``_kernel_side`` (with its companions
``_kernel_budget``, ``_kernel_tuning`` and ``_kernel_output``) is sent to every kernel as text
and runs there, standard library only.
"""
