"""aiolm's native kernels: C++ for the CPU (built on first use, see cpu.py), Triton for GPUs
(triton/, imported only where triton is installed)."""
