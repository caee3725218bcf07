"""The ``kernelexec`` command line, its progress display and the demo."""
