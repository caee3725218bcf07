"""Notebooks: file io, session recording, replay, tool authoring and the IPython magics."""
