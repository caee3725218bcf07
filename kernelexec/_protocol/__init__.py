"""kernelexec's protocol over Jupyter messaging: the kernel-side helper and its host half.

``_host`` builds requests and reads replies on the host; ``_install`` ships every feature's
kernel half into a kernel (the declared kernel modules, the one install request and loader);
``_kernel_side`` (with its companions ``_kernel_budget``, ``_kernel_tuning`` and
``_kernel_output``) is installed in every kernel and runs there, standard library only.
"""
