"""The capture stage: per-example gradients from any loop that calls ``backward()``.

hooks.py (``GradientCapture``), collect.py (the offline probe loop), semantics.py (what the
per-example gradient means), tied.py (shared weights), spill.py (capture once, replay from
disk), callbacks.py (``TrainingCallback``), config.py (``CaptureConfig``) and engine.py (the
``EngineAdapter`` protocol engines register with). The public names are exported by
``dattri_ds``.
"""
