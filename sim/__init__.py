"""loom's simulator: the scheduling core on a virtual clock (see simulator.py and `python -m sim`)."""
