"""kernelexec's protocol over Jupyter messaging: the kernel-side helper and its host half."""
