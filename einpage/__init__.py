"""einpage: run einsum tensor programs that do not fit in GPU memory."""
__version__ = "0.1.0"
