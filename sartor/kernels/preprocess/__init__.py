"""Preprocessing kernels: uint8 frames to an engine's input in one launch (letterbox.py), the
filter taps it reads (taps.py), and the torch path it falls back to (torch_path.py)."""
