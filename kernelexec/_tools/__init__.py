"""Tools: the ``Tool`` value and JSON schemas made from Python signatures."""
