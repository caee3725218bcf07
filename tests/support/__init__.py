"""What the tests share that is not a test: real helper processes (a gateway, wheels), process
lookups, deadlines, the skip guard, and modules the tests' kernels import."""
