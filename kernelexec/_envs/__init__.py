"""Environments kernels run in: the values (``LocalEnv``, ``VenvEnv``) and the venv builder."""
