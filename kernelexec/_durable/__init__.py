"""Durable sessions: an agent's state saved under a ``state_dir`` and restored into a fresh
kernel (the store, the kernel-side save/restore code, the working directory's files)."""
