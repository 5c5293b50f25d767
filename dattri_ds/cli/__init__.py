"""Command plumbing: one error path for every command line (exits.py) and what a command
prints (noise.py)."""
