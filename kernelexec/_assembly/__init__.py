"""The session assembly: the public executor, and the sessions it makes by wiring the session
features (durable state, branching, code mode, files, the recording, live attach) around the
kernels of the core (:mod:`kernelexec._core`), which imports none of them."""
