"""Notebook files: reading and writing them, and the tools authored in them (below the tools).

Recording a session (``_recording.py``), replaying a notebook (``_replay.py``) and the IPython
magics (``_magics.py``) use these files from three other heights of the layering, so they are
modules of their own beside this folder.
"""
