"""The parts of the GPU check ``scripts/gpu_check.py`` (run that script; these modules are its pieces)."""
