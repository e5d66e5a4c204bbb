"""aiolm's native kernels: C++ for the CPU (built on first use, see cpu.py)."""
