"""What a device needs around an engine: signing keys and signed engines (signing.py)."""
