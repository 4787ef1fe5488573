"""The sanitizer benchmark: engine-like programs with planted races and their race-free twins, run
under this project's sanitizer and PyTorch's."""
