"""Files and formats: the input door (files.py), the output door (outputs.py) and the strict
typed parsing of the config dataclasses (schema.py)."""
