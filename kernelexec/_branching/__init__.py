"""Branching live sessions: forking a kernel into children, snapshots and restores."""
