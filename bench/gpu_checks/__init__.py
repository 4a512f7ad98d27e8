"""The checks of bench/gpu_check.py, one subject per module; harness.py is what they share."""
